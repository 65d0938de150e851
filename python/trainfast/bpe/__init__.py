"""Byte-pair-encoding tokenizer tools: native pre-tokenization (and training, see ``train``)."""

from trainfast.bpe.pretokenize import PATTERNS, count_pretokens, pretokenize

__all__ = ["PATTERNS", "count_pretokens", "pretokenize"]
