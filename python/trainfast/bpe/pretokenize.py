"""BPE pre-tokenization equal to ``regex.findall`` with the GPT-2, cl100k or o200k pattern, natively.

``pretokenize(text)`` cuts one str; ``count_pretokens(inputs)`` counts pre-tokens (as UTF-8 bytes)
over files or documents on all cores, e.g. to train a BPE tokenizer::

    counts = count_pretokens("corpus.txt", special_tokens=["<|endoftext|>"])   # {b" the": 812, ...}

The named patterns (``"gpt2"``, ``"cl100k"``, ``"o200k"``) run hand-written scanners, as do their
exact strings, also compiled by ``regex`` with default flags; any other pattern string falls back
to the ``regex`` package, and any other compiled ``regex``/``re`` pattern runs on its own engine, in
Python on one thread, which is much slower. A pattern with two or more capturing groups
(``findall`` then gives tuples) cannot be counted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, Union

from trainfast._util import Progress, check_bool, check_choice, resolve_num_threads

if TYPE_CHECKING:
    from typing_extensions import TypeGuard

    from trainfast import _core

__all__ = ["PATTERNS", "count_pretokens", "pretokenize"]

_log = logging.getLogger("trainfast.bpe")

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

#: Pattern name -> the regular expression its native scanner reproduces (as ``regex`` runs it).
PATTERNS = {"gpt2": GPT2_PATTERN, "cl100k": CL100K_PATTERN, "o200k": O200K_PATTERN}
_NATIVE_ID = {"gpt2": 0, "cl100k": 1, "o200k": 2}
_ALIASES = {"cl100k_base": "cl100k", "o200k_base": "o200k"}
_ERRORS = ("strict", "replace", "ignore")
_NAME_LIKE = re.compile(r"[A-Za-z0-9_]+")

# Documents from an iterable are handed to the native counter in batches of about this size.
_BATCH_BYTES = 8 << 20
_BATCH_DOCS = 1 << 16

PathLike = Union[str, "os.PathLike[str]"]


def _resolve_pattern(pattern: Any) -> tuple[int | None, Any]:
    """(native scanner id, None) for a known pattern, else (None, compiled regex) for the fallback."""
    if isinstance(pattern, str):
        name = _ALIASES.get(pattern, pattern)
        if name in _NATIVE_ID:
            return _NATIVE_ID[name], None
        for known, text in PATTERNS.items():
            if pattern == text:
                return _NATIVE_ID[known], None
        if _NAME_LIKE.fullmatch(pattern):
            raise ValueError(
                f"pattern must be one of {', '.join(map(repr, PATTERNS))} or a regular expression "
                f"(got unknown pattern name {pattern!r}; write '(?:{pattern})' to use it as a regular expression)"
            )
        return None, _compile(pattern)
    if hasattr(pattern, "pattern") and hasattr(pattern, "findall"):  # compiled regex / re pattern
        if not isinstance(pattern.pattern, str):  # a bytes pattern cannot scan text
            raise TypeError(f"pattern must be compiled from a str, not {type(pattern.pattern).__name__} "
                            f"(got {pattern.pattern!r})")
        for known, text in PATTERNS.items():
            if pattern.pattern == text and _is_regex_pattern(pattern) and _default_flags(pattern):
                return _NATIVE_ID[known], None
        return None, pattern
    raise TypeError(f"pattern must be a str or a compiled regular expression (got {type(pattern).__name__})")


def _is_regex_pattern(compiled: Any) -> bool:
    """Compiled by the ``regex`` package (whose class lives in its ``_regex`` module), not ``re``."""
    try:
        import regex
    except ImportError:  # pragma: no cover - then nothing is a regex pattern
        return False
    return isinstance(compiled, type(regex.compile("")))


def _check_pieces_pattern(compiled: Any) -> None:
    """Refuses a fallback pattern whose ``findall`` gives tuples (two or more capturing groups), which
    are not pre-tokens: a ValueError here, not an AttributeError deep in counting or encoding."""
    if compiled is not None and getattr(compiled, "groups", 0) >= 2:
        raise ValueError(
            f"pattern has {compiled.groups} capturing groups, so findall returns tuples, not pre-tokens; "
            f"use non-capturing groups (?:...) (got {compiled.pattern!r})"
        )


def _default_flags(compiled: Any) -> bool:
    import regex

    return compiled.flags == regex.compile("").flags


def _compile(pattern: str) -> Any:
    try:
        import regex
    except ImportError as error:  # pragma: no cover - regex is a test dependency
        raise ImportError("custom pre-tokenizer patterns need the `regex` package (pip install regex)") from error
    try:
        return regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"pattern is not a valid regular expression ({error}): {pattern!r}") from error


def _check_encodable(text: str, name: str) -> None:
    """ValueError naming ``text``'s first lone surrogate, which has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} contains a lone surrogate (at index {error.start}), which has no UTF-8 encoding") from None


