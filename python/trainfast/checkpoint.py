"""Checkpoint write-item binning: a drop-in for ``_split_by_size_and_type``.

Megatron (``megatron.core.dist_checkpointing.strategies.filesystem_async``) and torch DCP
(``torch.distributed.checkpoint.filesystem``) split a rank's write plan into ``bins`` lists, one per
writer thread: BYTE_IO items round-robin, tensor items largest-first onto the least-loaded bin (ties
to the lowest bin). They differ only in how a tensor item is sized: Megatron counts the chunk this
rank writes (``sizing="chunk"``), torch counts the whole global tensor (``sizing="global"``).

>>> from trainfast.checkpoint import assign_bins
>>> plan = assign_bins([False, False, False], [10, 30, 20], bins=2)
>>> plan.bin_idx.tolist(), plan.bin_bytes.tolist()
([1, 0, 1], [30, 30])
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

from trainfast import _core
from trainfast._util import INT64_MAX, as_array, check_bool, check_choice, check_int, resolve_num_threads, to_tensor

__all__ = [
    "BinAssignment",
    "assign_bins",
    "balance_ratio",
    "split_by_size_and_type",
    "write_item_sizes",
]

Sizing = Literal["chunk", "global"]
Balance = Literal["upstream", "refined"]
_SIZINGS = ("chunk", "global")
_BALANCES = ("upstream", "refined")


class BinAssignment(NamedTuple):
    """Result of :func:`assign_bins`; all int64 CPU tensors.

    - ``bin_idx`` `[num_items]`: bin of each item.
    - ``order`` `[num_items]`: item indices grouped by bin, each bin as upstream lists it (byte items
      in input order, then tensors largest first).
    - ``bin_offsets`` `[bins + 1]`: bin ``b`` is ``order[bin_offsets[b]:bin_offsets[b + 1]]``.
    - ``bin_bytes`` `[bins]`: bytes counted per bin (tensor bytes; byte items too when refined).
    """

    bin_idx: Any
    order: Any
    bin_offsets: Any
    bin_bytes: Any


@functools.lru_cache(maxsize=1)
def _element_sizes() -> dict[Any, int]:
    import torch

    sizes = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and value not in sizes:
            try:
                sizes[value] = torch._utils._element_size(value)
            except (RuntimeError, TypeError, ValueError):
                continue  # sub-byte and other dtypes without a whole element size
    return sizes


def _byte_io_type() -> Any:
    from torch.distributed.checkpoint.planner import WriteItemType

    return WriteItemType.BYTE_IO


def _check_items(items: Any) -> list:
    if isinstance(items, list):
        return items
    # Megatron iterates once, so a tuple, dict values or a generator work there too (torch iterates
    # twice: a one-shot iterator would lose its tensor items there); taken here as a list.
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"items must be a list of WriteItem (got {type(items).__name__})")
    return list(items)


def split_by_size_and_type(
    bins: int,
    items: list,
    *,
    sizing: Sizing = "chunk",
    balance: Balance = "upstream",
    num_threads: int | None = None,
) -> list[list]:
    """Splits WriteItems into ``bins`` lists, exactly as upstream's ``_split_by_size_and_type``.

    Args:
        bins: number of bins (writer threads), > 0 (or any number for an empty ``items``, which
            gives ``[]`` below 1, as upstream).
        items: ``torch.distributed.checkpoint.planner.WriteItem`` objects (or any objects with
            ``type``, ``tensor_data.chunk.sizes`` / ``tensor_data.size`` and
            ``tensor_data.properties.dtype``), a list or any iterable (read once).
        sizing: ``"chunk"`` (Megatron's ``_item_size``) or ``"global"`` (torch DCP's).
        balance: ``"upstream"`` (identical result) or ``"refined"`` (byte sizes counted when known,
            then greedy moves/swaps out of the heaviest bin; never a heavier maximum bin).
        num_threads: threads reading the items (default: $TRAINFAST_NUM_THREADS or the available
            cores); the result does not depend on it.

    Returns:
        ``bins`` lists of the same item objects; with ``bins == 1``, ``[items]`` as upstream.

    Raises:
        TypeError for an item that is malformed or whose dtype has no whole-byte size (upstream
        raises TypeError for sub-byte dtypes too); UpstreamAssertionError (a ValueError and an
        AssertionError) for a tensor item whose ``tensor_data`` is None; ValueError naming
        ``items`` for an item over 2^63-1 bytes or sizes that sum past it (bin loads are int64;
        upstream's Python ints would go on).
    """
    bins = check_int(bins, "bins", max_value=INT64_MAX)
    check_choice(sizing, "sizing", _SIZINGS)
    check_choice(balance, "balance", _BALANCES)
    threads = resolve_num_threads(num_threads)
    if bins == 1:  # upstream returns before it looks at any item
        return [items]
    item_list = _check_items(items)
    if bins < 1 and not item_list:
        return []  # upstream: no bins and nothing to put in them (a rank with an empty plan)
    if bins < 1:
        raise ValueError(f"bins must be >= 1 (got {bins})")
    return _core.checkpoint_split_write_items(
        item_list, bins, _byte_io_type(), _element_sizes(), sizing == "global", balance == "refined", threads
    )


def write_item_sizes(
    items: list, *, sizing: Sizing = "chunk", count_bytes: bool = False, num_threads: int | None = None
) -> tuple[Any, Any]:
    """Returns ``(is_bytes, sizes)`` of WriteItems: bool `[num_items]` and int64 `[num_items]` CPU tensors.

    Tensor sizes are ``prod(shape) * element_size`` as upstream's ``_item_size``; a BYTE_IO item's
    size is ``bytes_io_data.nbytes`` when ``count_bytes`` and known, else 0. ``num_threads`` as
    in :func:`split_by_size_and_type`.
    """
    import torch

    check_choice(sizing, "sizing", _SIZINGS)
    count_bytes = check_bool(count_bytes, "count_bytes")
    threads = resolve_num_threads(num_threads)
    is_bytes, sizes = _core.checkpoint_write_item_sizes(
        _check_items(items), _byte_io_type(), _element_sizes(), sizing == "global", count_bytes, threads
    )
    return to_tensor(is_bytes).view(torch.bool), to_tensor(sizes)


def assign_bins(is_bytes: Any, sizes: Any, bins: int, *, balance: Balance = "upstream") -> BinAssignment:
    """Array form of :func:`split_by_size_and_type` for plans of millions of items.

    Args:
        is_bytes: bool/int `[num_items]` (tensor, array or sequence); true marks a BYTE_IO item.
        sizes: int `[num_items]`, bytes per item, >= 0 (byte items' sizes count only when refined).
        bins: number of bins, > 0.
        balance: ``"upstream"`` or ``"refined"``.

    Returns:
        A :class:`BinAssignment` of int64 CPU tensors sharing memory with the native result.

    >>> assign_bins([False, False, True, False], [400, 300, 0, 200], 2)
    BinAssignment(bin_idx=tensor([0, 1, 0, 1]), order=tensor([2, 0, 1, 3]), bin_offsets=tensor([0, 2, 4]), bin_bytes=tensor([400, 500]))
    """
    bins = check_int(bins, "bins", min_value=1, max_value=INT64_MAX)
    check_choice(balance, "balance", _BALANCES)
    is_bytes_arr = as_array(is_bytes, "is_bytes", "uint8", kind="bool")
    sizes_arr = as_array(sizes, "sizes", "int64", kind="int")
    if is_bytes_arr.shape != sizes_arr.shape:
        raise ValueError(
            f"is_bytes and sizes must have the same length (got {is_bytes_arr.shape[0]} and "
            f"{sizes_arr.shape[0]})"
        )
    arrays = _core.checkpoint_assign_bins(is_bytes_arr, sizes_arr, bins, balance == "refined")
    return BinAssignment(*(to_tensor(a) for a in arrays))


def balance_ratio(bin_bytes: Any) -> float:
    """max-bin / mean-bin bytes (1.0 is perfect balance; 0 bytes counts as balanced).

    Args:
        bin_bytes: int `[bins]` (tensor, array or sequence), bytes per bin, >= 0; e.g.
            ``assign_bins(...).bin_bytes``.

    >>> balance_ratio([700, 200])
    1.5555555555555556
    """
    loads = as_array(bin_bytes, "bin_bytes", "int64", kind="int").tolist()
    if not loads:
        raise ValueError("bin_bytes must not be empty")
    if min(loads) < 0:
        raise ValueError(f"bin_bytes must be non-negative (got {min(loads)})")
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
