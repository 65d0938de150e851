"""Exports of a byte-level BPE tokenizer for other libraries.

``to_hf_tokenizer_json`` writes a ``tokenizer.json`` that HF ``tokenizers.Tokenizer.from_file`` (and
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``) loads: BPE model, ByteLevel pre-tokenizer
without prefix space (GPT-2 regex) and ByteLevel decoder, special tokens as added tokens.

``to_tiktoken`` builds tiktoken's ``mergeable_ranks`` (token bytes -> rank, where rank == id) and a
``tiktoken.Encoding``. tiktoken merges the adjacent pair whose *concatenation* has the lowest rank,
where we merge by pair rank; the two agree when every token's merge is the only way tiktoken can build
it during encoding, as for GPT-2's and for trained vocabularies in practice. ``to_tiktoken`` checks
what can be checked up front (ids in merge order, every token reachable) and raises otherwise.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainfast._util import write_atomic
from trainfast.bpe.io import bytes_to_unicode
from trainfast.bpe.pretokenize import _check_special_tokens
from trainfast.bpe.tokenizer import _check_merges, _check_vocab

__all__ = ["to_hf_tokenizer_json", "to_tiktoken"]


def _checked(vocab: Any, merges: Any, special_tokens: Any) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]],
                                                                    list[str], dict[bytes, int]]:
    special_tokens = _check_special_tokens(special_tokens, unique=True)
    vocab = _check_vocab(vocab, special_tokens)
    token_to_id = {token: token_id for token_id, token in vocab.items()}  # as Tokenizer: the last id wins
    merges = _check_merges(merges, token_to_id)
    for idx, token in enumerate(special_tokens):
        if token.encode("utf-8") not in token_to_id:
            raise ValueError(f"special_tokens[{idx}] = {token!r} is not in vocab (add it to vocab first, e.g. "
                             f"use Tokenizer(...).vocab, which appends missing special tokens)")
    return vocab, merges, special_tokens, token_to_id


def _pattern_regex(pattern: str) -> str | None:
    """None for GPT-2's pattern (ByteLevel's built-in regex), else the regex string."""
    from trainfast.bpe.pretokenize import _ALIASES, PATTERNS

    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (got {type(pattern).__name__})")
    name = _ALIASES.get(pattern, pattern)
    if name == "gpt2" or pattern == PATTERNS["gpt2"]:
        return None
    if name in PATTERNS:
        return PATTERNS[name]
    if name.isidentifier():
        raise ValueError(f"pattern must be one of {', '.join(map(repr, PATTERNS))} or a regular expression "
                         f"(got unknown pattern name {pattern!r})")
    try:  # a broken regex must not reach a written tokenizer file
        import regex
    except ImportError:  # pragma: no cover - regex is a test dependency
        return pattern
    try:
        regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"pattern is not a valid regular expression ({error}): {pattern!r}") from None
    return pattern


def _text_of(token: bytes, table: dict[int, str]) -> str:
    """GPT-2's printable spelling of token bytes."""
    return "".join(table[b] for b in token)


_POSSESSIVE_COUNT = re.compile(r"(\{\d+(?:,\d*)?\})\+")


def _onig_regex(regex: str) -> str:
    """The regex for HF's Oniguruma, which reads ``X{m,n}+`` as ``(X{m,n})+``, not possessive."""
    from trainfast.bpe.pretokenize import PATTERNS

    if regex == PATTERNS["cl100k"]:  # nothing follows \p{N}{1,3}+ in its alternative: greedy is the same
        return regex.replace(r"\p{N}{1,3}+", r"\p{N}{1,3}")
    if _POSSESSIVE_COUNT.search(regex):
        raise ValueError(f"pattern has a possessive counted repeat ('{{m,n}}+'), which HF tokenizers' Oniguruma "
                         f"reads differently; write it with an atomic group '(?>...)' instead: {regex!r}")
    return regex