def _check_special_tokens(special_tokens: Any, *, unique: bool) -> list[str]:
    """``special_tokens`` as a list of non-empty, UTF-8-encodable str (None: no tokens). ``unique``:
    a repeat is an error (where each token gets its own id); splitting text ignores repeats."""
    if special_tokens is None:
        return []
    if isinstance(special_tokens, (str, bytes)):
        raise TypeError(f"special_tokens must be a sequence of str, not a single {type(special_tokens).__name__}")
    if unique and isinstance(special_tokens, (set, frozenset)):
        # their order gives the ids: a set's order changes with PYTHONHASHSEED (a dict's keys keep theirs)
        raise TypeError(f"special_tokens must be an ordered sequence of str, such as a list "
                        f"(got a {type(special_tokens).__name__}, whose order gives different ids from run to run)")
    try:
        tokens = list(special_tokens)
    except TypeError:
        raise TypeError(
            f"special_tokens must be a sequence of str (got {type(special_tokens).__name__})"
        ) from None
    seen: set[str] = set()
    for idx, token in enumerate(tokens):
        if not isinstance(token, str):
            raise TypeError(f"special_tokens[{idx}] must be a str (got {type(token).__name__} {token!r})")
        if not token:
            raise ValueError(f"special_tokens[{idx}] must not be empty")
        _check_encodable(token, f"special_tokens[{idx}]")
        if unique and token in seen:
            raise ValueError(f"special_tokens[{idx}] = {token!r} repeats an earlier special token")
        seen.add(token)
    return tokens


def _special_splitter(tokens: Sequence[str]) -> Any:
    """``regex.split`` pattern: escaped tokens, longest first, captured so they stay in the output."""
    import regex

    unique = sorted(dict.fromkeys(tokens), key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(token) for token in unique) + ")")


def _fallback_pieces(text: str, compiled: Any, tokens: Sequence[str]) -> list[str]:
    if not tokens:
        return compiled.findall(text)
    out: list[str] = []
    for idx, part in enumerate(_special_splitter(tokens).split(text)):
        if idx % 2:
            out.append(part)
        elif part:
            out.extend(compiled.findall(part))
    return out


