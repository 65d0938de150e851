"""Byte-level BPE: native pre-tokenization, training (CS336 ``train_bpe`` semantics) and encoding."""

from trainfast.bpe.io import load, save
from trainfast.bpe.pretokenize import PATTERNS, count_pretokens, pretokenize
from trainfast.bpe.tokenizer import Tokenizer
from trainfast.bpe.train import train_bpe, train_from_counts

__all__ = ["PATTERNS", "Tokenizer", "count_pretokens", "load", "pretokenize", "save", "train_bpe",
           "train_from_counts"]
