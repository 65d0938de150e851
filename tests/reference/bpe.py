"""Readable BPE trainer with CS336 ``train_bpe`` semantics (the oracle for trainfast.bpe).

Pipeline: read like Python text mode -> split on special tokens -> GPT-2 regex pre-tokens ->
count them -> merge loop. The merge loop keeps pair counts, a pair -> words inverted index and a
max-heap with lazy invalidation, as in the seed document (so it stays usable on real corpora).

Vocab ids: 0..255 the single bytes, then the special tokens in the given order, then one id per
merge in creation order.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_text(path) -> str:
    """Python text mode: UTF-8, universal newlines."""
    with open(path, encoding="utf-8", newline=None) as f:
        return f.read()


def split_on_special_tokens(text: str, special_tokens: Iterable[str]) -> list[str]:
    """Pieces between special tokens; the longest special wins where one is a prefix of another."""
    specials = sorted(special_tokens, key=len, reverse=True)
    if not specials:
        return [text]
    return regex.split("|".join(regex.escape(token) for token in specials), text)


def count_pretokens(texts: Iterable[str], special_tokens: Iterable[str] = (), pattern: str = GPT2_PATTERN) -> Counter:
    """Counter of UTF-8 encoded pre-tokens over all texts (special tokens are not counted)."""
    special_tokens = list(special_tokens)
    counts: Counter = Counter()
    compiled = regex.compile(pattern)
    for text in texts:
        for piece in split_on_special_tokens(text, special_tokens):
            counts.update(match.encode("utf-8") for match in compiled.findall(piece))
    return counts


class _Descending:
    """Wraps bytes so that heapq (a min-heap) pops the lexicographically greatest first."""

    __slots__ = ("value",)

    def __init__(self, value: bytes):
        self.value = value

    def __lt__(self, other: _Descending) -> bool:
        return self.value > other.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Descending) and self.value == other.value


def train_from_counts(
    word_counts: dict[bytes, int], vocab_size: int, special_tokens: Iterable[str] = ()
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """BPE merges over pre-token counts: highest pair count first, ties to the greatest
    (left bytes, right bytes); merges applied left to right, non-overlapping, in every word."""
    special_tokens = list(special_tokens)
    vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    num_merges = max(0, vocab_size - len(vocab))

    token_bytes: list[bytes] = [bytes([i]) for i in range(256)]  # merge-space ids: 256 + merge index
    words: list[list[int]] = [list(word) for word in word_counts]
    counts: list[int] = list(word_counts.values())

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for word_idx, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += counts[word_idx]
            pair_words[pair].add(word_idx)

    heap: list = []

    def push(pair: tuple[int, int]) -> None:
        heapq.heappush(heap, (-pair_counts[pair], _Descending(token_bytes[pair[0]]),
                              _Descending(token_bytes[pair[1]]), pair))

    for pair, count in pair_counts.items():
        if count > 0:
            push(pair)

    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges:
        best = None
        while heap:
            neg_count, _, _, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) > 0 and pair_counts[pair] == -neg_count:
                best = pair
                break
        if best is None:
            break  # no pair left
        left, right = best
        new_id = len(token_bytes)
        token_bytes.append(token_bytes[left] + token_bytes[right])
        merges.append((token_bytes[left], token_bytes[right]))
        vocab[len(vocab)] = token_bytes[new_id]

        changed: set[tuple[int, int]] = set()
        for word_idx in pair_words.pop(best):
            word, count = words[word_idx], counts[word_idx]
            for pair in zip(word, word[1:]):
                pair_counts[pair] -= count
                changed.add(pair)
            merged: list[int] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            words[word_idx] = merged
            for pair in zip(merged, merged[1:]):
                pair_counts[pair] += count
                pair_words[pair].add(word_idx)
                changed.add(pair)
        for pair in changed:
            if pair_counts[pair] > 0 and pair != best:
                push(pair)
        del pair_counts[best]
    return vocab, merges


def train_bpe(
    input_path, vocab_size: int, special_tokens: Iterable[str] = (), pattern: str = GPT2_PATTERN
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """CS336 ``train_bpe`` on one path or a list of paths."""
    paths = [input_path] if not isinstance(input_path, (list, tuple)) else list(input_path)
    special_tokens = list(special_tokens)
    counts = count_pretokens((read_text(path) for path in paths), special_tokens, pattern)
    return train_from_counts(counts, vocab_size, special_tokens)
