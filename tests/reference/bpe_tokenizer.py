"""Pure-Python oracle of CS336's BPE ``Tokenizer`` (encode/decode), written from the semantics.

Special tokens split the text first (leftmost occurrence, longest token first); every other piece
is cut with the pre-tokenizer regex; each pre-token's bytes are merged by repeatedly joining the
leftmost adjacent pair with the lowest merge rank until no adjacent pair is a merge.
"""

from __future__ import annotations

import regex

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class ReferenceTokenizer:
    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: list[str] | None = None, pattern: str = GPT2_PATTERN):
        self.vocab = dict(vocab)
        self.special_tokens = list(special_tokens or [])
        for token in self.special_tokens:
            if token.encode() not in self.vocab.values():
                self.vocab[max(self.vocab) + 1] = token.encode()
        self.token_to_id = {token: idx for idx, token in self.vocab.items()}
        self.rank: dict[tuple[bytes, bytes], int] = {}
        for rank, pair in enumerate(merges):
            self.rank.setdefault(pair, rank)
        self.pattern = regex.compile(pattern)
        ordered = sorted(self.special_tokens, key=len, reverse=True)
        self.splitter = regex.compile("(" + "|".join(map(regex.escape, ordered)) + ")") if ordered else None

    def merge(self, piece: bytes) -> list[int]:
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            ranks = [self.rank.get((parts[i], parts[i + 1]), None) for i in range(len(parts) - 1)]
            candidates = [(r, i) for i, r in enumerate(ranks) if r is not None]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.token_to_id[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = self.splitter.split(text) if self.splitter else [text]
        for idx, piece in enumerate(pieces):
            if idx % 2 == 1:
                ids.append(self.token_to_id[piece.encode()])
                continue
            for pretoken in self.pattern.findall(piece):
                ids.extend(self.merge(pretoken.encode("utf-8")))
        return ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


def gpt2_ranks_from_fixtures(vocab_path, merges_path=None):
    """tiktoken-style mergeable ranks (token bytes -> id) of the CS336 GPT-2 vocab fixture, without
    the special token; for GPT-2, tiktoken's ranks are the vocab ids."""
    import json

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + shifted)
            shifted += 1
    char_to_byte = {c: b for b, c in byte_to_char.items()}
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    return {bytes(char_to_byte[c] for c in token): idx for token, idx in vocab.items() if token != "<|endoftext|>"}


def tiktoken_gpt2(vocab_path, pattern: str | None = None):
    """The equivalent of ``tiktoken.get_encoding("gpt2")`` built offline from the CS336 fixture
    (tiktoken's published gpt2 pattern string; its ranks need a download)."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    pattern = r50k_pat_str if pattern is None else pattern

    return tiktoken.Encoding(
        "gpt2_from_fixture",
        pat_str=pattern,
        mergeable_ranks=gpt2_ranks_from_fixtures(vocab_path),
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )
