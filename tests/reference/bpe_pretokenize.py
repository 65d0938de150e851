"""Oracle for the BPE pre-tokenizer: the `regex` package itself, special tokens split first, files
read in Python text mode. The pattern strings are tiktoken's / CS336's, copied here on purpose so
the package's own copies are checked against them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import regex

GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
O200K_PARTS = [
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
O200K = "|".join(O200K_PARTS)
PATTERNS = {"gpt2": GPT2, "cl100k": CL100K, "o200k": O200K}
_COMPILED = {name: regex.compile(pattern) for name, pattern in PATTERNS.items()}


def split_special(text: str, special_tokens: Sequence[str]) -> list[tuple[str, bool]]:
    """(piece, is_special) in order: leftmost special token first, the longest where several match."""
    if not special_tokens:
        return [(text, False)]
    ordered = sorted(set(special_tokens), key=len, reverse=True)
    splitter = regex.compile("(" + "|".join(regex.escape(token) for token in ordered) + ")")
    return [(part, idx % 2 == 1) for idx, part in enumerate(splitter.split(text))]


def pretokenize(text: str, pattern: str = "gpt2", special_tokens: Sequence[str] = ()) -> list[str]:
    out: list[str] = []
    for part, special in split_special(text, special_tokens):
        if special:
            out.append(part)
        else:
            out.extend(_COMPILED[pattern].findall(part))
    return out


def count_pretokens(texts: Iterable[str], pattern: str = "gpt2", special_tokens: Sequence[str] = ()) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        for part, special in split_special(text, special_tokens):
            if not special:
                counts.update(token.encode("utf-8") for token in _COMPILED[pattern].findall(part))
    return counts


def read_text(path, errors: str = "strict") -> str:
    """A file as Python's text mode reads it: UTF-8, universal newlines."""
    with open(path, encoding="utf-8", errors=errors) as handle:
        return handle.read()


def decode_like_file(data: bytes, errors: str = "strict") -> str:
    """bytes decoded, then "\\r\\n" and "\\r" translated to "\\n", as text mode does."""
    return data.decode("utf-8", errors=errors).replace("\r\n", "\n").replace("\r", "\n")
