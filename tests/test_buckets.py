"""Gradient-bucket planning: issue vectors, native == oracle on random models, Megatron's own entry
points with and without trainfast's patch, bad input."""

from __future__ import annotations

import math
import random
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.reference import buckets as ref
from tests.reference.buckets import FakeGroup

with warnings.catch_warnings():
    # megatron-core's optimizer package imports torch modules that warn on import (CPU, no TE).
    warnings.simplefilter("ignore")
    megatron_pgb = pytest.importorskip("megatron.core.distributed.param_and_grad_buffer")
    pytest.importorskip("megatron.core.optimizer.distrib_optimizer")

from trainfast import _core, buckets
from trainfast._util import UpstreamAssertionError

DPS = [1, 2, 3, 8, 64, 1000]


def as_lists(layout):
    return (
        layout.param_start.tolist(),
        layout.param_end.tolist(),
        layout.bucket_id.tolist(),
        [tuple(x) for x in layout.bucket_indices.tolist()],
        layout.per_bucket_numel_unpadded.tolist(),
    )


def rows(table):
    return list(
        zip(
            table.rank.tolist(),
            table.bucket.tolist(),
            table.param.tolist(),
            map(tuple, table.gbuf_world.tolist()),
            map(tuple, table.gbuf_world_in_bucket.tolist()),
            map(tuple, table.gbuf_local.tolist()),
            map(tuple, table.param_range.tolist()),
        )
    )


# --- the test vectors -----------------------------------------------------------------------


def test_vector_two_params_one_bucket():
    layout = buckets.plan_layout([97, 103], data_parallel_world_size=2)
    assert layout.param_start.tolist() == [128, 0] and layout.param_end.tolist() == [225, 103]
    assert layout.bucket_id.tolist() == [0, 0]
    assert layout.bucket_indices.tolist() == [[0, 256]]
    assert layout.per_bucket_numel_unpadded.tolist() == [225]
    assert (layout.numel, layout.numel_unpadded) == (256, 225)


def test_vector_bucket_size_split_and_default_layout():
    layout = buckets.plan_layout([5000] * 3, bucket_size=8000, data_parallel_world_size=2)
    assert list(zip(layout.param_start.tolist(), layout.param_end.tolist(), layout.bucket_id.tolist())) == [
        (10112, 15112, 1), (5056, 10056, 0), (0, 5000, 0)
    ]
    assert layout.bucket_indices.tolist() == [[0, 10112], [10112, 15232]]
    assert layout.per_bucket_numel_unpadded.tolist() == [10056, 5000]
    default = buckets.plan_layout([5000] * 3, bucket_size=8000, data_parallel_world_size=2,
                                  use_distributed_optimizer=False)
    assert list(zip(default.param_start.tolist(), default.param_end.tolist(), default.bucket_id.tolist())) == [
        (10000, 15000, 1), (5000, 10000, 0), (0, 5000, 0)
    ]


@pytest.mark.parametrize("bucket_size", [2**63 - 1, 2**63, 10**30])
def test_bucket_size_past_any_buffer_is_none(bucket_size):
    numels, shared = [5000, 3, 700, 5000], [True, False, False, True]
    for options in ({}, {"use_distributed_optimizer": False}, {"pad_buckets_for_high_nccl_busbw": True}):
        huge = buckets.plan_layout(numels, bucket_size=bucket_size, shared_embedding=shared,
                                   data_parallel_world_size=4, **options)
        none = buckets.plan_layout(numels, bucket_size=None, shared_embedding=shared, data_parallel_world_size=4,
                                   **options)
        for field in ("param_start", "param_end", "bucket_id", "bucket_indices", "per_bucket_numel_unpadded"):
            assert torch.equal(getattr(huge, field), getattr(none, field)), field
        assert (huge.numel, huge.numel_unpadded) == (none.numel, none.numel_unpadded)


def test_vector_shared_embeddings():
    layout = buckets.plan_layout([1000, 100, 1000, 1000], shared_embedding=[True, False, False, True],
                                 data_parallel_world_size=4)
    emb, a, b, head = zip(layout.param_start.tolist(), layout.param_end.tolist(), layout.bucket_id.tolist())
    assert head == (0, 1000, 0) and b == (1024, 2024, 1) and a == (2048, 2148, 1) and emb == (2176, 3176, 2)
    assert layout.bucket_indices.tolist() == [[0, 1024], [1024, 2176], [2176, 3200]]
    assert layout.per_bucket_numel_unpadded.tolist() == [1000, 1152, 1000]


def test_vector_dp3_and_busbw_padding():
    assert buckets.plan_layout([1000], data_parallel_world_size=3).bucket_indices.tolist() == [[0, 1152]]
    busbw = buckets.plan_layout([1000], data_parallel_world_size=3, pad_buckets_for_high_nccl_busbw=True)
    assert busbw.bucket_indices.tolist() == [[0, 196608]]


def test_vector_shard_ranges_rank1_bucket1():
    layout = buckets.plan_layout([5000] * 3, bucket_size=8000, data_parallel_world_size=2)
    table = buckets.shard_ranges(layout, 2)
    mine = [r for r in rows(table) if r[0] == 1 and r[1] == 1]
    assert mine == [(1, 1, 0, (12672, 15112), (2560, 5000), (0, 2440), (2560, 5000))]
    assert rows(buckets.shard_ranges(layout, 2, rank=1)) == [r for r in rows(table) if r[0] == 1]


def test_default_bucket_size():
    assert buckets.default_bucket_size(8) == 40_000_000
    assert buckets.default_bucket_size(256) == 256_000_000


# --- differential: native == oracle ----------------------------------------------------------------


