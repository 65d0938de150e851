"""Patch ``torch.distributed.checkpoint.filesystem`` with trainfast's binning (global sizing)."""

from __future__ import annotations

from trainfast.integrations._patching import Patcher

__all__ = ["patch", "unpatch", "is_patched", "patcher"]

patcher = Patcher("torch.distributed.checkpoint")


def _split_by_size_and_type(original):
    from trainfast.checkpoint import split_by_size_and_type

    def replacement(bins, items):
        return split_by_size_and_type(bins, items, sizing="global")

    return replacement


patcher.add("torch.distributed.checkpoint.filesystem", "_split_by_size_and_type", _split_by_size_and_type)


# Replace / restore / query; patch() returns the "module.attribute" names it replaced.
patch = patcher.patch
unpatch = patcher.unpatch
is_patched = patcher.is_patched