def pretokenize(text: str, *, pattern: Any = "gpt2", special_tokens: Sequence[str] | None = ()) -> list[str]:
    """Cuts ``text`` into pre-tokens exactly as ``regex.findall(PATTERNS[pattern], text)`` does.

    Special tokens are split off first (leftmost occurrence, longest token where several match
    there); they appear whole in the output and are not pre-tokenized, so for the named patterns
    ``"".join(pretokenize(text, ...)) == text`` always holds (a fallback pattern may skip text).

    Args:
        text: any str (lone surrogates allowed).
        pattern: ``"gpt2"`` (CS336 / GPT-2), ``"cl100k"`` or ``"o200k"`` (tiktoken), or another
            regular expression, which falls back to the ``regex`` package (slower).
        special_tokens: non-empty str tokens without lone surrogates (a repeat changes nothing).

    >>> pretokenize("Hello, world! It's 2024.")
    ['Hello', ',', ' world', '!', ' It', "'s", ' 2024', '.']
    >>> pretokenize("I'M   here", pattern="cl100k")
    ['I', "'M", '  ', ' here']
    >>> pretokenize("a<|endoftext|>b", special_tokens=["<|endoftext|>"])
    ['a', '<|endoftext|>', 'b']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (got {type(text).__name__})")
    native_id, compiled = _resolve_pattern(pattern)
    _check_pieces_pattern(compiled)
    tokens = _check_special_tokens(special_tokens, unique=False)
    if native_id is None:
        return _fallback_pieces(text, compiled, tokens)
    from trainfast import _core

    return _core.bpe_pretokenize(text, native_id, tokens)


class _Progress(Progress):
    """Bytes counted so far over one input after another (files, or batches of documents)."""

    def __init__(self, enabled: bool, total: int | None):
        def describe(done: int) -> str:
            return f"{done / 1e6:.1f} MB" + (f" of {total / 1e6:,.1f} MB" if total else "")

        super().__init__(enabled=enabled, total=total, desc="pre-tokenizing", unit="B", logger=_log,
                         describe=describe, unit_scale=True)
        self.base = 0

    def update_in_input(self, done_in_input: int) -> None:
        self.update_to(self.base + done_in_input)

    def finish_input(self, size: int) -> None:
        self.base += size
        self.update_to(self.base)

    def close(self) -> None:
        if self.enabled and self.bar is None:
            _log.info("pre-tokenized %.1f MB", self.done / 1e6)
        super().close()


def _is_path(value: object) -> TypeGuard[str | os.PathLike[Any]]:
    return isinstance(value, (str, os.PathLike))


def count_pretokens(
    inputs: PathLike | Sequence[PathLike] | Iterable[str | bytes],
    *,
    pattern: Any = "gpt2",
    special_tokens: Sequence[str] | None = (),
    num_threads: int | None = None,
    errors: str = "strict",
    show_progress: bool = False,
) -> dict[bytes, int]:
    """Counts pre-tokens (UTF-8 bytes -> int count) over files or documents.

    Equal to ``Counter(t.encode() for doc in docs for piece in split(doc) for t in
    regex.findall(PATTERN, piece))`` where ``split`` removes the special tokens (they are never
    counted); each file and each document is pre-tokenized on its own. The dict lists pre-tokens
    in order of first occurrence, and does not depend on ``num_threads``.

    Args:
        inputs: a path (str or ``os.PathLike``), a list/tuple of paths, or any other iterable of
            documents: ``str`` taken as is, ``bytes`` decoded like a file. (A list of str is a list
            of paths: pass documents as e.g. ``iter(texts)``.) Files and bytes are read like
            Python's text mode: UTF-8, universal newlines ("\\r\\n", "\\r" -> "\\n").
        pattern: ``"gpt2"``, ``"cl100k"``, ``"o200k"`` or another regular expression (slow
            fallback through the ``regex`` package, one thread, which reads each file whole: an
            arbitrary pattern has no safe places to cut the text).
        special_tokens: str tokens split on first (longest wins), not counted.
        num_threads: threads (default: $TRAINFAST_NUM_THREADS or all available cores).
        errors: invalid UTF-8 raises ValueError naming the byte offset (``"strict"``), becomes
            U+FFFD (``"replace"``) or is dropped (``"ignore"``), as Python's decoder does.
        show_progress: report bytes processed (tqdm on a terminal, else ``logging``).

    Regular files are memory-mapped: one truncated by another process while it is being counted
    ends this process with SIGBUS, as any memory-mapped read does.

    Returns:
        dict[bytes, int] with int64-range counts.

    >>> count_pretokens(iter(["the cat", "the dog"]), num_threads=1)
    {b'the': 2, b' cat': 1, b' dog': 1}
    """
    return _count(inputs, pattern, special_tokens, num_threads, errors, show_progress, lambda counter: counter.finish())


_Finished = TypeVar("_Finished")


def _count(inputs: Any, pattern: Any, special_tokens: Sequence[str] | None, num_threads: int | None, errors: str,
           show_progress: bool, finish: Callable[[_core.BpePretokenCounter], _Finished]
           ) -> _Finished | dict[bytes, int]:
    """count_pretokens with the native counter's finish given: ``train_bpe`` finishes into a table,
    without building the dict. Other patterns (the ``regex`` fallback) return a dict."""
    native_id, compiled = _resolve_pattern(pattern)
    _check_pieces_pattern(compiled)
    tokens = _check_special_tokens(special_tokens, unique=False)
    threads = resolve_num_threads(num_threads)
    check_choice(errors, "errors", _ERRORS)
    show_progress = check_bool(show_progress, "show_progress")

    paths: list[str | bytes] | None = None
    if _is_path(inputs):
        paths = [os.fspath(inputs)]
    elif isinstance(inputs, (list, tuple)) and all(_is_path(item) for item in inputs):
        paths = [os.fspath(item) for item in inputs]
    elif isinstance(inputs, (list, tuple)) and any(isinstance(item, str) for item in inputs) and any(
            isinstance(item, bytes) for item in inputs):
        raise TypeError("inputs mixes str and bytes: a list of str is read as file paths, bytes as documents "
                        "(pass documents as iter(texts), or files as paths only)")
    elif isinstance(inputs, (bytes, bytearray)):
        raise TypeError("inputs must be a path, a list of paths or an iterable of str/bytes (got a single bytes)")
    elif not isinstance(inputs, Iterable):
        raise TypeError(
            f"inputs must be a path, a list of paths or an iterable of str/bytes (got {type(inputs).__name__})"
        )

    if paths is not None:
        for idx, path in enumerate(paths):  # every file is checked before any is counted
            try:
                info = os.stat(path)
            except FileNotFoundError:
                given_str = not _is_path(inputs) and isinstance(inputs[idx], str)
                hint = " (a list of str is read as file paths: pass documents as iter(texts))" if given_str else ""
                raise FileNotFoundError(errno.ENOENT, "No such file or directory" + hint, path) from None
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        total = sum(os.path.getsize(path) for path in paths if os.path.isfile(path))
        progress = _Progress(show_progress, total)
        try:
            if native_id is None:
                return _fallback_count_files(paths, compiled, tokens, errors, progress)
            from trainfast import _core

            counter = _core.BpePretokenCounter(native_id, tokens, _ERRORS.index(errors), threads)
            for path in paths:
                # Bytes, so a file name that is not valid UTF-8 (surrogate-escaped in str) opens too.
                counter.add_file(os.fsencode(path), progress.update_in_input if show_progress else None)
                progress.finish_input(os.path.getsize(path) if os.path.isfile(path) else 0)
            return finish(counter)
        finally:
            progress.close()

    progress = _Progress(show_progress, None)
    try:
        if native_id is None:
            return _fallback_count_documents(inputs, compiled, tokens, errors, progress)
        from trainfast import _core

        counter = _core.BpePretokenCounter(native_id, tokens, _ERRORS.index(errors), threads)
        batch: list[str | bytes] = []
        batch_bytes = 0
        first_index = 0
        callback = progress.update_in_input if show_progress else None
        for idx, doc in enumerate(inputs):
            if not isinstance(doc, (str, bytes)):
                hint = " (paths and documents cannot be mixed)" if isinstance(doc, os.PathLike) else ""
                raise TypeError(f"inputs[{idx}] must be str or bytes (got {type(doc).__name__}){hint}")
            batch.append(doc)
            # At most 4 UTF-8 bytes per code point: bounds a batch's text without encoding it here.
            batch_bytes += len(doc) if isinstance(doc, bytes) or doc.isascii() else 4 * len(doc)
            if batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_DOCS:
                progress.finish_input(counter.add_documents(batch, first_index, callback))
                first_index, batch, batch_bytes = idx + 1, [], 0
        if batch:
            progress.finish_input(counter.add_documents(batch, first_index, callback))
        return finish(counter)
    finally:
        progress.close()


def _count_text(counts: Counter, text: str, compiled: Any, tokens: Sequence[str], name: str) -> None:
    # Up front, as the native path encodes every document first: a pattern that skips the surrogate
    # would otherwise count the document.
    _check_encodable(text, name)
    parts = _special_splitter(tokens).split(text) if tokens else [text]
    for idx, part in enumerate(parts):
        if idx % 2 == 0:  # odd parts are the special tokens: not counted
            # finditer, not findall: no list of every piece. findall's item is group 1 when there is one.
            group = 1 if compiled.groups == 1 else 0
            counts.update((match.group(group) or "").encode("utf-8") for match in compiled.finditer(part))


def _decode_error(name: str, error: UnicodeDecodeError, offset: int) -> ValueError:
    """The native path's message for invalid UTF-8 at byte ``offset`` of ``name``."""
    return ValueError(
        f"{name}: invalid UTF-8 at byte offset {offset}: 'utf-8' codec can't decode byte "
        f"0x{error.object[error.start]:02x}: {error.reason} (pass errors='replace' or errors='ignore' to decode anyway)"
    )