@st.composite
def models(draw):
    n = draw(st.integers(0, 24))
    big = draw(st.booleans())
    numels = draw(st.lists(st.integers(0 if not big else 1, 10**7 if big else 5000), min_size=n, max_size=n))
    where = draw(st.sampled_from(["none", "first", "last", "middle", "random", "all"]))
    shared = [False] * n
    if n:
        if where == "first":
            shared[0] = True
        elif where == "last":
            shared[-1] = True
        elif where == "middle":
            shared[n // 2] = True
        elif where == "random":
            shared = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        elif where == "all":
            shared = [True] * n
    dp = draw(st.sampled_from(DPS))
    total = max(sum(numels), 1)
    bucket_size = draw(st.sampled_from([None, 1, max(1, total // 7), max(1, total // 2), total * 2]))
    return numels, shared, bucket_size, dp, draw(st.booleans()), draw(st.booleans())


@given(models())
def test_layout_and_ranges_match_oracle(model):
    numels, shared, bucket_size, dp, distopt, busbw = model
    layout = buckets.plan_layout(numels, shared_embedding=shared, bucket_size=bucket_size,
                                 data_parallel_world_size=dp, use_distributed_optimizer=distopt,
                                 pad_buckets_for_high_nccl_busbw=busbw)
    expected = ref.layout(numels, shared, bucket_size, dp, distopt, busbw)
    assert as_lists(layout) == expected
    assert layout.numel == (expected[3][-1][1] if expected[3] else 0)
    assert layout.numel_unpadded == sum(expected[4])
    if distopt:
        table = buckets.shard_ranges(layout, dp, num_threads=3)
        assert rows(table) == ref.shard_ranges(*expected[:4], dp)
        one = dp // 2
        assert rows(buckets.shard_ranges(layout, dp, rank=one)) == [r for r in rows(table) if r[0] == one]
        # every padded element of every bucket is owned exactly once across ranks
        owned = int((table.gbuf_world[:, 1] - table.gbuf_world[:, 0]).sum()) if len(table.rank) else 0
        assert owned == sum(numels)


@pytest.mark.parametrize("seed", range(6))
def test_big_random_models_all_ranks(seed):
    rng = random.Random(seed)
    n = rng.randint(200, 2000)
    numels = [rng.choice([rng.randint(1, 10**7), rng.randint(1, 4096), rng.randint(0, 64)]) for _ in range(n)]
    shared = [False] * n
    shared[0] = shared[-1] = rng.random() < 0.7
    dp = rng.choice(DPS)
    bucket_size = rng.choice([None, 10**6, 4 * 10**7])
    layout = buckets.plan_layout(numels, shared_embedding=shared, bucket_size=bucket_size, data_parallel_world_size=dp)
    expected = ref.layout(numels, shared, bucket_size, dp)
    assert as_lists(layout) == expected
    ranks = sorted(rng.sample(range(dp), min(dp, 5)))
    table = buckets.shard_ranges(layout, dp, num_threads=2)
    want = ref.shard_ranges(*expected[:4], dp, ranks=ranks)
    got = [r for r in rows(table) if r[0] in set(ranks)]
    assert got == want
    # results never depend on the thread count
    assert rows(buckets.shard_ranges(layout, dp, num_threads=1)) == rows(table)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=6), st.booleans(), st.booleans())
def test_partition_matches_oracle(buffers_spec, force_single, rs_fp32):
    flags = [False] * len(buffers_spec)
    if buffers_spec and buffers_spec[0][0]:
        flags[len(buffers_spec) // 2] = True  # at most one uint8 buffer
    counts = [c for _, c in buffers_spec]
    got = buckets.partition_bucket_indices(flags, counts, force_single_bucket_group=force_single,
                                           reduce_scatter_with_fp32_accumulation=rs_fp32)
    assert got.groups() == ref.partition(flags, counts, force_single, rs_fp32)


def test_partition_vectors():
    groups = buckets.partition_bucket_indices([False, True], [2, 3]).groups()
    assert groups == [[(1, 0)], [(1, 1)], [(1, 2), (0, 0), (0, 1)]]
    assert buckets.partition_bucket_indices([False, False], [2, 1]).groups() == [[(0, 0)], [(0, 1)], [(1, 0)]]
    single = buckets.partition_bucket_indices([False, True], [2, 1], force_single_bucket_group=True)
    assert single.groups() == [[(0, 0), (0, 1), (1, 0)]]
    assert buckets.partition_bucket_indices([], []).groups() == []


# --- drop-ins ------------------------------------------------------------------------------------------


def make_params(rng, n, *, dtypes=(torch.bfloat16,), experts=False, shared_ends=False):
    params = []
    for i in range(n):
        numel = rng.choice([rng.randint(1, 300), rng.randint(1, 5000)])
        p = torch.nn.Parameter(torch.zeros(numel, dtype=rng.choice(dtypes)))
        if experts and rng.random() < 0.4:
            p.allreduce = False
        params.append(p)
    if shared_ends and n:
        params[0].shared_embedding = True
        params[-1].shared_embedding = True
    return params


def test_group_params_for_buffers_matches_oracle(monkeypatch):
    # Upstream calls is_float8tensor by the name param_and_grad_buffer imported: the stand-in goes there.
    from megatron.core.distributed import param_and_grad_buffer as fp8_utils

    rng = random.Random(3)
    params = make_params(rng, 300, dtypes=(torch.bfloat16, torch.float32, torch.float16), experts=True)
    fp8 = {id(p) for p in params if rng.random() < 0.3}
    monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: id(t) in fp8)
    for fp32_grads in (False, True):
        got = buckets.group_params_for_buffers(params, fp32_grads)
        keys, fake = [], []
        for p in params:
            grad = torch.float if fp32_grads else p.dtype
            expert = not getattr(p, "allreduce", True)
            keys.append((torch.uint8 if id(p) in fp8 else p.dtype, grad, expert))
            fake.append((p.dtype, grad, expert))
        want = ref.group(keys, fake)
        assert [(k.param_dtype, k.grad_dtype, k.is_expert_parallel) for k in got] == list(want)
        for key, (plist, indices) in got.items():
            idx, want_indices = want[(key.param_dtype, key.grad_dtype, key.is_expert_parallel)]
            assert [id(p) for p in plist] == [id(params[i]) for i in idx]
            assert indices == want_indices


@pytest.mark.parametrize("seed", range(4))
def test_per_buffer_and_full_layout_dropins(seed, monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer as fp8_utils

    rng = random.Random(5 + seed)
    params = make_params(rng, 60, dtypes=(torch.bfloat16, torch.float32), experts=True, shared_ends=True)
    fp8 = {id(p) for p in params if rng.random() < 0.25}
    monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: id(t) in fp8)
    config = types.SimpleNamespace(grad_reduce_in_fp32=False, pad_buckets_for_high_nccl_busbw=False)
    layout = buckets.compute_per_buffer_param_layout(params, 20000, 8, config, param_indices=list(range(60)))
    starts, ends, ids, bucket_indices, unpadded = ref.layout(
        [p.numel() for p in params], [getattr(p, "shared_embedding", False) for p in params], 20000, 8
    )
    assert list(layout.param_index_map) == params[::-1]
    assert [layout.param_index_map[p] for p in params] == list(zip(starts, ends, ids))
    assert layout.bucket_indices == bucket_indices and layout.per_bucket_numel_unpadded == unpadded
    assert layout.param_indices == list(range(60)) and layout.num_optimizer_shards == 8

    default = buckets.compute_default_per_buffer_param_layout(params, 20000)
    d_starts, d_ends, d_ids, d_buckets, _ = ref.layout([p.numel() for p in params], None, 20000, 1, distopt=False)
    assert [default.param_index_map[p] for p in params] == list(zip(d_starts, d_ends, d_ids))
    assert default.bucket_indices == d_buckets

    config.grad_reduce_in_fp32 = bool(seed % 2)
    full = buckets.compute_full_param_layout(params, 20000, 8, config, expert_data_parallel_world_size=2)
    grouped = buckets.group_params_for_buffers(params, config.grad_reduce_in_fp32)
    assert list(full.layouts) == list(grouped)
    assert any(key.param_dtype == torch.uint8 for key in grouped) == bool(fp8)
    for key, per_buffer in full.layouts.items():
        plist, indices = grouped[key]
        world = 2 if key.is_expert_parallel else 8
        want = ref.layout([p.numel() for p in plist], [getattr(p, "shared_embedding", False) for p in plist],
                          20000, world)
        assert [per_buffer.param_index_map[p] for p in plist] == list(zip(*want[:3]))
        assert per_buffer.param_indices == indices


def test_layout_dropins_fit_a_layout_class_without_num_optimizer_shards(monkeypatch):
    """megatron-core 0.18 has PerBufferParamLayout but not its num_optimizer_shards field (0.19 added
    it): the drop-ins must build it without that keyword, as 0.18's own code does."""
    import dataclasses

    @dataclasses.dataclass
    class PerBufferParamLayout018:
        param_index_map: dict = dataclasses.field(default_factory=dict)
        bucket_indices: list = dataclasses.field(default_factory=list)
        per_bucket_numel_unpadded: list = dataclasses.field(default_factory=list)
        param_indices: list = dataclasses.field(default_factory=list)

    key_type, _, full_type = buckets._dataclasses()
    monkeypatch.setattr(buckets, "_dataclasses", lambda: (key_type, PerBufferParamLayout018, full_type))
    params = make_params(random.Random(3), 12)
    config = types.SimpleNamespace(grad_reduce_in_fp32=False, pad_buckets_for_high_nccl_busbw=False)
    layout = buckets.compute_per_buffer_param_layout(params, 5000, 4, config, param_indices=tuple(range(12)))
    assert type(layout) is PerBufferParamLayout018
    assert layout.param_indices == tuple(range(12))  # kept as given, as upstream does
    starts, ends, ids, bucket_indices, _ = ref.layout(
        [p.numel() for p in params], [getattr(p, "shared_embedding", False) for p in params], 5000, 4)
    assert [layout.param_index_map[p] for p in params] == list(zip(starts, ends, ids))
    assert layout.bucket_indices == bucket_indices
    full = buckets.compute_full_param_layout(params, 5000, 4, config)
    assert all(type(per_buffer) is PerBufferParamLayout018 for per_buffer in full.layouts.values())
    assert type(buckets.compute_default_per_buffer_param_layout(params, 5000)) is PerBufferParamLayout018


# --- real megatron-core: its own entry points with and without the patch --------------------------------


@pytest.fixture
def megatron_cpu(monkeypatch):
    """Lets megatron-core 0.16's _ParamAndGradBuffer build on CPU without torch.distributed."""
    pgb = pytest.importorskip("megatron.core.distributed.param_and_grad_buffer")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)
    return pgb


def build_buffer(pgb, params, *, dp, bucket_size, distopt, busbw=False, param_dtype=torch.bfloat16, group=None):
    from megatron.core.distributed import DistributedDataParallelConfig

    config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, pad_buckets_for_high_nccl_busbw=busbw)
    group = group or FakeGroup(dp)
    pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=group)
    return pgb._ParamAndGradBuffer(
        config, param_dtype, torch.float32, params, group, bucket_size, {p: f"p{i}" for i, p in enumerate(params)},
        1.0, list(range(len(params))), False, pg_collection=pg,
    ), config


