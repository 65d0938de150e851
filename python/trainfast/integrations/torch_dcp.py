"""Patch ``torch.distributed.checkpoint.filesystem`` with trainfast's binning (global sizing)."""

from __future__ import annotations

from trainfast.integrations._patching import Patcher, split_by_size_and_type_with

__all__ = ["patch", "unpatch", "is_patched", "patcher"]

patcher = Patcher("torch.distributed.checkpoint")

patcher.add("torch.distributed.checkpoint.filesystem", "_split_by_size_and_type", split_by_size_and_type_with("global"))

# Replace / restore / query; patch() returns the "module.attribute" names it replaced.
patch = patcher.patch
unpatch = patcher.unpatch
is_patched = patcher.is_patched
