"""Byte-level BPE: native pre-tokenization, training (CS336 ``train_bpe`` semantics), encoding,
pre-token counts that add up across shards, and exports to HF tokenizers / tiktoken."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager: the function `pretokenize` must shadow the submodule of the same name (and it is light).
from trainfast.bpe.pretokenize import PATTERNS, count_pretokens, pretokenize

if TYPE_CHECKING:
    from trainfast.bpe.counts import WordCounts, count_words, train_from_counts
    from trainfast.bpe.io import load, save
    from trainfast.bpe.tokenizer import Tokenizer
    from trainfast.bpe.train import train_bpe

__all__ = ["PATTERNS", "Tokenizer", "WordCounts", "count_pretokens", "count_words", "load", "pretokenize", "save",
           "train_bpe", "train_from_counts"]

# Imported on first use, so that `from trainfast.bpe import train_bpe` loads neither NumPy nor the
# tokenizer (a smaller process: peak RSS is part of the training benchmark).
_SUBMODULE = {"WordCounts": "counts", "count_words": "counts", "train_from_counts": "counts", "load": "io",
              "save": "io", "Tokenizer": "tokenizer", "train_bpe": "train"}


def __getattr__(name: str) -> Any:
    submodule = _SUBMODULE.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