@pytest.mark.parametrize("seed", range(8))
def test_megatron_buffer_layout_matches_dropins(megatron_cpu, seed):
    rng = random.Random(seed)
    params = make_params(rng, rng.randint(1, 80), shared_ends=rng.random() < 0.5)
    dp = rng.choice(DPS)
    bucket_size = 0 if seed == 0 else rng.choice([None, 3000, 40000])  # 0: a bucket per param, as Megatron
    distopt = rng.random() < 0.7
    busbw = rng.random() < 0.3
    buffer, config = build_buffer(megatron_cpu, params, dp=dp, bucket_size=bucket_size, distopt=distopt, busbw=busbw)
    if distopt:
        ours = buckets.compute_per_buffer_param_layout(params, bucket_size, dp, config)
    else:
        ours = buckets.compute_default_per_buffer_param_layout(params, bucket_size)
    assert list(ours.param_index_map.items()) == list(buffer.param_index_map.items())
    assert ours.bucket_indices == list(buffer.bucket_indices)
    assert sum(ours.per_bucket_numel_unpadded) == buffer.numel_unpadded
    assert [b.numel_unpadded for b in buffer.buckets] == ours.per_bucket_numel_unpadded
    # materialize lays views out as the buffer's _get does
    layout = buckets.plan_layout([p.numel() for p in params],
                                 shared_embedding=[getattr(p, "shared_embedding", False) for p in params],
                                 bucket_size=bucket_size, data_parallel_world_size=dp,
                                 use_distributed_optimizer=distopt, pad_buckets_for_high_nccl_busbw=busbw)
    assert layout.numel == buffer.numel
    views = buckets.materialize(layout, params, grad_dtype=torch.float32)
    for p, view in zip(params, views.grad_views):
        assert view.storage_offset() == p.main_grad.storage_offset() and view.shape == p.main_grad.shape


def range_maps_as_tuples(data):
    return [
        (id(param), {name: (r.start, r.end, r.size) for name, r in ranges.items()})
        for param, ranges in data["param_map"].items()
    ]


class RangeBuffer:
    """The attributes the range builder reads from a _ParamAndGradBuffer."""

    def __init__(self, param_index_map, bucket_indices, dp, rank=0):
        self.param_index_map = param_index_map
        self.buckets = [types.SimpleNamespace(offset=start, grad_data=torch.empty(end - start, device="meta"))
                        for start, end in bucket_indices]
        self.data_parallel_group = FakeGroup(dp, rank)
        self.num_optimizer_shards = None


def full_scan_ranges(buffer, bucket_index):
    """The range builder's answer from a plain pass over the dict (no snapshot)."""
    dp, rank = buffer.data_parallel_group.size(), buffer.data_parallel_group.rank()
    bucket = buffer.buckets[bucket_index]
    shard = bucket.grad_data.numel() // dp
    world = buckets._range_type()(bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard)
    return {"param_map": buckets.build_model_gbuf_param_range_map(buffer.param_index_map, world, bucket.offset)}


@pytest.mark.parametrize("seed", range(4))
def test_range_builder_snapshot_follows_dict_changes(seed):
    """The range builder keeps a snapshot of each buffer's param_index_map between calls: any change to
    the dict (a value replaced, an entry deleted or re-added, a new dict, any order) gives the answer
    of a fresh pass."""
    rng = random.Random(700 + seed)
    params = make_params(rng, rng.randint(2, 50), shared_ends=rng.random() < 0.5)
    dp = rng.choice([1, 2, 3, 8])
    layout = buckets.plan_layout([p.numel() for p in params], bucket_size=rng.choice([None, 3000]),
                                 data_parallel_world_size=dp)
    index_map = dict(zip(params[::-1], zip(layout.param_start.tolist()[::-1], layout.param_end.tolist()[::-1],
                                           layout.bucket_id.tolist()[::-1])))
    buffer = RangeBuffer(index_map, layout.bucket_indices.tolist(), dp)

    def check_all():
        for r in range(dp):
            buffer.data_parallel_group = FakeGroup(dp, r)
            for b in range(len(buffer.buckets)):
                got = buckets.build_model_gbuf_range(buffer, b)
                assert range_maps_as_tuples(got) == range_maps_as_tuples(full_scan_ranges(buffer, b))

    check_all()
    assert buckets._SNAPSHOTS[buffer][0] is index_map  # later calls went through the snapshot
    victim = rng.choice(params)
    start, end, bucket_id = index_map[victim]
    index_map[victim] = (start + 1, end + 1, bucket_id)  # same size, new tuple
    check_all()
    del index_map[victim]
    check_all()
    index_map[victim] = (start, end, bucket_id)  # back, now last in order (starts no longer sorted)
    check_all()
    shuffled = list(index_map.items())
    rng.shuffle(shuffled)
    buffer.param_index_map = dict(shuffled)
    check_all()
    buffer.param_index_map[victim] = [start, end, bucket_id]  # not a tuple: the plain pass answers
    check_all()


def test_build_model_gbuf_range_refuses_a_rank_outside_the_group():
    # torch gives rank -1 to a process outside the group; upstream's list index would hand it the
    # last rank's shard.
    layout = buckets.plan_layout([100, 28], data_parallel_world_size=2)
    index_map = {object(): (0, 100, 0), object(): (100, 128, 0)}
    buffer = RangeBuffer(index_map, layout.bucket_indices.tolist(), 2)
    for rank, match in ((-1, "not a member of the group of size 2"), (2, r"not below the group's size\(\) 2")):
        buffer.data_parallel_group = FakeGroup(2, rank)
        with pytest.raises(ValueError, match=rf"data-parallel rank {rank} .*{match}"):
            buckets.build_model_gbuf_range(buffer, 0)


