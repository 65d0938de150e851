"""Byte-level BPE: pre-tokenization and training (CS336 ``train_bpe`` semantics)."""

from trainfast.bpe.io import load, save
from trainfast.bpe.train import train_bpe, train_from_counts

__all__ = ["load", "save", "train_bpe", "train_from_counts"]
