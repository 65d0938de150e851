"""Pre-token counting and BPE training over ``torch.distributed`` ranks (any backend with send/recv
of CPU tensors, e.g. gloo).

Each rank counts its share of the files (largest first, to the least loaded rank), rank ``dst`` of
the group receives every other rank's serialized :class:`~trainfast.bpe.counts.WordCounts` in
messages of at most ``max_message_bytes`` and adds them up. ``train_bpe`` then trains on rank
``dst`` and broadcasts ``(vocab, merges)``; the result equals a single-process ``train_bpe`` on all
files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainfast._util import check_int
from trainfast.bpe.counts import PathLike, WordCounts, count_words as _count_words_local
from trainfast.bpe.counts import train_from_counts

__all__ = ["count_words", "shard_files", "train_bpe"]

_log = logging.getLogger("trainfast.bpe")

_DEFAULT_MESSAGE_BYTES = 64 << 20


def shard_files(paths: Sequence[PathLike], world_size: int) -> list[list[str]]:
    """Files per rank: largest first to the rank with the fewest bytes so far (ties: lowest rank)."""
    world_size = check_int(world_size, "world_size", min_value=1)
    sizes = [(os.path.getsize(p), idx, p) for idx, p in enumerate(_check_paths(paths))]
    shards: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for size, _, path in sorted(sizes, key=lambda item: (-item[0], item[1])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(path)
        loads[rank] += size
    return shards


def _check_paths(paths: Any) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not isinstance(paths, (list, tuple)):
        raise TypeError(f"paths must be a list of file paths (got {type(paths).__name__})")
    out = []
    for idx, path in enumerate(paths):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"paths[{idx}] must be a path (got {type(path).__name__})")
        out.append(os.fspath(path))
    return out


def _check_files_exist(paths: list[str]) -> None:
    for idx, path in enumerate(paths):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"paths[{idx}] = {path!r} is not a file")


def count_words(
    paths: PathLike | Sequence[PathLike],
    special_tokens: Sequence[str] | None = (),
    pattern: str = "gpt2",
    *,
    group: Any = None,
    dst: int = 0,
    num_threads: int | None = None,
    errors: str = "strict",
    max_message_bytes: int = _DEFAULT_MESSAGE_BYTES,
    show_progress: bool = False,
) -> WordCounts | None:
    """Counts of all ``paths`` (every rank must pass the same list) on group rank ``dst``; ``None``
    on the other ranks. Equal to ``trainfast.bpe.counts.count_words(paths, ...)`` in one process."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
    paths = _check_paths(paths)
    max_message_bytes = check_int(max_message_bytes, "max_message_bytes", min_value=1)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    dst = check_int(dst, "dst", min_value=0)
    if dst >= world_size:
        raise ValueError(f"dst must be a rank of the group, in [0, {world_size}) (got {dst})")
    local, error = None, None
    try:
        # Inside the try: a file missing on one node only must reach dst, not leave it waiting.
        _check_files_exist(paths)
        my_paths = shard_files(paths, world_size)[rank]
        local = _count_words_local([Path(p) for p in my_paths], special_tokens, pattern, num_threads, errors=errors,
                                   show_progress=show_progress) if my_paths else \
            WordCounts(pattern=pattern, special_tokens=special_tokens)
        if show_progress:  # show_progress=False silences the summary lines too, as in train_bpe
            _log.info("bpe: rank %d counted %d files: %s words", rank, len(my_paths), f"{len(local):,}")
    except Exception as caught:  # still report to dst, so no rank waits forever
        error = caught

    def global_rank(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    if rank != dst:
        if error is None and local is not None:
            payload = local.to_bytes()
            size = len(payload)
        else:  # a negative size announces an error message instead of counts
            payload = f"{type(error).__name__}: {error}".encode("utf-8")
            size = -len(payload) - 1
        dist.send(torch.tensor([size], dtype=torch.int64), dst=global_rank(dst), group=group)
        # (torch.frombuffer refuses an empty buffer)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        for start in range(0, len(payload), max_message_bytes):
            dist.send(data[start:start + max_message_bytes].clone(), dst=global_rank(dst), group=group)
        if error is not None:
            raise error
        return None
    total = local
    failures = []
    for src in range(world_size):
        if src == dst:
            continue
        size_tensor = torch.zeros(1, dtype=torch.int64)
        dist.recv(size_tensor, src=global_rank(src), group=group)
        size = int(size_tensor.item())
        buffer = bytearray(size if size >= 0 else -size - 1)
        view = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
        for start in range(0, len(buffer), max_message_bytes):
            chunk = torch.empty(min(max_message_bytes, len(buffer) - start), dtype=torch.uint8)
            dist.recv(chunk, src=global_rank(src), group=group)
            view[start:start + len(chunk)] = chunk
        if size < 0:
            failures.append(f"rank {src}: {buffer.decode('utf-8', 'replace')}")
        elif total is not None:
            try:
                total += WordCounts.from_bytes(buffer, source=f"counts from rank {src}")
            except Exception as caught:  # keep receiving: later ranks are blocked sending to us
                failures.append(f"rank {src}: {type(caught).__name__}: {caught}")
    if error is not None:
        raise error
    if failures:
        raise RuntimeError("counting failed on " + "; ".join(failures))
    return total


def train_bpe(
    paths: PathLike | Sequence[PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] | None = (),
    *,
    pattern: str = "gpt2",
    group: Any = None,
    src: int = 0,
    num_threads: int | None = None,
    errors: str = "strict",
    max_message_bytes: int = _DEFAULT_MESSAGE_BYTES,
    show_progress: bool = False,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``trainfast.bpe.train_bpe(paths, vocab_size, special_tokens)`` over the group: counts are
    gathered to rank ``src``, which trains and broadcasts ``(vocab, merges)`` to every rank."""
    import torch.distributed as dist

    from trainfast.bpe.pretokenize import _check_special_tokens
    from trainfast.bpe.train import _check_vocab_size

    # Fail on every rank before counting.
    special_tokens = _check_special_tokens(special_tokens, unique=True)
    _check_vocab_size(vocab_size, special_tokens)
    local_error = None
    try:
        counts = count_words(paths, special_tokens, pattern, group=group, dst=src, num_threads=num_threads,
                             errors=errors, max_message_bytes=max_message_bytes, show_progress=show_progress)
    except Exception as caught:  # keep the broadcast below in step on every rank
        counts, local_error = None, caught
    result: list[Any] = [None]
    interrupted = None
    if dist.get_rank(group) == src:
        if local_error is not None:
            result[0] = ("error", f"{type(local_error).__name__}: {local_error}")
        else:
            try:
                assert counts is not None  # count_words returns the total on dst
                result[0] = ("ok", train_from_counts(counts, vocab_size, special_tokens,
                                                     show_progress=show_progress))
            except BaseException as caught:  # every other rank is waiting in the broadcast below
                result[0] = ("error", f"{type(caught).__name__}: {caught}")
                if not isinstance(caught, Exception):  # Ctrl-C: re-raised as itself after the broadcast
                    interrupted = caught
    src_global = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(result, src=src_global, group=group)
    if local_error is not None:
        raise local_error
    if interrupted is not None:
        raise interrupted
    status, value = result[0]
    if status == "error":
        raise RuntimeError(f"BPE training failed on rank {src}: {value}")
    return value