@pytest.mark.parametrize("seed", range(5))
def test_megatron_range_builders_with_and_without_patch(megatron_cpu, seed):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from trainfast.integrations import megatron

    rng = random.Random(100 + seed)
    params = make_params(rng, rng.randint(1, 60), shared_ends=rng.random() < 0.5)
    dp = rng.choice([1, 2, 3, 8, 64])
    buffer, _ = build_buffer(megatron_cpu, params, dp=dp, bucket_size=rng.choice([None, 2000, 30000]), distopt=True)
    expected = {}
    for r in range(dp):
        buffer.data_parallel_group = FakeGroup(dp, r)
        expected[r] = [range_maps_as_tuples(DistributedOptimizer._build_model_gbuf_range(buffer, b))
                       for b in range(len(buffer.buckets))]
    patched = megatron.patch()
    try:
        assert "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_gbuf_range" in patched
        for r in range(dp):
            buffer.data_parallel_group = FakeGroup(dp, r)
            got = [range_maps_as_tuples(DistributedOptimizer._build_model_gbuf_range(buffer, b))
                   for b in range(len(buffer.buckets))]
            assert got == expected[r]
    finally:
        megatron.unpatch()
    # and the array API agrees with megatron on every rank
    starts = [buffer.param_index_map[p][0] for p in params]
    ends = [buffer.param_index_map[p][1] for p in params]
    ids = [buffer.param_index_map[p][2] for p in params]
    want = ref.shard_ranges(starts, ends, ids, list(buffer.bucket_indices), dp)
    got_rows = []
    for r in range(dp):
        for b, bucket_map in enumerate(expected[r]):
            index_of = {id(p): i for i, p in enumerate(params)}
            for pid, ranges in bucket_map:
                got_rows.append((r, b, index_of[pid], ranges["gbuf_world"][:2], ranges["gbuf_world_in_bucket"][:2],
                                 ranges["gbuf_local"][:2], ranges["param"][:2]))
    assert got_rows == want


def test_megatron_partition_buckets_with_and_without_patch(megatron_cpu):
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    from trainfast.integrations import megatron

    rng = random.Random(7)
    bf16 = make_params(rng, 30)
    fp8_like = [torch.nn.Parameter(torch.zeros(rng.randint(1, 4000), dtype=torch.uint8), requires_grad=False)
                for _ in range(20)]
    group = FakeGroup(2)
    buf_a, _ = build_buffer(megatron_cpu, bf16, dp=2, bucket_size=3000, distopt=True, group=group)
    buf_b, _ = build_buffer(megatron_cpu, fp8_like, dp=2, bucket_size=5000, distopt=True, param_dtype=torch.uint8,
                            group=group)
    cases = [([buf_a], False), ([buf_a, buf_b], False), ([buf_b, buf_a], False), ([buf_a, buf_b], True)]

    def membership(groups):
        return [[id(bucket) for bucket in g.buckets] for g in groups]

    expected = [membership(ddp_module.partition_buckets(bufs, force)) for bufs, force in cases]
    megatron.patch()
    try:
        assert ddp_module.partition_buckets.__trainfast_original__ is not None
        got = [membership(ddp_module.partition_buckets(bufs, force)) for bufs, force in cases]
    finally:
        megatron.unpatch()
    assert got == expected
    with pytest.raises(AssertionError):
        buckets.partition_buckets([buf_a, buf_a], require_distinct_param_dtypes=True)
    with pytest.raises(AssertionError, match="uint8"):
        buckets.partition_buckets([buf_b, buf_a, buf_b])


@pytest.mark.parametrize("release", ["0.17", "0.18"])
def test_partition_buckets_three_argument_forms(megatron_cpu, monkeypatch, tmp_path, release):
    # Both take reduce_scatter_with_fp32_accumulation; only 0.17's refuses two buffers of one dtype.
    import importlib.util

    from megatron.core.distributed import distributed_data_parallel as ddp_module

    from trainfast.integrations import megatron

    # 0.17's check; a mere mention of the name (a comment) is not one.
    body = ("dtype_to_buffer_map = {}\n    for buffer in buffers:\n        dtype = buffer.param_dtype\n"
            "        assert dtype not in dtype_to_buffer_map\n        dtype_to_buffer_map[dtype] = buffer"
            if release == "0.17" else "# no dtype_to_buffer_map here any more\n    pass")
    (tmp_path / "stand_in.py").write_text(
        "def partition_buckets(buffers, force_single_bucket_group=False, "
        f"reduce_scatter_with_fp32_accumulation=False):\n    {body}\n")
    spec = importlib.util.spec_from_file_location("stand_in", tmp_path / "stand_in.py")
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)  # a file, so the patch can read the function's source
    monkeypatch.setattr(ddp_module, "partition_buckets", stand_in.partition_buckets)
    bf16 = make_params(random.Random(3), 10)
    buf_a, _ = build_buffer(megatron_cpu, bf16, dp=2, bucket_size=3000, distopt=True, group=FakeGroup(2))
    patched = megatron.patch()
    try:
        assert f"{ddp_module.__name__}.partition_buckets" in patched
        if release == "0.17":
            with pytest.raises(AssertionError, match="distinct param dtypes"):
                ddp_module.partition_buckets([buf_a, buf_a])
        else:
            assert len(ddp_module.partition_buckets([buf_a, buf_a])) == 2 * len(buf_a.buckets)
    finally:
        megatron.unpatch()


def test_quantized_check_is_the_one_the_buffer_module_calls(monkeypatch):
    # megatron-core 0.18's group_params_for_buffers calls is_float8tensor by the name its module
    # (param_and_grad_buffer) imported: a stand-in bound there counts, one bound in fp8_utils alone does not.
    from megatron.core import fp8_utils
    from megatron.core.distributed import param_and_grad_buffer as pgb

    if hasattr(pgb, "_param_uses_quantized_storage"):
        pytest.skip("this megatron-core has one combined check (tested in megatron_newest_buckets.py)")
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in range(3)]
    params[1]._tf_fp8 = True

    def by_dtype():
        groups = buckets.group_params_for_buffers(params, False)
        return {key.param_dtype: [next(i for i, q in enumerate(params) if q is p) for p in members]
                for key, (members, _) in groups.items()}

    def stand_in(tensor):
        return bool(getattr(tensor, "_tf_fp8", False))

    monkeypatch.setattr(fp8_utils, "is_float8tensor", stand_in)
    assert by_dtype() == {torch.bfloat16: [0, 1, 2]}
    monkeypatch.setattr(pgb, "is_float8tensor", stand_in)
    assert by_dtype() == {torch.bfloat16: [0, 2], torch.uint8: [1]}


def test_partition_buckets_of_an_unknown_form_is_left_to_upstream(monkeypatch):
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    from trainfast.integrations import megatron

    def upstream(buffers, force_single_bucket_group=False, some_new_option=None):
        return "upstream's"

    monkeypatch.setattr(ddp_module, "partition_buckets", upstream)
    patched = megatron.patch()
    try:
        assert f"{ddp_module.__name__}.partition_buckets" not in patched
        assert ddp_module.partition_buckets is upstream
    finally:
        megatron.unpatch()
    assert ddp_module.partition_buckets is upstream


def test_patch_is_reversible():
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from trainfast.integrations import megatron

    original_partition = pgb.partition_buckets
    original_range = DistributedOptimizer.__dict__["_build_model_gbuf_range"]
    megatron.patch()
    assert pgb.partition_buckets is not original_partition
    assert isinstance(DistributedOptimizer.__dict__["_build_model_gbuf_range"], classmethod)
    megatron.unpatch()
    assert pgb.partition_buckets is original_partition
    assert DistributedOptimizer.__dict__["_build_model_gbuf_range"] is original_range


