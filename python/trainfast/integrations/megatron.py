"""Patch megatron-core (and nvidia-resiliency-ext's copy of its async writer) with trainfast.

>>> from trainfast.integrations import megatron
>>> megatron.patch()    # doctest: +SKIP
['megatron.core.dist_checkpointing.strategies.filesystem_async._split_by_size_and_type', ...]
"""

from __future__ import annotations

from trainfast.integrations._patching import Patcher

__all__ = ["patch", "unpatch", "is_patched", "patcher"]

patcher = Patcher("megatron-core")


def _split_by_size_and_type(original):
    from trainfast.checkpoint import split_by_size_and_type

    def replacement(bins, items):
        return split_by_size_and_type(bins, items, sizing="chunk")

    return replacement


patcher.add(
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "_split_by_size_and_type",
    _split_by_size_and_type,
)
patcher.add(
    "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
    "_split_by_size_and_type",
    _split_by_size_and_type,
    required=False,
)


# Replace / restore / query; patch() returns the "module.attribute" names it replaced.
patch = patcher.patch
unpatch = patcher.unpatch
is_patched = patcher.is_patched