def _decode(raw: bytes, errors: str, name: str) -> str:
    """Python text mode's decoding (universal newlines), with the native path's error message."""
    try:
        text = raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as error:
        raise _decode_error(name, error, error.start) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _fallback_count_files(paths, compiled, tokens, errors, progress) -> dict[bytes, int]:
    counts: Counter = Counter()
    for path in paths:
        with open(path, "rb") as handle:
            raw = handle.read()
        name = os.fsdecode(path)
        _count_text(counts, _decode(raw, errors, name), compiled, tokens, name)
        progress.finish_input(os.path.getsize(path) if os.path.isfile(path) else 0)
    return dict(counts)


def _fallback_count_documents(inputs, compiled, tokens, errors, progress) -> dict[bytes, int]:
    counts: Counter = Counter()
    for idx, doc in enumerate(inputs):
        if isinstance(doc, bytes):
            text = _decode(doc, errors, f"inputs[{idx}]")
        elif isinstance(doc, str):
            text = doc
        else:
            raise TypeError(f"inputs[{idx}] must be str or bytes (got {type(doc).__name__})")
        _count_text(counts, text, compiled, tokens, f"inputs[{idx}]")
        progress.finish_input(len(text.encode("utf-8", "surrogatepass")))  # as the native counter reports
    return dict(counts)
