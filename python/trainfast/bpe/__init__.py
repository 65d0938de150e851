"""Byte-level BPE: native pre-tokenization and training (CS336 ``train_bpe`` semantics)."""

from trainfast.bpe.io import load, save
from trainfast.bpe.pretokenize import PATTERNS, count_pretokens, pretokenize
from trainfast.bpe.train import train_bpe, train_from_counts

__all__ = ["PATTERNS", "count_pretokens", "load", "pretokenize", "save", "train_bpe", "train_from_counts"]
