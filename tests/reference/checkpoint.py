"""Oracle for checkpoint write-item binning, written from the upstream semantics.

- bins == 1: one bin holding the items in input order.
- BYTE_IO items are dealt round-robin (i % bins) in input order; their sizes do not count.
- Tensor items are stably sorted by size, largest first; each goes to the bin with the smallest
  accumulated tensor bytes, ties to the lowest bin index.
- Each bin lists its byte items first, then its tensors in assignment order.
"""

from __future__ import annotations

import math


def assign_bins(is_bytes: list[bool], sizes: list[int], bins: int) -> list[list[int]]:
    """Item indices per bin."""
    if bins == 1:
        return [list(range(len(sizes)))]
    byte_items = [i for i, b in enumerate(is_bytes) if b]
    tensor_items = [i for i, b in enumerate(is_bytes) if not b]
    out: list[list[int]] = [[] for _ in range(bins)]
    for k, i in enumerate(byte_items):
        out[k % bins].append(i)
    loads = [0] * bins
    for i in sorted(tensor_items, key=lambda i: sizes[i], reverse=True):  # sorted() is stable
        lightest = min(range(bins), key=lambda b: (loads[b], b))
        out[lightest].append(i)
        loads[lightest] += sizes[i]
    return out


def item_size(item, sizing: str, element_size) -> int:
    """Megatron's ``_item_size`` (sizing="chunk") or torch DCP's (sizing="global")."""
    shape = item.tensor_data.chunk.sizes if sizing == "chunk" else item.tensor_data.size
    return math.prod(shape) * element_size(item.tensor_data.properties.dtype)


def split_by_size_and_type(bins: int, items: list, sizing: str = "chunk") -> list[list]:
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType

    is_bytes = [item.type == WriteItemType.BYTE_IO for item in items]
    sizes = [0 if b else item_size(item, sizing, torch._utils._element_size) for b, item in zip(is_bytes, items)]
    return [[items[i] for i in group] for group in assign_bins(is_bytes, sizes, bins)]