def to_hf_tokenizer_json(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Sequence[str] | None,
    path: str | os.PathLike[str],
    *,
    pattern: str = "gpt2",
) -> Path:
    """Writes an HF ``tokenizers`` ``tokenizer.json`` to ``path`` (atomically) and returns the path.

    Args:
        vocab: ``{id: token bytes}`` (all 256 single bytes, distinct tokens; see special_tokens).
        merges: ``(left, right)`` pairs in creation order.
        special_tokens: strings that must be in ``vocab`` (as UTF-8 bytes); written as added special
            tokens, matched before pre-tokenization, longest first. Refused (``ValueError``) where
            tokenizer.json cannot hold one: a special token that is also an ordinary token, one that
            a merge makes or uses under another spelling, or one HF's ByteLevel decoder would turn
            into other bytes (spelled only with GPT-2 byte-map characters, some not ASCII: ``"é"``).
        path: the output file.
        pattern: ``"gpt2"`` (ByteLevel's own regex), ``"cl100k"``, ``"o200k"`` or a regex string (a
            ``Split`` pre-tokenizer before a regex-less ByteLevel).
    """
    vocab, merges, special_tokens, token_to_id = _checked(vocab, merges, special_tokens)
    regex = _pattern_regex(pattern)
    if regex is not None:
        regex = _onig_regex(regex)
    table = bytes_to_unicode()
    mapped_chars = set(table.values())
    in_merges = {token for left, right in merges for token in (left, right, left + right)}
    special_of = {token.encode("utf-8"): token for token in special_tokens}
    repeated = {t for t, n in Counter(vocab.values()).items() if n > 1} if len(token_to_id) < len(vocab) else set()
    for idx, token in enumerate(special_tokens):
        token_bytes = token.encode("utf-8")
        if token_bytes in repeated:
            raise ValueError(f"special_tokens[{idx}] = {token!r} is also an ordinary vocab token (ids "
                             f"{sorted(i for i, t in vocab.items() if t == token_bytes)}); tokenizer.json holds "
                             f"one id per token")
        # HF's ByteLevel decoder maps a token's characters back to bytes when it can read all of them
        # that way, which changes a special token spelled only with byte-map characters, some non-ASCII.
        if not token.isascii() and all(char in mapped_chars for char in token):
            raise ValueError(f"special_tokens[{idx}] = {token!r} would decode as other bytes in HF tokenizers "
                             f"(its ByteLevel decoder reads each character as a byte of GPT-2's byte map)")
        if token_bytes in in_merges and _text_of(token_bytes, table) != token:
            raise ValueError(f"special_tokens[{idx}] = {token!r} is also in a merge, spelled "
                             f"{_text_of(token_bytes, table)!r} there; tokenizer.json would need it under two "
                             f"spellings")

    def text(token: bytes) -> str:
        # Special tokens go by their own text, which HF's added tokens look up in the vocab.
        special = special_of.get(token)
        return special if special is not None else _text_of(token, table)

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex is None}
    if regex is None:
        pre_tokenizer: dict[str, Any] = byte_level
    else:
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_to_id[token.encode("utf-8")], "content": token, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for token in special_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text(token): token_id for token_id, token in sorted(vocab.items())},
            "merges": [f"{_text_of(left, table)} {_text_of(right, table)}" for left, right in merges],
        },
    }
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path {str(path)!r} is a directory (give the tokenizer.json file path)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(document, ensure_ascii=False))
    return path


def to_tiktoken(
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Sequence[str] | None = None,
    pattern: str = "gpt2",
    *,
    name: str = "trainfast_bpe",
) -> tuple[dict[bytes, int], Any]:
    """``(mergeable_ranks, tiktoken.Encoding)`` of a BPE tokenizer (ranks are the vocab ids).

    tiktoken needs: every non-special token is a single byte or the result of exactly one merge,
    merge results' ids increase with merge order (true of ``train_bpe`` output and GPT-2's files),
    and, where a special token is a prefix of another, tiktoken's own order of trying them must put
    the longer first (it does not match longest first; checked, ValueError otherwise).
    ``pattern`` is ``"gpt2"`` (tiktoken's published gpt2 regex), ``"cl100k"``, ``"o200k"`` or a regex.
    Needs the optional ``tiktoken`` package (``pip install trainfast[tiktoken]``).
    """
    try:
        import tiktoken
    except ImportError as error:
        raise ImportError("to_tiktoken needs the `tiktoken` package (pip install tiktoken)") from error

    vocab, merges, special_tokens, token_to_id = _checked(vocab, merges, special_tokens)
    special_ids = {token_to_id[token.encode("utf-8")] for token in special_tokens}
    merge_of: dict[bytes, int] = {}
    last_id = -1
    for idx, (left, right) in enumerate(merges):
        merged = left + right
        if merged in merge_of:
            raise ValueError(f"merges[{idx}] = ({left!r}, {right!r}) makes {merged!r} again (first made by "
                             f"merges[{merge_of[merged]}]); tiktoken needs one merge per token")
        merge_of[merged] = idx
        if token_to_id[merged] <= last_id:
            raise ValueError(f"merges[{idx}] makes id {token_to_id[merged]}, not above the previous merge's id "
                             f"{last_id}; tiktoken ranks tokens by id, so ids must follow merge order")
        last_id = token_to_id[merged]
    ranks: dict[bytes, int] = {}
    for token_id, token in vocab.items():
        if token_id in special_ids:
            continue
        if len(token) > 1 and token not in merge_of:
            raise ValueError(f"vocab[{token_id}] = {token!r} is neither a byte, a merge result nor a special token; "
                             f"tiktoken would merge into it where we never do")
        ranks[token] = token_id
    pat_str = _pattern_regex(pattern)
    if pat_str is None:
        from tiktoken_ext.openai_public import r50k_pat_str

        pat_str = r50k_pat_str
    encoding = tiktoken.Encoding(
        name,
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens={token: token_to_id[token.encode("utf-8")] for token in special_tokens},
    )
    # tiktoken tries special tokens in an order of its own, not longest first. Where one is a prefix
    # of another, the longer must win on its own text; then it wins everywhere (the tokens matching
    # at one position are all prefixes of each other).
    for special in special_tokens:
        if not any(other != special and special.startswith(other) for other in special_tokens):
            continue
        ids = encoding.encode(special, allowed_special="all")
        if ids != [token_to_id[special.encode("utf-8")]]:
            # Name the prefix tiktoken actually matched (with several prefixes, not necessarily the first listed).
            matched = encoding.decode_single_token_bytes(ids[0]).decode("utf-8")
            raise ValueError(f"special token {special!r} starts with special token {matched!r}, and tiktoken "
                             f"matches the shorter one there (its order, not longest first): its ids would "
                             f"differ from ours")
    return ranks, encoding
