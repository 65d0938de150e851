"""Save/load a BPE tokenizer as GPT-2-style ``vocab.json`` + ``merges.txt``.

Every token (special tokens included) is written through GPT-2's ``bytes_to_unicode`` map, as in the
CS336 fixtures and GPT-2's own files, so any bytes round-trip exactly. ``merges.txt`` has one
``left right`` line per merge, in creation order, without a ``#version`` header unless the first
merge's line itself starts with ``#version`` (readers skip such a first line as the header).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np

from trainfast._util import write_atomic_files

__all__ = ["bytes_to_unicode", "load", "save"]

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {char: b for b, char in bytes_to_unicode().items()}


def _encode(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def save(vocab: dict[int, bytes], merges: Iterable[tuple[bytes, bytes]], out_dir: str | os.PathLike[str]) -> None:
    """Writes ``out_dir/vocab.json`` and ``out_dir/merges.txt`` (atomically: both temp files are
    written before either is renamed into place).

    ``vocab`` must map distinct ids to distinct bytes; ``merges`` are ``(left, right)`` bytes pairs.
    """
    if not isinstance(vocab, dict):
        raise TypeError(f"vocab must be a dict[int, bytes] (got {type(vocab).__name__})")
    seen: dict[bytes, int] = {}
    checked: dict[int, bytes] = {}
    for token_id, token in vocab.items():
        # What Tokenizer accepts (NumPy ids, bytearray tokens) is written too.
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or \
                not isinstance(token, (bytes, bytearray)):
            raise TypeError(f"vocab must map int to bytes (got {token_id!r}: {token!r})")
        token_id, token = int(token_id), bytes(token)
        if not 0 <= token_id < 2**31:  # what load_vocab and Tokenizer accept
            raise ValueError(f"vocab ids must be in [0, 2^31) (got {token_id})")
        if not token:  # load_vocab and Tokenizer refuse it
            raise ValueError(f"vocab[{token_id}] must be non-empty bytes (got b'')")
        if token in seen:
            raise ValueError(f"vocab maps ids {seen[token]} and {token_id} to the same token {token!r}, which "
                             f"vocab.json (token -> id) cannot hold; train_bpe makes such a vocab from a "
                             f"one-byte special token")
        seen[token] = token_id
        checked[token_id] = token
    if isinstance(merges, (str, bytes, dict)) or not hasattr(merges, "__iter__"):
        raise TypeError(f"merges must be a list of (bytes, bytes) (got {type(merges).__name__})")
    lines = []
    for idx, merge in enumerate(merges):
        if not (isinstance(merge, (tuple, list)) and len(merge) == 2
                and all(isinstance(x, (bytes, bytearray)) and x for x in merge)):
            raise TypeError(f"merges[{idx}] must be a pair of non-empty bytes (got {merge!r})")
        left, right = bytes(merge[0]), bytes(merge[1])
        # Same rule as Tokenizer and the exporters: a file they would reject is never written.
        for what, token in (("left", left), ("right", right), ("merged", left + right)):
            if token not in seen:
                raise ValueError(f"merges[{idx}] = ({left!r}, {right!r}) refers to an unknown token: "
                                 f"its {what} token {token!r} is not in vocab")
        lines.append(f"{_encode(left)} {_encode(right)}\n")
    if lines and lines[0].startswith("#version"):  # else it would be read back as the header
        lines.insert(0, "#version: 0.2\n")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {str(out)!r} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    vocab_json = {_encode(token): token_id for token_id, token in sorted(checked.items())}
    # Both files or neither: a vocab.json next to another vocab's merges.txt would load as garbage.
    write_atomic_files([(out / VOCAB_FILE, json.dumps(vocab_json, ensure_ascii=False, indent=2) + "\n"),
                        (out / MERGES_FILE, "".join(lines))])


def load(out_dir: str | os.PathLike[str]) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Reads what :func:`save` wrote (or GPT-2 / CS336 fixture files): ``(vocab, merges)``, checked
    as ``load_vocab``/``load_merges`` check them (errors name the file and the line, or for invalid
    UTF-8 the byte offset). Unlike ``Tokenizer.from_files`` it does not require all 256 single-byte
    tokens: :func:`save` writes any vocab, and what it writes loads back."""
    from trainfast.bpe.tokenizer import load_merges, load_vocab

    out = Path(out_dir)
    vocab = load_vocab(out / VOCAB_FILE)
    return vocab, load_merges(out / MERGES_FILE, vocab)