# --- materialize / summary ----------------------------------------------------------------------------


def test_materialize_views_and_main_grad():
    params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(7))]
    layout = buckets.plan_layout([15, 7], data_parallel_world_size=2)
    out = buckets.materialize(layout, params, param_dtype=torch.bfloat16, bind_main_grad=True)
    assert out.grad_data.shape == (layout.numel,) and out.param_data.dtype == torch.bfloat16
    assert params[0].main_grad.shape == (3, 5) and params[0].main_grad.storage_offset() == 64
    params[1].main_grad.fill_(1)
    assert out.grad_data[:7].sum() == 7 and out.grad_data[7:].sum() == 0
    flat = buckets.materialize(layout)
    assert [v.shape for v in flat.grad_views] == [(15,), (7,)] and flat.param_data is None


def test_materialize_binds_main_grad_on_every_param_or_none():
    class ReadOnlyMainGrad(torch.nn.Parameter):
        @property
        def main_grad(self):
            return None

    kept = torch.ones(4)
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4)),
              ReadOnlyMainGrad(torch.zeros(3, 1))]
    params[1].main_grad = kept
    layout = buckets.plan_layout([6, 4, 3], bucket_size=5, data_parallel_world_size=2)
    with pytest.raises(TypeError, match=r"shapes\[2\]: cannot set main_grad"):
        buckets.materialize(layout, params, bind_main_grad=True)
    assert not hasattr(params[0], "main_grad") and params[1].main_grad is kept
    twice = [params[0], params[0], params[2]]  # undone last first: the first view must not stay
    with pytest.raises(TypeError, match=r"shapes\[2\]: cannot set main_grad"):
        buckets.materialize(buckets.plan_layout([6, 6, 3]), twice, bind_main_grad=True)
    assert not hasattr(params[0], "main_grad")


def test_summary_mentions_buckets_and_padding():
    layout = buckets.plan_layout([5000] * 3, bucket_size=8000, data_parallel_world_size=2)
    text = layout.summary()
    assert "3 params in 2 buckets" in text and "padding" in text and "per-rank shard" in text


def test_summary_of_a_ddp_layout_counts_the_grad_buffer_only():
    # Without the distributed optimizer Megatron allocates no param buffer.
    layout = buckets.plan_layout([1024] * 4, bucket_size=None, data_parallel_world_size=2,
                                 use_distributed_optimizer=False)
    assert layout.numel == 4096
    assert "grad buffer per rank: 16.0 KiB (not sharded" in layout.summary(param_bytes=2, grad_bytes=4)


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(numels=[1, 2], data_parallel_world_size=0), "data_parallel_world_size"),
        (dict(numels=[1, 2], data_parallel_world_size=-3), "data_parallel_world_size"),
        (dict(numels=[1, 2], bucket_size=True), "bucket_size"),
        (dict(numels=[1, -2]), "numels"),
        (dict(numels=[1, 2], shared_embedding=[True]), "shared_embedding"),
        (dict(numels=[[1, 2]]), "numels"),
        (dict(numels=[2**62, 2**62]), "numels"),
        (dict(numels=[1], bucket_size=float("nan")), "bucket_size"),
    ],
)
def test_plan_layout_bad_input(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        buckets.plan_layout(**kwargs)


def test_bucket_size_zero_or_less_closes_a_bucket_per_param():
    # Megatron's `param_end - bucket_start >= bucket_size` holds after every param when the size is <= 0.
    for size in (0, -5):
        layout = buckets.plan_layout([1, 2, 3], bucket_size=size, data_parallel_world_size=1,
                                     use_distributed_optimizer=False)
        assert layout.bucket_indices.tolist() == [[0, 3], [3, 5], [5, 6]]
        expected = ref.layout([1, 2, 3], bucket_size=size, distopt=False)[3]
        assert [tuple(b) for b in layout.bucket_indices.tolist()] == expected


def test_float_bucket_size_compares_as_megatron_does():
    # Megatron's DDP config takes bucket_size=4e7 as well as 40_000_000; only `count >= bucket_size`
    # reads it, so a float acts as its ceiling and inf as no limit.
    rng = np.random.default_rng(11)
    for _ in range(40):
        numels = rng.integers(0, 50, int(rng.integers(1, 12))).tolist()
        size = float(rng.choice([rng.uniform(-3, 120), float(rng.integers(0, 60)), np.inf, -np.inf]))
        for distopt in (False, True):
            layout = buckets.plan_layout(numels, bucket_size=size, data_parallel_world_size=2,
                                         use_distributed_optimizer=distopt)
            expected = ref.layout(numels, bucket_size=size, dp=2, distopt=distopt)[3]
            assert [tuple(b) for b in layout.bucket_indices.tolist()] == expected, (numels, size, distopt)
    assert buckets.plan_layout([3, 4], bucket_size=np.float64(3.5)).bucket_indices.tolist() == \
        buckets.plan_layout([3, 4], bucket_size=4).bucket_indices.tolist()
    # A narrower float compares in its own precision (39999998 >= float32(4e7)): refused.
    with pytest.raises(TypeError, match="bucket_size"):
        buckets.plan_layout([3, 4], bucket_size=np.float32(4e7))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(numels=[1.5]), "numels"),
        (dict(numels="abc"), "numels"),
        (dict(numels=[1], bucket_size="2"), "bucket_size"),
        (dict(numels=[1], data_parallel_world_size="2"), "data_parallel_world_size"),
    ],
)
def test_plan_layout_bad_types(kwargs, name):
    with pytest.raises(TypeError, match=name):
        buckets.plan_layout(**kwargs)


