"""BPE training with the exact semantics of Stanford CS336 assignment 1 ``train_bpe``.

Vocab id layout (what ``train_bpe`` returns): ids 0..255 are the 256 single bytes (id ``b`` is
``bytes([b])``), then one id per special token in the order given (256, 257, ...), then one id per
merge in creation order. The CS336 fixture vocab puts its special token at 0 instead; the set of
tokens is the same.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Union

from trainfast._util import Progress, check_bool, check_choice, check_int, resolve_num_threads
from trainfast.bpe.pretokenize import _check_special_tokens, _count

__all__ = ["train_bpe"]

_log = logging.getLogger("trainfast.bpe")

PathLike = Union[str, "os.PathLike[str]"]
Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]

_ERROR_MODES = ("strict", "replace", "ignore")


def train_bpe(
    input_path: PathLike | Sequence[PathLike] | Iterable[str | bytes],
    vocab_size: int,
    special_tokens: Sequence[str] | None = (),
    *,
    pattern: Any = "gpt2",
    num_threads: int | None = None,
    errors: str = "strict",
    show_progress: bool = True,
) -> tuple[Vocab, Merges]:
    """Trains a byte-level BPE tokenizer, equal to CS336's ``train_bpe``.

    Args:
        input_path: a text file, a list/tuple of files, or any other iterable of ``str``/``bytes``
            documents. Files are read like Python text mode (UTF-8, universal newlines).
        vocab_size: final vocabulary size (256 bytes + specials + merges); training stops earlier
            when no pair is left.
        special_tokens: strings split out of the text before pre-tokenization; never merged. They
            get ids 256, 257, ... in the order given, so a set (whose order varies) is refused.
        pattern: pre-tokenizer: ``"gpt2"`` (CS336), ``"cl100k"``, ``"o200k"``, a regex string or a
            compiled ``regex``/``re`` pattern.
        num_threads: pre-tokenizer threads (default $TRAINFAST_NUM_THREADS or all cores); the
            result does not depend on it.
        errors: invalid UTF-8 handling: ``"strict"`` (ValueError naming the byte offset),
            ``"replace"`` or ``"ignore"``.
        show_progress: tqdm bars on a terminal, ``logging`` (INFO) otherwise.

    The corpus may be any size (it is streamed); its distinct pre-tokens of 2 or more bytes must
    hold fewer than 2^31 - 1 bytes in all (ValueError beyond: the merge loop links them by 32-bit
    positions).

    Returns:
        ``(vocab, merges)``: ``vocab`` maps ids ``0..len-1`` to token bytes (layout in the module
        docstring); ``merges`` lists ``(left, right)`` byte pairs in creation order.

    >>> vocab, merges = train_bpe(iter(["low lower lowest<|endoftext|>low low"]), 262,
    ...                           ["<|endoftext|>"], show_progress=False)
    >>> merges
    [(b'o', b'w'), (b'l', b'ow'), (b' ', b'low'), (b' low', b'e'), (b's', b't')]
    >>> len(vocab), vocab[256], vocab[261]
    (262, b'<|endoftext|>', b'st')
    """
    special_tokens = _check_special_tokens(special_tokens, unique=True)
    vocab_size = _check_vocab_size(vocab_size, special_tokens)
    num_threads = resolve_num_threads(num_threads)
    check_choice(errors, "errors", _ERROR_MODES)
    word_counts = _count_words(input_path, pattern, special_tokens, num_threads, errors, show_progress)
    return _train(word_counts, vocab_size, special_tokens, show_progress)


def _count_words(input_path: Any, pattern: Any, special_tokens: list[str], num_threads: int, errors: str,
                 show_progress: bool) -> Any:
    """Pre-token counts: a native table for the named patterns (no dict of bytes), else a dict."""
    start = time.perf_counter()
    word_counts = _count(input_path, pattern, tuple(special_tokens), num_threads, errors, show_progress,
                         lambda counter: counter.finish_table())
    if show_progress:
        _log.info("bpe: %s unique pre-tokens in %.2f s", f"{len(word_counts):,}", time.perf_counter() - start)
    return word_counts


def _train_from_dict(
    word_counts: dict[bytes, int],
    vocab_size: int,
    special_tokens: Sequence[str] | None = (),
    *,
    show_progress: bool = True,
) -> tuple[Vocab, Merges]:
    """``train_bpe`` from pre-token counts (``{pre-token bytes: count}``, counts in [1, 2^63-1]); the
    public entry point is :func:`trainfast.bpe.train_from_counts`, which also takes WordCounts.

    Pair counts are 64-bit: a byte pair counted more than 2^63-1 times over all words (each
    occurrence weighted by its word's count) raises ValueError naming the pair.
    """
    if not isinstance(word_counts, dict):
        raise TypeError(f"word_counts must be a dict[bytes, int] (got {type(word_counts).__name__})")
    show_progress = check_bool(show_progress, "show_progress")  # as count_pretokens checks it for train_bpe
    special_tokens = _check_special_tokens(special_tokens, unique=True)
    vocab_size = _check_vocab_size(vocab_size, special_tokens)
    return _train(word_counts, vocab_size, special_tokens, show_progress)


def _train(word_counts: Any, vocab_size: int, special_tokens: list[str], show_progress: bool) -> tuple[Vocab, Merges]:
    """Merges over a dict[bytes, int] or a native table (which this empties)."""
    from trainfast import _core

    num_merges = min(vocab_size - 256 - len(special_tokens), 2**62)  # stops far earlier: no pair left
    for token in special_tokens:
        if len(token.encode("utf-8", "surrogatepass")) == 1:  # kept: CS336 makes the same vocab
            _log.warning("bpe: special token %r is one byte, so the vocab holds it twice (as byte token %d and "
                         "as a special token); Tokenizer takes such a vocab, but save() and the exporters, whose "
                         "files map each token to one id, refuse it", token, ord(token))
    start = time.perf_counter()
    with Progress(enabled=show_progress, total=num_merges, desc="bpe", unit=" merges", logger=_log,
                  leave=False) as progress:
        update = progress.update_to if show_progress else None
        if isinstance(word_counts, dict):
            merges = _core.bpe_train_merges(word_counts, num_merges, update)
        else:
            merges = _core.bpe_train_merges_table(word_counts, num_merges, update)
    if show_progress:
        _log.info("bpe: %d merges in %.2f s", len(merges), time.perf_counter() - start)

    vocab: Vocab = {b: bytes([b]) for b in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    for left, right in merges:
        vocab[len(vocab)] = left + right
    return vocab, merges


def _check_vocab_size(vocab_size: Any, special_tokens: list[str]) -> int:
    vocab_size = check_int(vocab_size, "vocab_size")
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be >= 256 + len(special_tokens) = {minimum} (got {vocab_size})"
        )
    return vocab_size

