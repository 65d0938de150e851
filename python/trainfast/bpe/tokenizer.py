"""BPE encode/decode with the semantics of Stanford CS336 assignment 1's ``Tokenizer``.

Special tokens are split out of the text first (leftmost occurrence, longest token at a position,
so ``"<|endoftext|><|endoftext|>"`` beats ``"<|endoftext|>"``) and emitted as their ids; the rest
is pre-tokenized (GPT-2 pattern by default) and each pre-token's bytes are merged by repeatedly
joining the leftmost adjacent pair with the lowest merge rank (creation order). On GPT-2's
vocabulary and merges this equals ``tiktoken``'s ``gpt2`` encoding::

    tok = Tokenizer.from_files("vocab.json", "merges.txt", special_tokens=["<|endoftext|>"])
    ids = tok.encode("Hello world<|endoftext|>")      # [15496, 995, 50256]
    tok.decode(ids)                                    # 'Hello world<|endoftext|>'
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union

import numpy as np

from trainfast._util import check_has_data, resolve_num_threads
from trainfast.bpe.pretokenize import _check_special_tokens

__all__ = ["Tokenizer", "load_merges", "load_vocab"]

PathLike = Union[str, "os.PathLike[str]"]
Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]

# encode_iterable: try to encode the buffered text once it holds this many characters.
_STREAM_CHARS = 1 << 16


class Tokenizer:
    """A byte-level BPE tokenizer over a fixed vocabulary, merge list and special tokens.

    Args:
        vocab: ``{id: token bytes}``; ids are non-negative ints, tokens distinct non-empty bytes
            (except that a special token may also be an ordinary token: ``train_bpe`` gives a
            one-byte special token an id of its own), and all 256 single bytes must be present.
            Ids are < 2^31. The native tables are indexed by id when the ids are dense (the
            largest below 4 x the vocab size + 65536, about 20 bytes per id); a vocab with a
            stray large id keeps its ids sorted instead (decode searches them).
        merges: ``(left, right)`` byte pairs in creation order (rank = index); both sides and their
            concatenation must be vocab tokens.
        special_tokens: strings always encoded as one token each; one missing from ``vocab`` is
            added with the next free id (as in CS336), so their order matters: a set is refused.
        pattern: pre-tokenizer: ``"gpt2"`` (default), ``"cl100k"``, ``"o200k"`` (native scanners)
            or another regular expression (``regex`` package, slower, ``encode_iterable`` then
            reads the whole input before yielding).

    >>> from trainfast.bpe import train_bpe
    >>> vocab, merges = train_bpe(iter(["low lower lowest<|endoftext|>low low"]), 262,
    ...                           ["<|endoftext|>"], show_progress=False)
    >>> tokenizer = Tokenizer(vocab, merges, ["<|endoftext|>"])
    >>> ids = tokenizer.encode(" lowest<|endoftext|>")
    >>> ids, [vocab[token_id] for token_id in ids]
    ([260, 261, 256], [b' lowe', b'st', b'<|endoftext|>'])
    >>> tokenizer.decode(ids)
    ' lowest<|endoftext|>'
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
        *,
        pattern: Any = "gpt2",
    ) -> None:
        from trainfast import _core
        from trainfast.bpe.pretokenize import _check_pieces_pattern, _resolve_pattern

        self._special_tokens = _check_special_tokens(special_tokens, unique=True)
        self._vocab = _check_vocab(vocab, self._special_tokens)
        # Where a special token repeats a vocab token (train_bpe's one-byte specials), the last id
        # wins, as in CS336's reverse map; text never reaches the other, specials are split first.
        self._token_to_id = {token: token_id for token_id, token in self._vocab.items()}
        self._merges = _check_merges(merges, self._token_to_id)
        next_id = max(self._vocab, default=-1) + 1
        special_ids = []
        for token in self._special_tokens:
            token_bytes = token.encode("utf-8")
            if token_bytes not in self._token_to_id:  # CS336: specials missing from vocab are appended
                if next_id >= 2**31:
                    raise ValueError(f"special token {token!r} is not in vocab and would get id {next_id} "
                                     f"(max vocab id + 1), past the largest id, 2^31 - 1; add it to vocab")
                self._vocab[next_id] = token_bytes
                self._token_to_id[token_bytes] = next_id
                next_id += 1
            special_ids.append(self._token_to_id[token_bytes])
        self._special_ids = dict(zip(self._special_tokens, special_ids))
        self._pattern_id, self._regex = _resolve_pattern(pattern)
        _check_pieces_pattern(self._regex)
        self._pattern = pattern
        to_id = self._token_to_id
        merge_ids = np.array(
            [(to_id[left], to_id[right], to_id[left + right]) for left, right in self._merges], dtype=np.int64
        ).reshape(-1, 3)
        self._native = _core.BpeEncoder(
            list(self._vocab.values()),
            np.fromiter(self._vocab.keys(), dtype=np.int64, count=len(self._vocab)),
            np.ascontiguousarray(merge_ids[:, 0]),
            np.ascontiguousarray(merge_ids[:, 1]),
            np.ascontiguousarray(merge_ids[:, 2]),
            [token.encode("utf-8") for token in self._special_tokens],
            np.array(special_ids, dtype=np.int64),
            0 if self._pattern_id is None else self._pattern_id,
        )
        self._special_splitter = None
        if self._regex is not None and self._special_tokens:
            import regex

            ordered = sorted(self._special_tokens, key=len, reverse=True)
            self._special_splitter = regex.compile("(" + "|".join(regex.escape(t) for t in ordered) + ")")

    def __getstate__(self) -> dict[str, Any]:
        return {"vocab": self._vocab, "merges": self._merges, "special_tokens": self._special_tokens,
                "pattern": self._pattern}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A subclass's own __init__ runs too, as it did when the object was made.
        self.__init__(state["vocab"], state["merges"], state["special_tokens"],  # type: ignore[misc]
                      pattern=state["pattern"])

    @classmethod
    def from_files(
        cls,
        vocab_filepath: PathLike,
        merges_filepath: PathLike,
        special_tokens: Sequence[str] | None = None,
        *,
        pattern: Any = "gpt2",
    ) -> Tokenizer:
        """Loads GPT-2-style ``vocab.json`` (``{token: id}``, bytes through GPT-2's printable map) and
        ``merges.txt`` (one ``left right`` per line, optional ``#version`` header)."""
        vocab = load_vocab(vocab_filepath)
        merges = load_merges(merges_filepath, vocab)
        return cls(vocab, merges, special_tokens, pattern=pattern)

    @property
    def vocab(self) -> dict[int, bytes]:
        """``{id: token bytes}``, special tokens included (a copy)."""
        return dict(self._vocab)

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        return list(self._merges)

    @property
    def special_tokens(self) -> list[str]:
        return list(self._special_tokens)

    @property
    def pattern(self) -> Any:
        return self._pattern

    def __len__(self) -> int:
        return len(self._vocab)

    def token_to_id(self, token: bytes) -> int | None:
        return self._token_to_id.get(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (a lone surrogate becomes U+FFFD first, as in tiktoken)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str (got {type(text).__name__})")
        if self._regex is not None:
            return self._encode_regex(_clean_surrogates(text))
        try:
            return self._native.encode(text)
        except UnicodeEncodeError:
            return self._native.encode(_clean_surrogates(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """``[encode(t) for t in texts]`` on up to ``num_threads`` threads (default
        $TRAINFAST_NUM_THREADS or all cores); the result does not depend on it."""
        if isinstance(texts, str) or not isinstance(texts, Iterable):
            raise TypeError(f"texts must be a list of str (got {type(texts).__name__})")
        texts = list(texts)
        for idx, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{idx}] must be a str (got {type(text).__name__})")
        num_threads = resolve_num_threads(num_threads)
        if self._regex is not None:
            return [self._encode_regex(_clean_surrogates(text)) for text in texts]
        # Many new lists would trigger the cyclic GC over and over; lists of ints hold no cycles.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            try:
                return self._native.encode_batch(texts, num_threads)
            except UnicodeEncodeError:
                return self._native.encode_batch([_clean_surrogates(t) for t in texts], num_threads)
        finally:
            if gc_was_enabled:
                gc.enable()

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily yields the ids of ``"".join(iterable)`` (e.g. a text file handle), holding only a
        bounded window of text: it is cut where no pre-token or special token can span the cut."""
        if isinstance(iterable, str):
            raise TypeError("encode_iterable expects an iterable of str (e.g. a file handle), not a str; use encode")
        if not isinstance(iterable, Iterable):
            raise TypeError(f"iterable must be an iterable of str (got {type(iterable).__name__})")
        return self._encode_stream(iterable)

    def _encode_stream(self, iterable: Iterable[str]) -> Iterator[int]:
        pending: list[str] = []
        pending_chars = 0
        next_try = _STREAM_CHARS  # grows when no cut was found, so scanning stays linear
        for idx, chunk in enumerate(iterable):
            if not isinstance(chunk, str):
                raise TypeError(f"iterable item {idx} must be a str (got {type(chunk).__name__})")
            pending.append(chunk)
            pending_chars += len(chunk)
            if self._regex is not None or pending_chars < next_try:
                continue
            buffer = "".join(pending)
            held = ""
            if "\ud800" <= buffer[-1] <= "\udbff":  # may pair with a low surrogate in the next chunk
                buffer, held = buffer[:-1], buffer[-1]
            buffer = _clean_surrogates(buffer)
            ids, used = self._native.encode_prefix(buffer)
            rest = buffer[used:] + held
            pending, pending_chars = [rest], len(rest)
            next_try = max(_STREAM_CHARS, 2 * pending_chars)
            yield from ids
        yield from self.encode("".join(pending))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; byte sequences that are not valid UTF-8 become U+FFFD.

        ``ids``: ints, or an integer `[num_ids]` NumPy array or tensor (as ``encode`` and
        ``trainfast bpe encode`` produce).
        """
        return self._native.decode(_id_list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of the ids (``ids`` as :meth:`decode` takes them)."""
        return self._native.decode_bytes(_id_list(ids))

    def _encode_regex(self, text: str) -> list[int]:
        ids: list[int] = []
        parts = self._special_splitter.split(text) if self._special_splitter is not None else [text]
        for idx, part in enumerate(parts):
            if idx % 2 == 1:
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(self._native.encode_pieces([p.encode("utf-8") for p in self._regex.findall(part)]))
        return ids

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={len(self._vocab)}, num_merges={len(self._merges)}, "
                f"special_tokens={self._special_tokens!r}, pattern={self._pattern!r})")


def _clean_surrogates(text: str) -> str:
    """Lone surrogates (no UTF-8 form) become U+FFFD; surrogate pairs join, as tiktoken does."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _id_list(ids: Any) -> Any:
    if isinstance(ids, (list, tuple)):
        return ids
    if isinstance(ids, (str, bytes, bytearray, memoryview)):  # text or bytes, not ids
        raise TypeError(f"ids must be a sequence of int (got {type(ids).__name__})")
    if hasattr(ids, "tolist") and callable(ids.tolist):  # numpy array / torch tensor
        if hasattr(ids, "detach"):
            check_has_data(ids, "ids")
            ids = ids.detach().cpu()
        if getattr(ids, "ndim", None) == 1:
            # In slices: one tolist() of tens of millions of ids is a C loop Ctrl-C cannot stop.
            values = []
            for start in range(0, len(ids), 1 << 20):
                values.extend(ids[start:start + (1 << 20)].tolist())
        else:
            values = ids.tolist()
        if not isinstance(values, list) or (values and isinstance(values[0], list)):
            raise ValueError(f"ids must be 1-D (got shape {tuple(getattr(ids, 'shape', ()))})")
        if values and not isinstance(values[0], int):
            raise TypeError(f"ids must hold integers (got dtype {getattr(ids, 'dtype', '?')})")
        return values
    if isinstance(ids, Iterable):
        return list(ids)
    raise TypeError(f"ids must be a sequence of int (got {type(ids).__name__})")


# --- validation ------------------------------------------------------------------------------


def _check_vocab(vocab: Any, special_tokens: Sequence[str] = ()) -> dict[int, bytes]:
    """Tokens must be distinct, except that a special token may also be an ordinary token (the
    vocab ``train_bpe`` returns for a one-byte special token holds that byte twice)."""
    if not isinstance(vocab, dict):
        raise TypeError(f"vocab must be a dict[int, bytes] (got {type(vocab).__name__})")
    special_bytes = {token.encode("utf-8") for token in special_tokens}
    out: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for token_id, token in vocab.items():
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise TypeError(f"vocab keys must be int ids (got {type(token_id).__name__} {token_id!r})")
        token_id = int(token_id)
        if not 0 <= token_id < 2**31:
            raise ValueError(f"vocab ids must be in [0, 2^31) (got {token_id})")
        if isinstance(token, bytearray):
            token = bytes(token)
        if not isinstance(token, bytes):
            raise TypeError(f"vocab[{token_id}] must be bytes (got {type(token).__name__} {token!r})")
        if not token:
            raise ValueError(f"vocab[{token_id}] must be non-empty bytes (got b'')")
        if token in seen and token not in special_bytes:
            raise ValueError(f"vocab ids {seen[token]} and {token_id} both map to token {token!r}")
        seen[token] = token_id
        out[token_id] = token
    missing = [b for b in range(256) if bytes([b]) not in seen]
    if missing:
        raise ValueError(
            f"vocab must contain all 256 single-byte tokens (missing {len(missing)}, e.g. {bytes([missing[0]])!r})"
        )
    return out


def _check_merges(merges: Any, token_to_id: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    if isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable):
        raise TypeError(f"merges must be a list of (bytes, bytes) (got {type(merges).__name__})")
    out = []
    for idx, merge in enumerate(merges):
        if not (isinstance(merge, (tuple, list)) and len(merge) == 2
                and all(isinstance(part, (bytes, bytearray)) for part in merge)):
            raise TypeError(f"merges[{idx}] must be a pair of bytes (got {merge!r})")
        left, right = bytes(merge[0]), bytes(merge[1])
        for what, token in (("left", left), ("right", right), ("merged", left + right)):
            if token not in token_to_id:
                raise ValueError(f"merges[{idx}] = ({left!r}, {right!r}) refers to an unknown token: "
                                 f"its {what} token {token!r} is not in vocab")
        out.append((left, right))
    return out


# --- file loading ----------------------------------------------------------------------------


def _line_of(text: str, key: str) -> int:
    """1-based line of a key's JSON spelling in text (0 when not found)."""
    import re

    for spelling in (json.dumps(key, ensure_ascii=False), json.dumps(key)):
        # Where a key starts (after "{", "," or blanks), not inside one: the key of '"' ends in '"":'.
        match = re.search(r"(?:^|(?<=[{,\s]))" + re.escape(spelling) + r"\s*:", text)
        pos = match.start() if match else text.find(spelling)
        if pos >= 0:
            return text.count("\n", 0, pos) + 1
    return 0


def load_vocab(path: PathLike) -> dict[int, bytes]:
    """``{id: bytes}`` of a GPT-2-style ``vocab.json``; errors name the file and the line (invalid
    UTF-8: the byte offset)."""
    from trainfast.bpe.io import _unicode_to_bytes

    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not valid UTF-8 at byte {error.start}") from None
    try:
        # An id of thousands of digits would pass int()'s digit limit: kept as text for the id check.
        entries = json.loads(text, object_pairs_hook=list,
                             parse_int=lambda digits: int(digits) if len(digits) <= 32 else
                             f"{digits[:16]}... ({len(digits)} digits)")
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(entries, list) or (entries and not isinstance(entries[0], tuple)):
        raise ValueError(f"{path}:1: vocab must be a JSON object {{token: id}}")
    table = _unicode_to_bytes()
    vocab: dict[int, bytes] = {}
    seen: dict[bytes, str] = {}
    for key, token_id in entries:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < 2**31:
            raise ValueError(f"{path}:{_line_of(text, key)}: id of {key!r} must be an int in [0, 2^31) "
                             f"(got {token_id!r})")
        try:
            token = bytes(table[char] for char in key)
        except KeyError as error:
            raise ValueError(f"{path}:{_line_of(text, key)}: token {key!r} has a character outside GPT-2's "
                             f"byte map ({error.args[0]!r})") from None
        if not token:
            raise ValueError(f"{path}:{_line_of(text, key)}: empty token")
        if token_id in vocab:
            raise ValueError(f"{path}:{_line_of(text, key)}: id {token_id} of {key!r} is already used by "
                             f"{seen[vocab[token_id]]!r}")
        if token in seen:
            raise ValueError(f"{path}:{_line_of(text, key)}: token {key!r} appears twice")
        vocab[token_id] = token
        seen[token] = key
    return dict(sorted(vocab.items()))


def load_merges(path: PathLike, vocab: dict[int, bytes] | None = None) -> list[tuple[bytes, bytes]]:
    """Merges of a GPT-2-style ``merges.txt``; with ``vocab``, also checks every merge refers to
    vocab tokens. Errors name the file and the line (invalid UTF-8: the byte offset)."""
    from trainfast.bpe.io import _unicode_to_bytes

    path = os.fspath(path)
    table = _unicode_to_bytes()
    known = set(vocab.values()) if vocab is not None else None
    merges = []
    with open(path, encoding="utf-8", newline="\n") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not valid UTF-8 at byte {error.start}") from None
    for line_no, line in enumerate(lines, start=1):
        line = line.rstrip("\n").rstrip("\r")
        if not line or (line_no == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"{path}:{line_no}: expected 'left right' (got {line!r})")
        try:
            left, right = (bytes(table[c] for c in part) for part in parts)
        except KeyError as error:
            raise ValueError(f"{path}:{line_no}: {line!r} has a character outside GPT-2's byte map "
                             f"({error.args[0]!r})") from None
        if known is not None:
            for what, token in (("left", left), ("right", right), ("merged", left + right)):
                if token not in known:
                    raise ValueError(f"{path}:{line_no}: merge {line!r} refers to an unknown token: its {what} "
                                     f"token {token!r} is not in the vocab")
        merges.append((left, right))
    return merges
