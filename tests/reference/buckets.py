"""Pure-Python oracle for gradient-bucket planning, written from Megatron's semantics.

Layouts, bucket groups, buffer grouping and shard ranges on plain lists; slow and obvious.
"""

from __future__ import annotations

import math


def pad(value: int, divisor: int) -> int:
    """Megatron's ``_pad``: float ceil, as upstream computes it."""
    return int(math.ceil(value / divisor) * divisor)


def layout(numels, shared=None, bucket_size=None, dp=1, distopt=True, busbw=False):
    """Returns (starts, ends, bucket_ids, bucket_indices, unpadded) with params in model order."""
    n = len(numels)
    shared = shared or [False] * n
    divisor = math.lcm(dp, 128, 2**16) if busbw else math.lcm(dp, 128)
    starts, ends, ids = [0] * n, [0] * n, [0] * n
    bucket_indices, unpadded = [], []
    state = {"bucket_start": 0, "bucket_id": 0, "count": 0}

    def close(end):
        unpadded.append(end - state["bucket_start"])
        padded = pad(end, divisor) if distopt else end
        bucket_indices.append((state["bucket_start"], padded))
        state["bucket_start"] = padded
        state["bucket_id"] += 1
        state["count"] = 0
        return padded

    start = 0
    end = 0
    for i in reversed(range(n)):
        if distopt:
            start = pad(start, 64)
        alone = distopt and bool(shared[i])
        if alone and state["count"] > 0:
            start = close(start)
        end = start + numels[i]
        starts[i], ends[i], ids[i] = start, end, state["bucket_id"]
        state["count"] += 1
        if (bucket_size is not None and end - state["bucket_start"] >= bucket_size) or alone:
            start = close(end)
        else:
            start = end
    if state["count"] > 0:
        close(end)
    return starts, ends, ids, bucket_indices, unpadded


def shard_ranges(starts, ends, ids, bucket_indices, dp, ranks=None):
    """Rows (rank, bucket, param, world, in_bucket, local, param_range) ordered by rank, bucket,
    layout (reverse model) order, as _build_model_gbuf_range + _build_model_gbuf_param_range_map."""
    n = len(starts)
    by_bucket = [[] for _ in bucket_indices]
    for i in reversed(range(n)):
        by_bucket[ids[i]].append(i)
    rows = []
    for r in range(dp) if ranks is None else ranks:
        for b, (offset, bucket_end) in enumerate(bucket_indices):
            size = bucket_end - offset
            assert size % dp == 0
            shard = size // dp
            world_start = offset + r * shard
            world_end = offset + min(size, (r + 1) * shard)
            for i in by_bucket[b]:
                local_start = max(0, starts[i] - world_start)
                local_end = min(world_end - world_start, ends[i] - world_start)
                if local_end > local_start:
                    world = (local_start + world_start, local_end + world_start)
                    sub = max(0, world_start - starts[i])
                    rows.append(
                        (r, b, i, world, (world[0] - offset, world[1] - offset), (local_start, local_end),
                         (sub, sub + local_end - local_start))
                    )
    return rows


def partition(is_uint8, num_buckets, force_single=False, rs_fp32=False):
    """Lists of (buffer, bucket) pairs, one list per bucket group."""
    assert sum(bool(x) for x in is_uint8) <= 1
    if not num_buckets:
        return []
    every = [(b, j) for b in range(len(num_buckets)) for j in range(num_buckets[b])]
    if force_single:
        return [every]
    if not any(is_uint8):
        return [[pair] for pair in every]
    fp8 = [bool(x) for x in is_uint8].index(True)
    others = [pair for pair in every if pair[0] != fp8]
    if rs_fp32:  # each bucket alone, fp8 ones first; the rest follow the last fp8 bucket
        fp8_pairs = [(fp8, j) for j in range(num_buckets[fp8])]
        return [[pair] for pair in fp8_pairs + (others if fp8_pairs else [])]
    groups = []
    for j in range(num_buckets[fp8]):
        groups.append([(fp8, j)] + (others if j == num_buckets[fp8] - 1 else []))
    return groups


def group(keys, fake_keys):
    """keys[i]: param i's buffer key; fake_keys[i]: its counter key. Returns {key: (indices, param_indices)}."""
    result, counters = {}, {}
    for i, (key, fake) in enumerate(zip(keys, fake_keys)):
        entry = result.setdefault(key, ([], []))
        entry[0].append(i)
        entry[1].append(counters.get(fake, 0))
        counters[fake] = counters.get(fake, 0) + 1
    return result


class FakeGroup:
    """A process group's size() and rank(): runs megatron's layout and range code without torch.distributed."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