def test_a_layout_with_replaced_fields():
    # ParamLayout is a mutable dataclass: fields may come back as other dtypes, views or NumPy.
    import dataclasses

    layout = buckets.plan_layout([5000, 5000, 5000], bucket_size=8000, data_parallel_world_size=2)
    expected = buckets.shard_ranges(layout, 2)
    for replaced in (dict(param_start=layout.param_start.int()),
                     dict(param_start=torch.stack([layout.param_start] * 2, 1)[:, 0]),
                     dict(param_start=layout.param_start.numpy(), bucket_indices=layout.bucket_indices.numpy())):
        other = dataclasses.replace(layout, **replaced)
        got = buckets.shard_ranges(other, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert other.summary() == layout.summary()
    with pytest.raises(ValueError, match="layout param 0 is inconsistent"):
        buckets.materialize(dataclasses.replace(layout, numel=10))
    with pytest.raises(ValueError, match="layout param 1 is inconsistent"):
        dataclasses.replace(layout, bucket_id=torch.tensor([0, 5, 0])).summary()
    with pytest.raises(TypeError, match="layout.bucket_id"):
        buckets.shard_ranges(dataclasses.replace(layout, bucket_id=layout.bucket_id.float()), 2)
    with pytest.raises(ValueError, match="device"):
        buckets.materialize(layout, device="nope")
    with pytest.raises(TypeError, match="device"):
        buckets.materialize(layout, device=1.5)
    listed = dataclasses.replace(layout, param_start=layout.param_start.tolist(), bucket_indices=layout.bucket_indices.tolist())
    assert listed.summary() == layout.summary() and listed.num_params == 3 and listed.num_buckets == 2
    for bad, error in ((-1, ValueError), ("x", TypeError), (None, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="max_buckets"):
            layout.summary(max_buckets=bad)
    assert layout.summary(max_buckets=0).splitlines()[-1] == "  ... 2 more buckets"
    for bad, error in ((0, ValueError), (None, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="layout.data_parallel_world_size"):
            dataclasses.replace(layout, data_parallel_world_size=bad).summary()


def test_shard_ranges_bad_input():
    layout = buckets.plan_layout([100, 200], data_parallel_world_size=4)
    with pytest.raises(ValueError, match="rank"):
        buckets.shard_ranges(layout, 4, rank=4)
    with pytest.raises(ValueError, match="rank"):
        buckets.shard_ranges(layout, 4, rank=-1)
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        buckets.shard_ranges(layout, 0)
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        buckets.shard_ranges(layout, 5)  # the 384-element bucket does not divide by 5
    with pytest.raises(TypeError, match="layout"):
        buckets.shard_ranges({"param_start": [0]}, 2)
    unpadded = buckets.plan_layout([100, 27], use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        buckets.shard_ranges(unpadded, 2)
    # No buckets, so any dp divides them: every rank's rows would need one offset per rank (that
    # count plus one overflowed int64: UBSan stopped here); one rank's rows need none.
    empty = buckets.plan_layout([])
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        buckets.shard_ranges(empty, 2**63 - 1)
    assert buckets.shard_ranges(empty, 2**63 - 1, rank=2**63 - 2).rank.numel() == 0


def test_partition_bad_input():
    with pytest.raises(ValueError, match="is_uint8"):
        buckets.partition_bucket_indices([True, True], [1, 1])
    with pytest.raises(ValueError, match="num_buckets"):
        buckets.partition_bucket_indices([True], [1, 1])
    with pytest.raises(ValueError, match="num_buckets"):
        buckets.partition_bucket_indices([False], [-1])


def test_dropin_bad_input():
    config = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=False, grad_reduce_in_fp32=False)
    with pytest.raises(ValueError, match="data_parallel_world_size"):
        buckets.compute_per_buffer_param_layout([torch.nn.Parameter(torch.zeros(3))], None, 0, config)
    with pytest.raises(TypeError, match="params"):
        buckets.compute_default_per_buffer_param_layout([object()], None)
    with pytest.raises(AssertionError):
        buckets.group_params_for_buffers([torch.zeros(3)], False)
    expert = torch.nn.Parameter(torch.zeros(3))
    expert.allreduce = False
    with pytest.raises(ValueError, match="expert_data_parallel_world_size"):
        buckets.compute_full_param_layout([torch.nn.Parameter(torch.zeros(3)), expert], None, 2, config, 0)
    with pytest.raises(ValueError, match="shapes"):
        buckets.materialize(buckets.plan_layout([4]), [(3,)])
    assert isinstance(UpstreamAssertionError("x"), ValueError)
    world = buckets._range_type()(0, 128)
    with pytest.raises(ValueError, match="param_world_index_map"):
        buckets.build_model_gbuf_param_range_map({"p": (0, 5)}, world, 0)
    with pytest.raises(TypeError, match="param_world_index_map"):
        buckets.build_model_gbuf_param_range_map({"p": ("a", 5, 0)}, world, 0)
    with pytest.raises(TypeError, match="param_world_index_map"):
        buckets.build_model_gbuf_param_range_map([("p", (0, 5, 0))], world, 0)
    assert list(buckets.build_model_gbuf_param_range_map({"p": [0, 200, 0]}, world, 0)) == ["p"]


def test_range_map_of_a_dict_subclass_follows_its_items_order():
    import collections

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    a, b, c = (torch.nn.Parameter(torch.empty(10)) for _ in range(3))
    index_map = collections.OrderedDict([(a, (0, 10, 0)), (b, (10, 20, 0)), (c, (20, 30, 0))])
    index_map.move_to_end(a)  # .items() order b, c, a; the dict underneath still stores a first
    want = DistributedOptimizer._build_model_gbuf_param_range_map(index_map, Range(0, 30), 0)
    got = buckets.build_model_gbuf_param_range_map(index_map, Range(0, 30), 0)
    assert [id(p) for p in got] == [id(p) for p in want] == [id(b), id(c), id(a)]
    assert range_maps_as_tuples({"param_map": got}) == range_maps_as_tuples({"param_map": want})


def test_range_map_of_a_read_only_mapping_equals_upstream():
    import types

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    a, b = (torch.nn.Parameter(torch.empty(10)) for _ in range(2))
    index_map = types.MappingProxyType({a: (0, 10, 0), b: (10, 20, 0)})
    want = DistributedOptimizer._build_model_gbuf_param_range_map(index_map, Range(5, 20), 0)
    got = buckets.build_model_gbuf_param_range_map(index_map, Range(5, 20), 0)
    assert range_maps_as_tuples({"param_map": got}) == range_maps_as_tuples({"param_map": want})


def test_empty_model():
    layout = buckets.plan_layout(np.zeros(0, dtype=np.int64), data_parallel_world_size=8)
    assert layout.numel == 0 and layout.num_buckets == 0
    assert len(buckets.shard_ranges(layout, 8).rank) == 0


# --- CLI ----------------------------------------------------------------------------------------------


def test_cli_json_spec(tmp_path, capsys):
    import json

    from trainfast.cli import main

    spec = {"params": [{"name": "emb", "shape": [1000, 8], "shared_embedding": True},
                       {"name": "w", "numel": 5000}, {"name": "e0", "shape": [64, 64], "expert": True},
                       {"name": "head", "shape": [1000, 8], "shared_embedding": True}]}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(spec))
    assert main(["buckets", "--model", str(path), "--dp", "4", "--bucket-size", "6000"]) == 0
    out = capsys.readouterr().out
    assert "[dense buffer]" in out and "[expert buffer]" in out and "3 params in 3 buckets" in out
    assert main(["buckets", "--model", "gpt", "--layers", "2", "--dp", "8", "--bucket-size", "none"]) == 0
    assert "23 params in 3 buckets" in capsys.readouterr().out  # tied embedding + output sit alone


def test_cli_bad_input(tmp_path, capsys, caplog):
    from trainfast.cli import main

    assert main(["buckets", "--model", "gpt", "--dp", "0"]) == 2
    assert main(["buckets", "--model", "gpt", "--bucket-size", "-4"]) == 2
    capsys.readouterr()
    # Past int64 no bucket ever closes: the plan is bucket_size=None's (as upstream's), no error.
    assert main(["buckets", "--model", "gpt", "--layers", "2", "--dp", "8", "--bucket-size", "1e19"]) == 0
    out = capsys.readouterr().out
    assert "23 params in 3 buckets" in out and "bucket_size=10000000000000000000" not in out
    assert main(["buckets", "--model", "gpt", "--layers", "2", "--param-bytes", "-1"]) == 2
    assert capsys.readouterr().out == ""  # checked before the header is printed
    bad = tmp_path / "bad.json"
    bad.write_text('[{"name": "x"}]')
    assert main(["buckets", "--model", str(bad)]) == 2
    bad.write_text('[{"shape": 5}]')
    with caplog.at_level("ERROR", logger="trainfast"):
        assert main(["buckets", "--model", str(bad)]) == 2
    assert "params[0].shape must be a list of ints (got 5)" in caplog.text


def test_builtin_specs():
    from trainfast.cli.buckets import deepseek_v3_spec, gpt_spec

    spec = deepseek_v3_spec()
    assert 44_000 < len(spec.numels) < 46_000 and sum(spec.expert) == 58 * 256 * 3
    assert spec.shared_embedding[0] and spec.shared_embedding[-1] and sum(spec.shared_embedding) == 2
    assert len(gpt_spec(2).numels) == 23


def test_patch_swaps_newer_layout_entry_points(monkeypatch):
    """megatron-core 0.16 has no separate layout functions; newer releases do. Install stand-ins
    written from upstream's semantics where newer releases define them, and check patch() swaps them
    (module functions and DistributedOptimizer staticmethods) with identical results."""
    from megatron.core.optimizer import distrib_optimizer

    from trainfast.integrations import megatron

    def upstream_default(params, bucket_size):
        starts, ends, ids, bucket_indices, unpadded = ref.layout([p.numel() for p in params], None, bucket_size,
                                                                 1, distopt=False)
        index_map = {params[i]: (starts[i], ends[i], ids[i]) for i in reversed(range(len(params)))}
        return buckets.PerBufferParamLayout(index_map, bucket_indices, unpadded)

    def upstream_per_buffer(params, bucket_size, data_parallel_world_size, ddp_config, param_indices=None):
        starts, ends, ids, bucket_indices, unpadded = ref.layout(
            [p.numel() for p in params], [getattr(p, "shared_embedding", False) for p in params], bucket_size,
            data_parallel_world_size, busbw=ddp_config.pad_buckets_for_high_nccl_busbw)
        index_map = {params[i]: (starts[i], ends[i], ids[i]) for i in reversed(range(len(params)))}
        return buckets.PerBufferParamLayout(index_map, bucket_indices, unpadded, list(param_indices or []))

    monkeypatch.setattr(megatron_pgb, "_compute_default_per_buffer_param_layout", upstream_default, raising=False)
    monkeypatch.setattr(distrib_optimizer.DistributedOptimizer, "_compute_per_buffer_param_layout",
                        staticmethod(upstream_per_buffer), raising=False)
    rng = random.Random(11)
    params = make_params(rng, 40, shared_ends=True)
    config = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=True, grad_reduce_in_fp32=True)
    D = distrib_optimizer.DistributedOptimizer
    expected = (megatron_pgb._compute_default_per_buffer_param_layout(params, 5000),
                D._compute_per_buffer_param_layout(params, 5000, 64, config, list(range(40))))
    patched = megatron.patch()
    try:
        assert f"{megatron_pgb.__name__}._compute_default_per_buffer_param_layout" in patched
        assert f"{distrib_optimizer.__name__}.DistributedOptimizer._compute_per_buffer_param_layout" in patched
        assert isinstance(D.__dict__["_compute_per_buffer_param_layout"], staticmethod)
        got = (megatron_pgb._compute_default_per_buffer_param_layout(params, 5000),
               D._compute_per_buffer_param_layout(params, 5000, 64, config, list(range(40))))
    finally:
        megatron.unpatch()
    for want, have in zip(expected, got):
        assert list(have.param_index_map.items()) == list(want.param_index_map.items())
        assert have.bucket_indices == want.bucket_indices
        assert have.per_bucket_numel_unpadded == want.per_bucket_numel_unpadded
        assert have.param_indices == want.param_indices
    assert D.__dict__["_compute_per_buffer_param_layout"].__func__ is upstream_per_buffer


def test_many_python_threads_get_the_same_ranges():
    import threading

    rng = random.Random(21)
    numels = [rng.randint(1, 10**6) for _ in range(3000)]
    layout = buckets.plan_layout(numels, bucket_size=2 * 10**6, data_parallel_world_size=64)
    want = rows(buckets.shard_ranges(layout, 64, num_threads=1))
    results = [None] * 8

    def work(i):
        results[i] = rows(buckets.shard_ranges(layout, 64, num_threads=1 + i % 3))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == want for r in results)


