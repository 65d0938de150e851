"""Byte-level BPE: native pre-tokenization, training (CS336 ``train_bpe`` semantics), encoding,
pre-token counts that add up across shards, and exports to HF tokenizers / tiktoken."""

from trainfast.bpe.counts import WordCounts, count_words, train_from_counts
from trainfast.bpe.io import load, save
from trainfast.bpe.pretokenize import PATTERNS, count_pretokens, pretokenize
from trainfast.bpe.tokenizer import Tokenizer
from trainfast.bpe.train import train_bpe

__all__ = ["PATTERNS", "Tokenizer", "WordCounts", "count_pretokens", "count_words", "load", "pretokenize", "save",
           "train_bpe", "train_from_counts"]
