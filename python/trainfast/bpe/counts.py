"""Pre-token counts as a value: count once, save, add up across shards or machines, train later.

``count_words`` counts pre-tokens (UTF-8 bytes -> int64 count) like ``train_bpe`` does before its
merge loop, and remembers the pattern and special tokens used. ``a + b`` adds counts of two disjoint
sets of inputs; ``train_from_counts(counts, vocab_size)`` then gives exactly the ``(vocab, merges)``
``train_bpe`` gives on all those inputs together::

    a = count_words(Path("part1.txt"), special_tokens=["<|endoftext|>"])
    b = count_words(Path("part2.txt"), special_tokens=["<|endoftext|>"])
    (a + b).save("counts.tfwc")
    vocab, merges = train_from_counts(WordCounts.load("counts.tfwc"), 32_000)
    # == train_bpe([Path("part1.txt"), Path("part2.txt")], 32_000, ["<|endoftext|>"])

File format (little endian): ``b"TFWC"``, u32 version (1), u32 header length, a UTF-8 JSON header
(pattern, special_tokens, num_words), then u32 lengths[num_words], i64 counts[num_words], the
concatenated word bytes, and a u32 CRC-32 of everything before it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Union

import numpy as np

from trainfast._util import check_choice, resolve_num_threads, write_atomic

__all__ = ["WordCounts", "count_words", "train_from_counts"]

PathLike = Union[str, "os.PathLike[str]"]

_MAGIC = b"TFWC"
_VERSION = 1
_MAX_COUNT = 2**63 - 1
_PREFIX = struct.Struct("<4sII")


class WordCounts:
    """Counts of pre-tokens (``bytes`` -> int in [1, 2^63-1]), with the ``pattern`` and
    ``special_tokens`` they were counted with (``+`` refuses to mix different ones)."""

    __slots__ = ("_counts", "_pattern", "_special_tokens")

    def __init__(self, counts: dict[bytes, int] | None = None, *, pattern: str = "gpt2",
                 special_tokens: Sequence[str] | None = ()) -> None:
        from trainfast.bpe.pretokenize import _check_special_tokens

        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str (a pattern name or regex; got {type(pattern).__name__})")
        self._pattern = pattern
        self._special_tokens = tuple(_check_special_tokens(special_tokens, unique=True))
        self._counts: dict[bytes, int] = {}
        if counts is not None:
            if not isinstance(counts, dict):
                raise TypeError(f"counts must be a dict[bytes, int] (got {type(counts).__name__})")
            for word, count in counts.items():
                if not isinstance(word, bytes) or not word:
                    raise TypeError(f"counts keys must be non-empty bytes (got {word!r})")
                if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
                    raise TypeError(f"counts[{word!r}] must be an int (got {type(count).__name__})")
                if not 1 <= count <= _MAX_COUNT:
                    raise ValueError(f"counts[{word!r}] must be in [1, 2^63-1] (got {count})")
                self._counts[word] = int(count)

    @classmethod
    def _trusted(cls, counts: dict[bytes, int], pattern: str, special_tokens: Sequence[str]) -> WordCounts:
        out = cls.__new__(cls)
        out._counts, out._pattern, out._special_tokens = counts, pattern, tuple(special_tokens)
        return out

    @property
    def counts(self) -> dict[bytes, int]:
        """The ``{pre-token bytes: count}`` table (not a copy; do not modify)."""
        return self._counts

    @property
    def pattern(self) -> str:
        return self._pattern

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self._special_tokens

    @property
    def total(self) -> int:
        """Number of pre-tokens counted (sum of counts); empty regex matches are not counted."""
        return sum(self._counts.values())

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._counts)

    def __getitem__(self, word: bytes) -> int:
        return self._counts[word]

    def __contains__(self, word: object) -> bool:
        return word in self._counts

    def items(self) -> Iterable[tuple[bytes, int]]:
        return self._counts.items()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WordCounts):
            return NotImplemented
        return (_pattern_key(self._pattern), self._special_tokens, self._counts) == \
            (_pattern_key(other._pattern), other._special_tokens, other._counts)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"WordCounts({len(self._counts):,} words, total {self.total:,}, pattern={self._pattern!r}, "
                f"special_tokens={list(self._special_tokens)!r})")

    def _check_compatible(self, other: WordCounts) -> None:
        if (_pattern_key(self._pattern), self._special_tokens) != (_pattern_key(other._pattern), other._special_tokens):
            raise ValueError(
                "cannot add WordCounts counted with different settings: "
                f"pattern {self._pattern!r} special_tokens {list(self._special_tokens)!r} vs "
                f"pattern {other._pattern!r} special_tokens {list(other._special_tokens)!r}"
            )

    def __add__(self, other: WordCounts) -> WordCounts:
        if not isinstance(other, WordCounts):
            return NotImplemented
        self._check_compatible(other)
        out = dict(self._counts)
        _add_into(out, other._counts)
        return WordCounts._trusted(out, self._pattern, self._special_tokens)

    def __iadd__(self, other: WordCounts) -> WordCounts:
        if not isinstance(other, WordCounts):
            return NotImplemented
        self._check_compatible(other)
        _add_into(self._counts, other._counts)
        return self

    # --- serialization --------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        words = list(self._counts)
        header = json.dumps({"pattern": self._pattern, "special_tokens": list(self._special_tokens),
                             "num_words": len(words)}, ensure_ascii=False).encode("utf-8")
        lengths = np.fromiter((len(w) for w in words), dtype="<u4", count=len(words))
        counts = np.fromiter(self._counts.values(), dtype="<i8", count=len(words))
        body = b"".join([_PREFIX.pack(_MAGIC, _VERSION, len(header)), header, lengths.tobytes(), counts.tobytes(),
                         b"".join(words)])
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, source: str = "data") -> WordCounts:
        """Parses :meth:`to_bytes` output; a corrupt or truncated input raises ValueError naming ``source``."""
        if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, bytearray or memoryview (got {type(data).__name__})")
        data = memoryview(data)
        data = data.cast("B") if data.c_contiguous else memoryview(data.tobytes())  # strided views: copy

        def corrupt(why: str) -> ValueError:
            return ValueError(f"{source} is not a valid WordCounts file: {why}")

        if len(data) < _PREFIX.size + 4:
            raise corrupt(f"too short ({len(data)} bytes)")
        magic, version, header_len = _PREFIX.unpack_from(data, 0)
        if magic != _MAGIC:
            raise corrupt(f"bad magic {bytes(magic)!r} (expected {_MAGIC!r})")
        if version != _VERSION:
            raise corrupt(f"unsupported version {version} (this trainfast reads version {_VERSION})")
        (stored_crc,) = struct.unpack_from("<I", data, len(data) - 4)
        if zlib.crc32(data[:-4]) != stored_crc:
            raise corrupt("checksum mismatch (truncated or modified)")
        pos = _PREFIX.size
        if pos + header_len > len(data) - 4:
            raise corrupt(f"header length {header_len} runs past the end")
        try:
            header = json.loads(bytes(data[pos:pos + header_len]).decode("utf-8"))
            pattern, special_tokens, num_words = header["pattern"], header["special_tokens"], header["num_words"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise corrupt(f"unreadable header ({error})") from None
        if not isinstance(pattern, str) or not isinstance(special_tokens, list) or \
                not all(isinstance(t, str) and t for t in special_tokens) or \
                isinstance(num_words, bool) or not isinstance(num_words, int) or num_words < 0:
            raise corrupt("malformed header fields")
        from trainfast.bpe.pretokenize import _check_special_tokens

        try:
            _check_special_tokens(special_tokens, unique=True)
        except ValueError as error:
            raise corrupt(f"bad special tokens in the header ({error})") from None
        pos += header_len
        end = len(data) - 4
        if pos + 12 * num_words > end:
            raise corrupt(f"{num_words} words do not fit in {len(data)} bytes")
        lengths = np.frombuffer(data, dtype="<u4", count=num_words, offset=pos).astype(np.int64)
        pos += 4 * num_words
        counts = np.frombuffer(data, dtype="<i8", count=num_words, offset=pos)
        pos += 8 * num_words
        if num_words and (lengths.min() < 1 or counts.min() < 1):
            raise corrupt("a word is empty or has a count below 1")
        if pos + int(lengths.sum()) != end:
            raise corrupt(f"word bytes take {int(lengths.sum())} bytes, the file has {end - pos}")
        blob = bytes(data[pos:end])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        words = [blob[offsets[k]:offsets[k + 1]] for k in range(num_words)]
        # In slices: one dict(zip(...)) over millions of words is a C loop that Ctrl-C cannot stop.
        table: dict[bytes, int] = {}
        for start in range(0, num_words, 1 << 19):
            table.update(zip(words[start:start + (1 << 19)], counts[start:start + (1 << 19)].tolist()))
        if len(table) != num_words:
            raise corrupt("a word appears twice")
        return cls._trusted(table, pattern, special_tokens)

    def save(self, path: PathLike) -> Path:
        """Writes :meth:`to_bytes` to ``path`` atomically (temp file + rename); returns the path."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"path {str(path)!r} is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.to_bytes())
        return path

    @classmethod
    def load(cls, path: PathLike) -> WordCounts:
        path = Path(path)
        return cls.from_bytes(path.read_bytes(), source=f"counts file {str(path)!r}")