# --- the newest megatron-core, in a subprocess ------------------------------------------------------------


def megatron_newest_dir():
    """Where `make megatron-newest` put the newest megatron-core ($TRAINFAST_MEGATRON_NEWEST, which
    may list several directories like PYTHONPATH; default .venv/megatron-newest)."""
    import os
    from pathlib import Path

    default = Path(__file__).resolve().parents[1] / ".venv" / "megatron-newest"
    return os.environ.get("TRAINFAST_MEGATRON_NEWEST") or str(default)


@pytest.mark.slow
def test_against_the_newest_megatron_core():
    """tests/megatron_newest_buckets.py against the real newest megatron-core (its layout functions,
    range builders, partition_buckets and the patch), run in a child with that release first on
    PYTHONPATH. CI installs it (`make test` does): missing there is a failure, not a skip."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    side = megatron_newest_dir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [side, str(root), env.get("PYTHONPATH", "")]))
    probe = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import megatron.core.optimizer.param_layout"],
        env=env, capture_output=True, text=True, cwd=root,
    )
    if probe.returncode != 0:
        reason = (f"the newest megatron-core is not importable from {side} (run `make megatron-newest`): "
                  f"{probe.stderr.strip().splitlines()[-1:] or probe.stdout}")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/megatron_newest_buckets.py", "-q", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, cwd=root,
    )
    assert result.returncode == 0, f"{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


def test_materialize_is_device_generic():
    """materialize allocates on the device it is given (CUDA in training; meta here, as no GPU is on
    CI): buffers and views land there, laid out as on CPU."""
    params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(7))]
    layout = buckets.plan_layout([15, 7], data_parallel_world_size=2)
    cpu = buckets.materialize(layout, params, param_dtype=torch.bfloat16)
    meta = buckets.materialize(layout, params, param_dtype=torch.bfloat16, device=torch.device("meta"))
    assert meta.grad_data.device.type == "meta" and meta.param_data.device.type == "meta"
    assert meta.grad_data.shape == cpu.grad_data.shape and meta.param_data.dtype == torch.bfloat16
    for a, b in zip(meta.grad_views + meta.param_views, cpu.grad_views + cpu.param_views):
        assert a.device.type == "meta" and a.shape == b.shape and a.storage_offset() == b.storage_offset()


def test_materialize_refuses_a_cuda_device_torch_does_not_have(monkeypatch):
    layout = buckets.plan_layout([15, 7], data_parallel_world_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda' is not available here \(torch sees 0 CUDA devices\)"):
        buckets.materialize(layout, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="device 'cuda:2' is not available here"):
        buckets.materialize(layout, device="cuda:2")


def test_quantized_storage_test_skipped_only_when_provably_false(monkeypatch):
    """Without Transformer Engine megatron's quantized-storage test is False for every param and the
    drop-ins skip it; a stand-in (monkeypatched, as with TE's classes present) is called per param."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    assert buckets._quantized_storage_check(buckets._quantized_predicates()) is None
    monkeypatch.setattr(pgb, "is_float8tensor", lambda t: getattr(t, "_fp8", False))
    check = buckets._quantized_storage_check(buckets._quantized_predicates())
    assert check is not None
    param = torch.nn.Parameter(torch.zeros(3))
    param._fp8 = True
    assert check(param) and list(buckets.group_params_for_buffers([param], False))[0].param_dtype == torch.uint8


def test_full_layout_sizes_params_as_upstream_does():
    """Upstream sizes a param by ``param.data.nelement()``: an attribute shadowing ``nelement`` on the
    param itself changes nothing, for plain Parameters and subclasses alike."""

    class Tagged(torch.nn.Parameter):
        pass

    params = [torch.nn.Parameter(torch.zeros(100)), Tagged(torch.zeros(30)), torch.nn.Parameter(torch.zeros(7))]
    for p in params:
        p.nelement = lambda: 1
    config = types.SimpleNamespace(grad_reduce_in_fp32=False, pad_buckets_for_high_nccl_busbw=False)
    full = buckets.compute_full_param_layout(params, None, 2, config)
    (layout,) = full.layouts.values()
    assert [layout.param_index_map[p] for p in params] == [(128, 228, 0), (64, 94, 0), (0, 7, 0)]
    per_buffer = buckets.compute_per_buffer_param_layout(params, None, 2, config)
    assert list(per_buffer.param_index_map.items()) == list(layout.param_index_map.items())
    default = buckets.compute_default_per_buffer_param_layout(params, None)
    assert [default.param_index_map[p] for p in params] == [(37, 137, 0), (7, 37, 0), (0, 7, 0)]


@pytest.mark.parametrize("seed", range(3))
def test_padding_past_2_pow_53_rounds_like_python(seed):
    # Upstream's _pad divides in floats: past 2^53 the padded end is not the exact integer ceiling.
    # Where it rounds below the unpadded end, upstream's next bucket would overlap this one: refused.
    rng = random.Random(seed)
    num_refused = 0
    for _ in range(300):
        numel = rng.randrange(2**53, 2**61) if rng.random() < 0.8 else 2**53 + rng.randrange(1, 4096)
        dp = rng.choice([1, 3, 7, 64, 1000, 2**40 + 1])
        expected = ref.pad(numel, math.lcm(dp, 128))
        if expected < numel:
            num_refused += 1
            with pytest.raises(ValueError, match="rounds below itself"):
                buckets.plan_layout([numel], data_parallel_world_size=dp)
            continue
        layout = buckets.plan_layout([numel], data_parallel_world_size=dp)
        assert int(layout.bucket_indices[0][1]) == expected, (numel, dp)
    assert 0 < num_refused < 300


def test_padding_rounds_an_inexact_halfway_quotient_up():
    # Found by mutation testing: the quotient's dropped bits are exactly one half, yet the division
    # has a remainder, so Python's true division rounds up: 384/128 + 2^-44, whose ceiling is 4.
    numel, dp = 6173219130243087433, 16076091485008039
    divisor = math.lcm(dp, 128)
    assert ref.pad(numel, divisor) == 4 * divisor == 8230958840324115968
    layout = buckets.plan_layout([numel], data_parallel_world_size=dp)
    assert layout.bucket_indices.tolist() == [[0, 8230958840324115968]]


def test_python_code_that_changes_the_inputs_cannot_crash():
    # __hash__, __index__ or range_type may run Python code that empties the caller's containers.
    params = []

    class ClearingParam(torch.nn.Parameter):
        def __hash__(self):
            params.clear()
            return id(self)

    originals = [ClearingParam(torch.zeros(n)) for n in (3, 5, 7)]
    params.extend(originals)
    layout = buckets.compute_default_per_buffer_param_layout(params, None)
    assert set(map(id, layout.param_index_map)) == set(map(id, originals))  # upstream iterates a copy too

    index_map = {f"p{k}": (10 * k, 10 * k + 10, 0) for k in range(6)}

    def clearing_range(start, end):
        index_map.clear()
        return (start, end)

    with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
        _core.buckets_param_range_map(index_map, 0, 100, 0, clearing_range)
    world = buckets._range_type()(0, 128)
    with pytest.raises(ValueError, match=r"starts must be in \(-2\^62, 2\^62\)"):
        buckets.build_model_gbuf_param_range_map({"p": (-2**63, 5, 0)}, world, 0)


@pytest.mark.parametrize("start", [2**62, -(2**62), 2**70])
def test_out_of_range_offsets_in_a_real_buffer(start):
    """A buffer that can be weakly referenced (as Megatron's is) takes the cached-index path; an
    offset past +-2^62 there is handed to the plain path, which names it (no internal error)."""
    assert _core.buckets_index_snapshot({"p": (start, start + 4, 0)}) is None

    class Grad:
        def numel(self):
            return 8

    class Buffer:  # hashable and weakly referenceable, unlike SimpleNamespace
        pass

    buffer = Buffer()
    buffer.data_parallel_group = FakeGroup(1)
    buffer.buckets = [types.SimpleNamespace(grad_data=Grad(), offset=0)]
    buffer.param_index_map = {"p": (start, start + 4, 0)}
    with pytest.raises(ValueError, match="starts must be in"):
        buckets.build_model_gbuf_range(buffer, 0)


def test_indexed_range_map_rechecks_offsets_rewritten_by_range_type():
    """The snapshot's offset arrays belong to the caller, and range_type (Python code) runs between
    the up-front check and the reads: an offset rewritten meanwhile overflowed int64 (UBSan)."""
    index_map = {"a": (0, 10, 0), "b": (10, 20, 0)}
    keys, values, starts, ends, max_end, starts_sorted, version = _core.buckets_index_snapshot(index_map)

    class Range:
        def __init__(self, lo, hi):
            starts[1], ends[1] = -(2**63), 2**63 - 1
            self.lo, self.hi = lo, hi

    with pytest.raises(ValueError, match="offsets must be in"):
        _core.buckets_param_range_map_indexed(
            index_map, keys, values, starts, ends, max_end, starts_sorted, version, 5, 15, 0, Range)


def test_drop_ins_read_world_sizes_and_config_fields_as_upstream_does():
    """A world size no buffer uses is not read (upstream never reads it); a ddp_config without a
    field upstream reads is refused, not taken as False."""
    import types

    from megatron.core.distributed import DistributedDataParallelConfig

    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    experts = [torch.nn.Parameter(torch.zeros(100)) for _ in range(3)]
    for param in experts:
        param.allreduce = False  # expert-parallel: only the expert world size is used
    layout = buckets.compute_full_param_layout(experts, 1000, None, config, 4)
    assert [buffer.bucket_indices for buffer in layout.layouts.values()] == [[(0, 384)]]
    with pytest.raises(TypeError, match="data_parallel_world_size"):  # the expert default is the dense size
        buckets.compute_full_param_layout(experts, 1000, None, config)
    dense = [torch.nn.Parameter(torch.zeros(100)) for _ in range(3)]
    for call, field in ((lambda: buckets.compute_per_buffer_param_layout(dense, 250, 2, types.SimpleNamespace()),
                         "pad_buckets_for_high_nccl_busbw"),
                        (lambda: buckets.compute_full_param_layout(dense, 250, 2, types.SimpleNamespace()),
                         "grad_reduce_in_fp32")):
        with pytest.raises(TypeError, match=f"ddp_config must be a DistributedDataParallelConfig with {field}"):
            call()


def test_arrays_at_an_odd_byte_offset_are_copied_or_refused():
    """NumPy keeps a view at any byte offset C-contiguous; reading it as int64 would be UB."""
    buffer = bytearray(8 * 3 + 1)
    misaligned = np.frombuffer(buffer, dtype=np.int64, count=3, offset=1)
    misaligned[:] = [2, 1, 3]
    assert misaligned.ctypes.data % 8 != 0
    aligned = np.array([2, 1, 3], dtype=np.int64)
    flags = np.zeros(3, dtype=np.uint8)
    # The public API copies such an array (aligned); the same groups come back.
    assert buckets.partition_bucket_indices(flags, misaligned).groups() == \
        buckets.partition_bucket_indices(flags, aligned).groups()
    # The native core refuses it.
    with pytest.raises(ValueError, match="num_buckets must be an aligned array"):
        _core.buckets_partition(flags, misaligned, False, False)
    # EPLB's public API copies it too.
    from trainfast import eplb

    weight = np.frombuffer(bytearray(8 * 12 + 1), dtype=np.int64, count=12, offset=1).reshape(1, 12)
    weight[:] = np.arange(1, 13)
    got, expected = eplb.rebalance_experts(weight, 16, 4, 2, 8), eplb.rebalance_experts(weight.copy(), 16, 4, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