def _pattern_key(pattern: str) -> str:
    """One spelling per pre-tokenizer: "cl100k_base", "cl100k" and its regex count alike."""
    from trainfast.bpe.pretokenize import _ALIASES, PATTERNS

    name = _ALIASES.get(pattern, pattern)
    return next((known for known, text in PATTERNS.items() if text == pattern), name)


class CountOverflowError(OverflowError, ValueError):
    """A count past 2^63-1; a ValueError too, as every bad-input error of the package is."""


def _add_into(out: dict[bytes, int], other: dict[bytes, int]) -> None:
    get = out.get
    # Every sum is checked before any is written, so a failed `+=` leaves the counts as they were.
    for word, count in other.items():
        if get(word, 0) + count > _MAX_COUNT:
            raise CountOverflowError(f"count of {word!r} exceeds 2^63-1 after adding")
    for word, count in other.items():
        out[word] = get(word, 0) + count


def count_words(
    inputs: PathLike | Sequence[PathLike] | Iterable[str | bytes],
    special_tokens: Sequence[str] | None = (),
    pattern: str = "gpt2",
    num_threads: int | None = None,
    *,
    errors: str = "strict",
    show_progress: bool = True,
) -> WordCounts:
    """Pre-token counts of files or documents, exactly those ``train_bpe`` trains on (each input is
    pre-tokenized on its own). ``inputs`` is read as ``count_pretokens`` reads it: one path (str or
    ``os.PathLike``), a list or tuple of paths (str or ``os.PathLike``), or any other iterable of
    ``str``/``bytes`` documents (so pass a list of document strings as e.g. ``iter(texts)``)."""
    from trainfast.bpe.pretokenize import count_pretokens
    from trainfast.bpe.pretokenize import _check_special_tokens

    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, a name or a regular expression's source, which the counts keep "
                        f"(got {type(pattern).__name__})")
    special_tokens = _check_special_tokens(special_tokens, unique=True)
    check_choice(errors, "errors", ("strict", "replace", "ignore"))
    counts = count_pretokens(inputs, pattern=pattern, special_tokens=tuple(special_tokens),
                             num_threads=resolve_num_threads(num_threads), errors=errors,
                             show_progress=show_progress)
    # A custom regex may match the empty string: such a word has no pair to merge, and WordCounts
    # (its file format included) holds non-empty words only.
    counts.pop(b"", None)
    return WordCounts._trusted(counts, pattern, special_tokens)


def train_from_counts(
    word_counts: WordCounts | dict[bytes, int],
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    *,
    show_progress: bool = True,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``train_bpe``'s ``(vocab, merges)`` from counts. For :class:`WordCounts`, ``special_tokens``
    defaults to the ones counted with and must equal them (they also take ids 256...)."""
    from trainfast.bpe import train as train_module
    from trainfast.bpe.pretokenize import _check_special_tokens

    # Read once, here: a one-shot iterable compared below would reach training empty.
    tokens = None if special_tokens is None else _check_special_tokens(special_tokens, unique=True)
    if isinstance(word_counts, WordCounts):
        if tokens is None:
            tokens = list(word_counts.special_tokens)
        elif tokens != list(word_counts.special_tokens):
            raise ValueError(
                f"special_tokens {tokens!r} differ from those the counts were taken with "
                f"{list(word_counts.special_tokens)!r}; train_bpe would have counted different pre-tokens"
            )
        table = word_counts.counts
    elif isinstance(word_counts, dict):
        table = word_counts
    else:
        raise TypeError(f"word_counts must be a WordCounts or dict[bytes, int] (got {type(word_counts).__name__})")
    return train_module._train_from_dict(table, vocab_size, tokens or [], show_progress=show_progress)
