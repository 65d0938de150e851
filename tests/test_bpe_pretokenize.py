"""Native BPE pre-tokenizer == `regex` (tests/reference/bpe_pretokenize.py), on generated and real text."""

from __future__ import annotations

import array
import inspect
import itertools
import lzma
import logging
import os
import random
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import regex
from reference import bpe_pretokenize as ref
from trainfast import _core
from trainfast.bpe import PATTERNS, count_pretokens, pretokenize

NAMES = ["gpt2", "cl100k", "o200k"]
NATIVE_ID = {"gpt2": 0, "cl100k": 1, "o200k": 2}
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"

# Characters where the patterns differ or where Python's notions differ from `regex`'s.
HARD = list(
    " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000"  # spaces & not
    "\u200b\u200c\u200d\u2060\ufeff\x00\x7f"  # format / control: "other"
    "\u0301\u0300\u0903\u20dd\u0e31"  # combining marks Mn, Mc, Me
    "abczSTDMLVERsdmtlvre\u017f\u212aK"  # contraction letters, long s, Kelvin sign
    "'\u2019\"`.,!?/-_<|>$#@"  # apostrophes, punctuation, cl100k/o200k trailing "/"
    "0179\u0660\u0669\u06f5\u00b2\u2167\u3007\u2460"  # Nd (Arabic-Indic), No, Nl
    "\u4e2d\u6587\u3042\u30fc\u02b0\u01c5\u1fbc\u00e9\u00c9\u0391\u03b1\u0430\u0410\u0915\u093f\u1780"  # Lo Lm Lt ...
    "\U0001f600\U0001f44d\U0001f3fb\u2764\ufe0f\U00010400\U00010428\U0001d400\ufffd"
)
SPECIALS = ["<|endoftext|>", "<|end|>", "<|", "\n\n", "ab", "a", "é", "\u3000x"]

hard_text = st.text(alphabet=st.one_of(st.sampled_from(HARD), st.characters()), max_size=60)
# Counting encodes documents as UTF-8, which lone surrogates do not have (a separate test covers them).
countable_text = st.text(alphabet=st.one_of(st.sampled_from(HARD), st.characters(exclude_categories=("Cs",))), max_size=60)
special_lists = st.lists(st.sampled_from(SPECIALS), max_size=3)

# Mostly ASCII and long: the GPT-2 and cl100k scanners decide 64 ASCII bytes at a time, and a
# non-ASCII character now and then moves where a window stops.
ASCII_HARD = list(" \t\n\r\x0b\x0c\x1c\x00'\".,!?/-_019azSDMTLVEsdmtlvre")
window_text = st.text(alphabet=st.sampled_from(ASCII_HARD * 10 + HARD), max_size=300)
# Long and mostly not ASCII: the windows also decide characters of other scripts (GPT-2: letters,
# digits and "other"; cl100k: letters; o200k: upper- and lower-case letters), up to one they do not
# take or one cut by the window's end.
script_text = st.text(alphabet=st.one_of(st.sampled_from(ASCII_HARD + HARD * 2), st.characters()), max_size=300)

# The fuzz profile (`make fuzz`) runs the main differential test on >= 100,000 strings.
many = settings(max_examples=100_000) if FUZZ else settings()


def _random_text(rng: random.Random, max_len: int = 80) -> str:
    pieces = []
    for _ in range(rng.randrange(max_len)):
        roll = rng.random()
        if roll < 0.75:
            pieces.append(rng.choice(HARD))
        elif roll < 0.85:
            pieces.append(rng.choice(["'s", "'LL", "'Ve", " 're", "\r\n", "  \n", "?!\n", ". \n/", " \u017ft"]))
        else:
            cp = rng.randrange(0x110000)
            pieces.append(chr(cp) if not 0xD800 <= cp < 0xE000 else "x")
    return "".join(pieces)


# ----------------------------------------------------------------------------- worked examples


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a   b", ["a", "  ", " b"]),
        ("a \n\nb", ["a", " \n", "\n", "b"]),
        ("hello\r\nworld\r\n", ["hello", "\r", "\n", "world", "\r\n"]),
        ("cafe\u0301", ["cafe", "\u0301"]),
        ("I'M", ["I", "'", "M"]),
        ("don't", ["don", "'t"]),
        ("a\u00a0b", ["a", "\u00a0", "b"]),
        ("x\x1cy", ["x", "\x1c", "y"]),
        ("", []),
    ],
)
def test_issue_examples_gpt2(text, expected):
    assert pretokenize(text) == expected
    assert ref.pretokenize(text) == expected


def test_pattern_strings_are_the_published_ones():
    assert PATTERNS == ref.PATTERNS
    try:
        from tiktoken_ext import openai_public
    except ImportError:
        pytest.skip("tiktoken not installed")
    source = inspect.getsource(openai_public)
    assert ref.CL100K in source
    for part in ref.O200K_PARTS:
        assert part in source


def test_pattern_aliases_and_strings():
    text = "Hello WORLD's 12345 \u4e2d\u6587!!\n\n"
    assert pretokenize(text, pattern="cl100k_base") == pretokenize(text, pattern="cl100k")
    for name in NAMES:
        assert pretokenize(text, pattern=PATTERNS[name]) == pretokenize(text, pattern=name)
        assert pretokenize(text, pattern=regex.compile(PATTERNS[name])) == ref.pretokenize(text, name)


def test_compiled_named_pattern_takes_the_native_scanner():
    # regex's Pattern class lives in its _regex module: the test for it once never matched.
    resolve = sys.modules["trainfast.bpe.pretokenize"]._resolve_pattern
    for name in NAMES:
        assert resolve(regex.compile(PATTERNS[name]))[1] is None
        assert resolve(regex.compile(PATTERNS[name], regex.IGNORECASE))[1] is not None  # other flags: fallback


def test_custom_pattern_falls_back_to_regex(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"a b<|e|>\r\nb\xff")
    assert count_pretokens(path, pattern=r"\S+|\s+", special_tokens=["<|e|>"], errors="replace") == {
        b"a": 1, b" ": 1, b"b": 1, b"\n": 1, b"b\xef\xbf\xbd": 1}
    assert count_pretokens([b"x\r\ny"], pattern=r"\S+|\s+") == {b"x": 1, b"\n": 1, b"y": 1}
    text = "abc 123 def"
    assert pretokenize(text, pattern=r"\d+|\w+") == ["abc", "123", "def"]
    assert count_pretokens(iter([text]), pattern=r"\S+") == {b"abc": 1, b"123": 1, b"def": 1}
    assert pretokenize("x<|e|>y z", pattern=r"\S", special_tokens=["<|e|>"]) == ["x", "<|e|>", "y", "z"]


# ----------------------------------------------------------------------------- differential: strings


@pytest.mark.parametrize("name", NAMES)
@many
@given(text=hard_text)
def test_pretokenize_equals_regex(name, text):
    assert pretokenize(text, pattern=name) == ref.pretokenize(text, name)


@pytest.mark.parametrize("name", NAMES)
@many
@given(text=window_text)
def test_pretokenize_equals_regex_on_ascii_windows(name, text):
    assert pretokenize(text, pattern=name) == ref.pretokenize(text, name)


@pytest.mark.parametrize("name", NAMES)
@many
@given(text=script_text)
def test_pretokenize_equals_regex_on_script_windows(name, text):
    assert pretokenize(text, pattern=name) == ref.pretokenize(text, name)


# Letters of other scripts next to what the window rules look at (a contraction's apostrophe and
# letters, a case change, a digit, a newline, "other" before a word), at every offset across a
# window's end: the long s after an apostrophe is a contraction for cl100k and o200k.
LETTER_EDGES = [
    "'\u017ft", "'\u017f", "x'\u017fll", "\u00c9'S", "\u00e9'Ve", "\u0430\u0410\u0430'\u0434",
    "\u01c5a\u01c5", "\u00c9T\u00c9\u00e9t\u00e9", "9\u00e9", "\n\u00e9", "?\u00e9", " ?\u00e9", "''\u00e9",
    "\u0391\u03b1\u0391\u03b1", "\u4e2d\u6587A\u0430", "\u00e9\u0301\u00e9", "\u00e9\u02b0\u00c9", "\u00e9 \u00e9\u00a0\u00e9",
    "\u00c9\u0660\u00e9", "a\u00e9/\n\u00e9", "\u00e9\r\n \u00e9", "\u00e9\u2019s",
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("piece", LETTER_EDGES)
def test_pretokenize_letters_of_other_scripts_across_windows(name, piece):
    for offset in range(70):
        text = "ab " * (offset // 3) + "c" * (offset % 3) + piece + " \u00e9\u00e9 " * 10
        assert pretokenize(text, pattern=name) == ref.pretokenize(text, name), (offset, text)


@pytest.mark.parametrize("name", NAMES)
@given(text=hard_text, specials=special_lists)
def test_special_tokens_equal_regex_split(name, text, specials):
    got = pretokenize(text, pattern=name, special_tokens=specials)
    assert got == ref.pretokenize(text, name, specials)
    assert "".join(got) == text


@pytest.mark.parametrize("name", NAMES)
def test_seeded_random_strings(name):
    rng = random.Random(1234 + NATIVE_ID[name])
    for _ in range(3000 if not FUZZ else 100_000):
        text = _random_text(rng)
        assert pretokenize(text, pattern=name) == ref.pretokenize(text, name), repr(text)


# Mostly ASCII (the GPT-2 scanner's 64-byte-window path), long enough to cross several windows,
# with runs of one class longer than a window and an occasional non-ASCII character.
ASCII_PIECES = list(" \t\n\r\x0b\x0c\x1c\x1f\x00\x7f'\".,!?-_/09aeslmdtrvLMSDTX") + [
    "'s", "'ll", "'ve", "'re", "'d", "'m", "'t", "''s", " 's", "\n's", "'LL", "  ", "   ", "\n\n", " \n",
    "a" * 70, " " * 70, "." * 70, "1" * 70, "\u00a0", "\u3000", "\u0085", "\u00e9", "\u0301", "\u2019",
]


@pytest.mark.parametrize("name", NAMES)
def test_seeded_ascii_windows(name):
    rng = random.Random(4321 + NATIVE_ID[name])
    docs = []
    for _ in range(1500 if not FUZZ else 50_000):
        text = "".join(rng.choice(ASCII_PIECES) if rng.random() < 0.3 else rng.choice(ASCII_PIECES[:40])
                       for _ in range(rng.randrange(1, 260)))
        assert pretokenize(text, pattern=name) == ref.pretokenize(text, name), repr(text)
        docs.append(text)
    expected = ref.count_pretokens(docs, name, [])
    for num_threads in (1, 2, 7):
        counter = _core.BpePretokenCounter(NATIVE_ID[name], [], 0, num_threads, chunk_bytes=97)
        counter.add_documents(docs)
        got = counter.finish()
        assert got == expected and list(got) == list(expected)
    counter = _core.BpePretokenCounter(NATIVE_ID[name], [], 0, 2, chunk_bytes=97)
    counter.add_documents(docs)
    data, offsets, counts = counter.finish_arrays()
    assert data.dtype == "uint8" and offsets.dtype == "uint64" and counts.dtype == "int64"
    assert len(offsets) == len(counts) + 1 and offsets[-1] == len(data)
    keys = [data[offsets[k]:offsets[k + 1]].tobytes() for k in range(len(counts))]
    assert dict(zip(keys, counts.tolist())) == expected and keys == list(expected)


@pytest.mark.parametrize("name", NAMES)
def test_lone_surrogates_in_str(name):
    text = "ab\ud800cd \udfff 1\ud83d"
    assert pretokenize(text, pattern=name) == ref.pretokenize(text, name)
    ends = _core.bpe_pretokenize_ends(text, NATIVE_ID[name])
    assert ends.tolist() == [m.end() for m in regex.finditer(PATTERNS[name], text)]


# Strs are encoded as UTF-8 natively (in blocks of 2^20 code points), not by Python.
ENCODE_BLOCK = 1 << 20


@pytest.mark.parametrize("wide", ["\xe9", "\u4e2d", "\U0001f600"])  # Python stores 1, 2, 4 bytes per code point
def test_str_encoding_across_blocks(wide):
    rng = random.Random(7)
    alphabet = ["a", " ", "\n", "'s", "7", "\xa0", "\xff", wide, "\u0301", "\u3000", "\U00010400"]
    alphabet = [c for c in alphabet if max(map(ord, c)) <= ord(wide)]
    text = "".join(rng.choice(alphabet) for _ in range(2 * ENCODE_BLOCK + 5000))
    text = text[: ENCODE_BLOCK - 1] + wide + wide + text[ENCODE_BLOCK + 1 :]  # wide code points at the cut
    pieces = pretokenize(text)
    assert "".join(pieces) == text
    ends = _core.bpe_pretokenize_ends(text, 0)
    assert ends.tolist() == list(itertools.accumulate(map(len, pieces)))
    # The bytes path reads UTF-8 as given: equal counts, order included, mean equal encodings.
    from_str = count_pretokens(iter([text]), num_threads=2)
    from_bytes = count_pretokens(iter([text.encode()]), num_threads=2)
    assert list(from_str.items()) == list(from_bytes.items())


def test_many_short_documents_of_every_width_any_thread_count():
    # Many small strs share the native encoder's tasks (about 2^20 code points each) and buffer.
    rng = random.Random(11)
    words = ["a", " b", "", "\xe9", " \xff", "\u4e2d", " \u3000", "\U0001f600", "\n", "'s"]
    docs = ["".join(rng.choice(words) for _ in range(rng.randrange(0, 12))) for _ in range(200_000)]
    expected = list(count_pretokens(iter([d.encode() for d in docs]), num_threads=1).items())
    for num_threads in (1, 2, 3):
        assert list(count_pretokens(iter(docs), num_threads=num_threads).items()) == expected


def test_every_code_point_encodes_like_python():
    # Bytes documents get universal newlines, so "\r" is left out.
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and c != 0x0D)
    from_str = count_pretokens(iter([text]), num_threads=2)
    assert list(from_str.items()) == list(count_pretokens(iter([text.encode()]), num_threads=2).items())


def test_lone_surrogate_index_across_blocks():
    text = "a" * ENCODE_BLOCK + "\u4e2d\udc00" + "b\ud800"
    with pytest.raises(ValueError, match=rf"inputs\[2\] contains a lone surrogate \(at index {ENCODE_BLOCK + 1}\)"):
        count_pretokens(iter(["x", b"y", text]))
    # Pre-tokenizing keeps them (Python's "surrogatepass" form inside, the str's own code points out).
    assert pretokenize(text) == ref.pretokenize(text, "gpt2")


def test_strs_are_left_as_they_were():
    # Python would cache a UTF-8 copy inside a non-ASCII str for as long as the str lives.
    text = "na\xefve \u4e2d\u6587 " * 1000
    size_before = sys.getsizeof(text)
    pretokenize(text)
    _core.bpe_pretokenize_ends(text, 0)
    count_pretokens(iter([text]))
    assert sys.getsizeof(text) == size_before


def test_longest_special_token_wins():
    assert pretokenize("a<|end|>b", special_tokens=["<|", "<|end|>"]) == ["a", "<|end|>", "b"]
    assert pretokenize("a<|x", special_tokens=["<|", "<|end|>"]) == ["a", "<|", "x"]
    assert pretokenize("aaa", special_tokens=["aa", "a"]) == ["aa", "a"]
    assert count_pretokens(iter(["x<|endoftext|>y<|endoftext|>x"]), special_tokens=["<|endoftext|>"]) == {b"x": 2, b"y": 1}
    assert pretokenize("ab", special_tokens=[]) == ["ab"]


# ----------------------------------------------------------------------------- counting, split rule


@pytest.mark.parametrize("name", NAMES)
@given(docs=st.lists(countable_text, max_size=4), specials=special_lists, num_threads=st.sampled_from([1, 2, 7]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_count_every_safe_split_point(name, docs, specials, num_threads):
    # chunk_bytes=1 cuts the text at every point the split rule accepts: the proof under test.
    counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, num_threads, chunk_bytes=1)
    counter.add_documents(docs)
    assert counter.finish() == ref.count_pretokens(docs, name, specials)


# Many special tokens over a few characters: they share prefixes, overlap and contain one another,
# which the matcher's byte trie (leftmost occurrence, then the longest token there) must get right.
prefix_sharing_specials = st.lists(st.text(alphabet="ab<|é", min_size=1, max_size=6), min_size=1, max_size=40)


@given(text=st.text(alphabet="ab<|é x\n", max_size=200), specials=prefix_sharing_specials,
       num_threads=st.sampled_from([1, 2, 7]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_many_special_tokens_sharing_prefixes(text, specials, num_threads):
    assert pretokenize(text, special_tokens=specials) == ref.pretokenize(text, "gpt2", specials)
    counter = _core.BpePretokenCounter(NATIVE_ID["gpt2"], list(dict.fromkeys(specials)), 0, num_threads, chunk_bytes=1)
    counter.add_documents([text])
    assert counter.finish() == ref.count_pretokens([text], "gpt2", specials)


# Tokens longer than the matcher's kLongToken (64 bytes) go through its reverse automaton and the
# finder's stretches: tokens of one repeated unit with different tails, in text made of their
# prefixes (long near misses), whole occurrences and overlaps.
@st.composite
def long_special_cases(draw):
    # A space in the unit makes cuts inside an occurrence that only the special tokens forbid.
    unit = draw(st.text(alphabet="ab< é", min_size=1, max_size=3))
    specials = []
    for k in range(draw(st.integers(1, 4))):
        length = draw(st.integers(65 if k == 0 else 1, 160))
        specials.append((unit * length)[:length] + draw(st.text(alphabet="ab<\n", max_size=3)))
    token_prefix = st.sampled_from(specials).flatmap(lambda token: st.integers(0, len(token)).map(lambda k: token[:k]))
    pieces = st.one_of(token_prefix, st.sampled_from(specials), st.text(alphabet="ab<é \n", max_size=5))
    return "".join(draw(st.lists(pieces, max_size=12))), specials


@given(case=long_special_cases(), num_threads=st.sampled_from([1, 2, 7]), block_bytes=st.sampled_from([16, 100, 1 << 20]))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_long_special_tokens_among_near_misses(special_token_search, tmp_path, case, num_threads, block_bytes):
    text, specials = case
    assert pretokenize(text, special_tokens=specials) == ref.pretokenize(text, "gpt2", specials)
    expected = ref.count_pretokens([text], "gpt2", specials)
    # chunk_bytes=1: a cut is tried at every point, and occurrences over it are skipped whole.
    counter = _core.BpePretokenCounter(NATIVE_ID["gpt2"], list(dict.fromkeys(specials)), 0, num_threads, chunk_bytes=1)
    counter.add_documents([text])
    assert counter.finish() == expected
    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode())
    counter = _core.BpePretokenCounter(NATIVE_ID["gpt2"], list(dict.fromkeys(specials)), 0, num_threads,
                                       chunk_bytes=1, block_bytes=block_bytes)
    counter.add_file(str(path))
    assert counter.finish() == expected


@pytest.mark.parametrize("name", NAMES)
def test_long_special_tokens_over_many_stretches(special_token_search, name):
    # Past the finder's 64 KiB stretches: occurrences and near misses across their ends.
    rng = random.Random(7 + NATIVE_ID[name])
    specials = ["a" * 100 + "b", "a" * 70 + "c", "ab", "<" + "x" * 300 + ">", "y " * 40]
    pieces = specials + ["a" * 99, "a" * 150, "x" * 299, "<" + "x" * 299, "y " * 39, "y", " ", "\n", "é"]
    text = "".join(rng.choice(pieces) for _ in range(12_000))
    assert pretokenize(text, pattern=name, special_tokens=specials) == ref.pretokenize(text, name, specials)
    expected = ref.count_pretokens([text], name, specials)
    for num_threads, chunk_bytes in [(1, 1 << 20), (2, 1000), (7, 1)]:
        counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, num_threads, chunk_bytes=chunk_bytes)
        counter.add_documents([text])
        assert counter.finish() == expected


@pytest.mark.parametrize("name", NAMES)
def test_text_densely_covered_by_special_tokens(special_token_search, tmp_path, name):
    # Every point the pattern would cut at lies inside an occurrence of "a " or "a a", beside a long
    # token: the cuts skip occurrences through a cover kept as they move, not one reach per point.
    specials = ["a ", "a a", "<" + "x" * 100 + ">"]
    text = ("a " * 300 + "b\n" + "<" + "x" * 99 + "a " * 7) * 60
    expected = ref.count_pretokens([text], name, specials)
    for num_threads, chunk_bytes in [(1, 1), (2, 1000), (7, 1 << 20)]:
        counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, num_threads, chunk_bytes=chunk_bytes)
        counter.add_documents([text])
        assert counter.finish() == expected
    path = tmp_path / "doc.txt"
    path.write_text(text)
    counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, 2, chunk_bytes=1, block_bytes=500)
    counter.add_file(str(path))
    assert counter.finish() == expected


@pytest.mark.parametrize("errors", ["replace", "ignore"])
def test_file_blocks_cut_near_invalid_bytes_with_a_long_special_token(tmp_path, errors):
    # A block's end is moved past windows (a special token's reach each side) holding invalid
    # bytes or "\r"; it may skip safe points there, never take an unsafe one.
    specials = ["Q" * 300, "a a", "\ufffd" * 3]
    data = (b"a " * 200 + b"\xff" + b"QQ" * 80 + b"\r\n" + "\ufffd\ufffd".encode() + b"\xc3") * 300
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    expected = ref.count_pretokens([ref.read_text(path, errors)], "gpt2", specials)
    for block_bytes in (16, 1000, 1 << 20):
        counter = _core.BpePretokenCounter(0, specials, ["strict", "replace", "ignore"].index(errors), 2,
                                           chunk_bytes=1, block_bytes=block_bytes)
        counter.add_file(str(path))
        assert counter.finish() == expected


@pytest.mark.parametrize("name", NAMES)
def test_count_every_safe_split_point_seeded(name):
    rng = random.Random(99 + NATIVE_ID[name])
    docs = [_random_text(rng, 400) for _ in range(300)]
    for specials in ([], ["<|", "\n\n", "a"]):
        counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, 2, chunk_bytes=1)
        counter.add_documents(docs)
        assert counter.finish() == ref.count_pretokens(docs, name, specials)


@pytest.mark.parametrize("errors", ["strict", "replace", "ignore"])
@given(
    parts=st.lists(
        st.one_of(
            st.sampled_from([b"\r", b"\n", b"\r\n", b" ", b"<|e|>", b"\xe2\x82", b"\xff", b"\xed\xa0\x80", b"\xf0\x9f"]),
            st.text(alphabet=st.sampled_from(HARD), max_size=8).map(lambda s: s.encode("utf-8")),
        ),
        max_size=30,
    ),
    block_bytes=st.sampled_from([16, 17, 64, 1 << 20]),
)
def test_file_decoding_like_text_mode(tmp_path_factory, errors, parts, block_bytes):
    data = b"".join(parts)
    path = tmp_path_factory.mktemp("decode") / "doc.txt"
    path.write_bytes(data)
    counter = _core.BpePretokenCounter(0, ["<|e|>"], ["strict", "replace", "ignore"].index(errors), 2,
                                       chunk_bytes=1, block_bytes=block_bytes)
    try:
        expected_text = ref.read_text(path, errors)
    except UnicodeDecodeError as error:
        with pytest.raises(ValueError, match=f"byte offset {error.start}:"):
            counter.add_file(str(path))
        return
    counter.add_file(str(path))
    expected = ref.count_pretokens([expected_text], "gpt2", ["<|e|>"])
    assert counter.finish() == expected
    # bytes documents are decoded the same way
    assert count_pretokens([data], special_tokens=["<|e|>"], errors=errors) == expected


def test_invalid_utf8_names_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world\n" * 1000 + b"caf\xe9 ok")
    with pytest.raises(ValueError, match=r"bad\.txt: invalid UTF-8 at byte offset 12003"):
        count_pretokens(path)
    assert count_pretokens(path, errors="replace")[b"\xef\xbf\xbd"] == 1
    assert count_pretokens(path, errors="ignore")[b" ok"] == 1
    with pytest.raises(ValueError, match=r"inputs\[1\]: invalid UTF-8 at byte offset 2"):
        count_pretokens([b"ok", b"ab\x80"])


@pytest.mark.parametrize("pattern", ["gpt2", r"\w+|\W+", r"\w+"])
def test_decode_errors_name_the_input_on_both_paths(tmp_path, pattern):
    # A custom pattern runs the Python fallback: its errors name the input and the offset in it too.
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("hello")
    bad.write_bytes(b"ab\xffab")
    with pytest.raises(ValueError, match=r"bad\.txt: invalid UTF-8 at byte offset 2: .* byte 0xff"):
        count_pretokens([good, bad], pattern=pattern)
    with pytest.raises(ValueError, match=r"inputs\[2\]: invalid UTF-8 at byte offset 1"):
        count_pretokens(iter([b"ok", b"fine", b"x\xff"]), pattern=pattern)
    with pytest.raises(ValueError, match=r"inputs\[1\] contains a lone surrogate \(at index 8\)"):
        count_pretokens(iter(["ok", "abc def \ud800"]), pattern=pattern)
    assert count_pretokens([bad], pattern=pattern, errors="ignore") == count_pretokens([b"abab"], pattern=pattern)


def _utf8_truth(data: bytes) -> tuple:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return (False,)
    return (True, data.count(b"\r"), data.count(b"\r\n"))


def _check_scan_utf8(data: bytes) -> None:
    expected = _utf8_truth(data)
    for simd in (True, False):
        got = _core._scan_utf8(data, simd)
        assert (got if expected[0] else got[:1]) == expected, (simd, data)


# Where the SIMD check's neighbours cross a 16-byte lane, a 32-byte vector or a 64-byte block.
BORDERS = [0, 1, 13, 14, 15, 16, 29, 30, 31, 32, 33, 61, 62, 63, 64, 65, 95, 126, 127]


def test_scan_utf8_every_byte_pair_at_block_borders():
    # Every error of the SIMD check shows in a pair of bytes or in a lead 2-3 bytes back (next test).
    for pair in itertools.product(range(256), repeat=2):
        at = BORDERS[(pair[0] * 7 + pair[1]) % len(BORDERS)]
        after = b"" if pair[1] % 3 == 0 else b"y" * (pair[0] % 70)
        _check_scan_utf8(b"x" * at + bytes(pair) + after)


def test_scan_utf8_three_and_four_byte_sequences_at_block_borders():
    leads = [0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
    seconds = [0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xE4]
    for lead, second, third, fourth in itertools.product(leads, seconds, [0x41, 0x80, 0xBF, 0xC3], [None, 0x0D, 0x80, 0xBF]):
        seq = bytes([lead, second, third] + ([] if fourth is None else [fourth]))
        for at in BORDERS[::3]:
            _check_scan_utf8(b"q" * at + seq + b"\n" + b"z" * (at % 5))


def test_scan_utf8_cut_sequences_and_crlf_at_every_offset():
    # A "\r\n" or a sequence split by a block border, and input ending right after a lead byte.
    for at in range(200):
        for piece in [b"\r\n", b"\r", b"\r\r\n", b"\xc3", b"\xc3\xa9", b"\xe4\xb8", b"\xe4\xb8\xad", b"\xf0\x9f\x98"]:
            _check_scan_utf8(b"x" * at + piece)
            _check_scan_utf8("\u00e9".encode() * (at // 2) + b"x" * (at % 2) + piece + b"\n")


UTF8_PIECES = [b"a", b"\r", b"\n", b"\r\n", b" ", "é".encode(), "中".encode(), "😀".encode(),
               b"\x80", b"\xbf", b"\xff", b"\xc0\xaf", b"\xe4\xb8", b"\xf0\x9f\x98", b"\xed\xa0\x80",
               b"\xf4\x90\x80\x80", b"\xf4\x8f\xbf\xbf", b"plain ascii words, " * 3]


@many
@given(st.lists(st.sampled_from(UTF8_PIECES), max_size=60))
def test_scan_utf8_equals_python_decode(pieces):
    _check_scan_utf8(b"".join(pieces))


def test_scan_utf8_shared_corpus_and_its_damage(shared_dir):
    with lzma.open(shared_dir / "corpora" / "multilingual.txt.xz") as src:
        data = src.read(1 << 20)
    _check_scan_utf8(data)
    rng = random.Random(5)
    for _ in range(200):
        at = rng.randrange(len(data))
        damaged = data[:at] + bytes([rng.randrange(0x80, 0x100)]) + data[at + 1 :]
        _check_scan_utf8(damaged[max(0, at - rng.randrange(300)) : at + rng.randrange(300)])


def test_results_independent_of_threads_and_ordered_by_first_occurrence():
    rng = random.Random(7)
    docs = ["".join(rng.choice(["the ", "cat ", "sat\n", "on ", "mat. ", "\u4e2d\u6587 ", "12 "]) for _ in range(5000))
            for _ in range(20)]
    results = [count_pretokens(iter(docs), num_threads=n) for n in (1, 2, 7)]
    expected = ref.count_pretokens(docs)
    for got in results:
        assert got == expected and list(got) == list(expected)


def test_many_unique_pretokens_ordered_for_any_thread_count():
    # Enough unique pre-tokens that the final merge in first-occurrence order is split among threads;
    # some longer than a table slot holds inline (20-digit numbers); the tables are first sized
    # for one small document, so they grow to different sizes.
    rng = random.Random(11)
    words = [f" w{rng.randrange(400_000)}" if rng.random() < 0.9 else f" {rng.randrange(50_000):020d}"
             for _ in range(300_000)]
    docs = ["".join(words[k:k + 5000]) for k in range(0, len(words), 5000)]
    expected = ref.count_pretokens(docs)
    assert len(expected) > 200_000 and sum(len(key) > 16 for key in expected) > 10_000
    for num_threads in (1, 2, 3, 7):
        counter = _core.BpePretokenCounter(0, [], 0, num_threads, chunk_bytes=4096)
        counter.add_documents(docs[:1])
        counter.add_documents(docs[1:])
        got = counter.finish()
        assert got == expected and list(got) == list(expected)


def test_more_work_items_than_two_byte_ranks():
    # Past 65536 work items the merge orders entries with four-byte ranks instead of two.
    docs = [f" w{k} x{k % 7}" for k in range(70_000)]
    expected = ref.count_pretokens(docs)
    for num_threads in (2, 3):
        counter = _core.BpePretokenCounter(0, [], 0, num_threads, chunk_bytes=1)
        counter.add_documents(docs[:100])
        counter.add_documents(docs[100:])
        got = counter.finish()
        assert got == expected and list(got) == list(expected)


def test_count_inputs_forms(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one two\r\nthree")
    b.write_bytes(b"two\rtwo")
    both = count_pretokens([a, b])
    assert both == ref.count_pretokens(["one two\nthree", "two\ntwo"])
    assert count_pretokens(str(a)) == count_pretokens(a) == ref.count_pretokens(["one two\nthree"])
    assert count_pretokens(iter(["x y", b"x\r\ny"])) == {b"x": 2, b" y": 1, b"\n": 1, b"y": 1}
    assert count_pretokens([]) == {}
    assert count_pretokens([str(a), str(b)]) == both  # a list of str is a list of paths
    with pytest.raises(FileNotFoundError, match=r"read as file paths: pass documents as iter\(texts\)"):
        count_pretokens(["not a path, a document"])
    with pytest.raises(FileNotFoundError, match=r"directory: '.*missing.txt'$"):  # no hint for Path objects
        count_pretokens([a, tmp_path / "missing.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert count_pretokens(empty) == {}


# ----------------------------------------------------------------------------- full corpora


def _corpus_file(shared_dir: Path, tmp_path_factory, name: str) -> tuple[Path, str]:
    path = tmp_path_factory.getbasetemp() / f"{name}.txt"
    if not path.exists():
        with lzma.open(shared_dir / "corpora" / f"{name}.txt.xz") as src:
            path.write_bytes(src.read())
    return path, path.read_bytes().decode("utf-8")


CORPORA = ["austen", "kjv", "multilingual", pytest.param("gcide", marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("corpus", CORPORA)
@pytest.mark.parametrize("name", NAMES)
def test_full_corpus_equals_regex(shared_dir, tmp_path_factory, corpus, name):
    path, text = _corpus_file(shared_dir, tmp_path_factory, corpus)
    tokens = regex.findall(PATTERNS[name], text)
    ends = array.array("q", itertools.accumulate(map(len, tokens)))
    counts = Counter(map(str.encode, tokens))
    del tokens
    got_ends = _core.bpe_pretokenize_ends(text, NATIVE_ID[name])
    assert got_ends.tobytes() == ends.tobytes()
    pieces = pretokenize(text, pattern=name)  # past 8 MB: scanned in blocks cut at safe points
    assert array.array("q", itertools.accumulate(map(len, pieces))).tobytes() == ends.tobytes()
    del pieces
    for num_threads in (1, 2, 7):
        got = count_pretokens(path, pattern=name, num_threads=num_threads)
        assert got == counts and list(got) == list(counts)


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["austen", "multilingual"])
@pytest.mark.parametrize("name", NAMES)
def test_full_corpus_with_separators_small_chunks(shared_dir, tmp_path_factory, corpus, name):
    path, text = _corpus_file(shared_dir, tmp_path_factory, corpus)
    specials = ["<|endoftext|>"]
    expected = ref.count_pretokens([text], name, specials)
    counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, 0, 2, chunk_bytes=4096, block_bytes=1 << 20)
    counter.add_file(str(path))
    got = counter.finish()
    assert got == expected and list(got) == list(expected)


def test_cs336_fixtures(shared_dir):
    for fixture in ["corpus.en", "tinystories_sample.txt", "german.txt", "address.txt",
                    "special_token_double_newlines_non_whitespace.txt", "special_token_trailing_newlines.txt"]:
        path = shared_dir / "fixtures" / "cs336" / fixture
        text = ref.read_text(path)
        for name in NAMES:
            for specials in ([], ["<|endoftext|>"], ["<|endoftext|>", "<|endoftext|><|endoftext|>"]):
                assert pretokenize(text, pattern=name, special_tokens=specials) == ref.pretokenize(text, name, specials)
                assert count_pretokens(path, pattern=name, special_tokens=specials) == ref.count_pretokens(
                    [text], name, specials)


# ----------------------------------------------------------------------------- generated tables


def test_unicode_tables_are_up_to_date():
    from trainfast.bpe import _gen_unicode_tables as gen

    csrc = Path(__file__).resolve().parents[1] / "csrc" / "bpe"
    for filename, content in gen.generate().items():
        assert (csrc / filename).read_text() == content, f"{filename} is stale: rerun {gen.__file__}"
    assert "do not edit" in (csrc / "unicode_tables.h").read_text().splitlines()[0]


# ----------------------------------------------------------------------------- bad input


def test_bad_pattern():
    with pytest.raises(ValueError, match="unknown pattern name 'gpt3'"):
        pretokenize("x", pattern="gpt3")
    with pytest.raises(ValueError, match="unknown pattern name"):
        count_pretokens(iter(["x"]), pattern="r50k")
    with pytest.raises(TypeError, match="pattern must be a str"):
        pretokenize("x", pattern=3)
    with pytest.raises(ValueError, match="pattern is not a valid regular expression"):
        pretokenize("x", pattern="(unclosed")
    # findall gives tuples for two or more groups, which are not pre-tokens (not str, and cannot be
    # counted or encoded): refused everywhere.
    with pytest.raises(ValueError, match="pattern has 2 capturing groups"):
        pretokenize("ab cd", pattern=r"(a)(b)|\w+")
    with pytest.raises(ValueError, match="pattern has 2 capturing groups"):
        count_pretokens(iter(["ab cd"]), pattern=r"(a)(b)|\w+")
    with pytest.raises(ValueError, match="pattern has 2 capturing groups"):
        count_pretokens(iter(["ab cd"]), pattern=regex.compile(r"(a)(b)|\w+"))
    assert count_pretokens(iter(["ab cd"]), pattern=r"(\w+)") == {b"ab": 1, b"cd": 1}
    # One group: findall's item is the group, "" where it did not take part.
    assert pretokenize("ab ba", pattern=r"(a)|b") == regex.findall(r"(a)|b", "ab ba") == ["a", "", "", "a"]
    assert count_pretokens(iter(["ab ba"]), pattern=r"(a)|b") == {b"a": 2, b"": 2}


def test_bad_special_tokens():
    with pytest.raises(TypeError, match=r"special_tokens\[1\] must be a str"):
        pretokenize("x", special_tokens=["a", b"b"])
    with pytest.raises(TypeError, match="special_tokens must be a sequence of str"):
        count_pretokens(["x"], special_tokens="<|endoftext|>")
    with pytest.raises(ValueError, match=r"special_tokens\[1\] must not be empty"):
        pretokenize("x", special_tokens=["a", ""])
    with pytest.raises(ValueError, match=r"special_tokens\[0\] must not be empty"):
        count_pretokens(["x"], special_tokens=[""])
    with pytest.raises(ValueError, match=r"special_tokens\[0\] contains a lone surrogate \(at index 1\)"):
        pretokenize("x", special_tokens=["a\ud800"])
    # The regex fallback checks them the same way; repeats split as one token does.
    with pytest.raises(ValueError, match=r"special_tokens\[0\] contains a lone surrogate"):
        pretokenize("x", pattern=r"\w+|\W", special_tokens=["\ud800"])
    assert pretokenize("a<s>b", special_tokens=["<s>", "<s>"]) == ["a", "<s>", "b"]
    assert pretokenize("a<s>b", pattern=r"\w+|\W", special_tokens=["<s>", "<s>"]) == ["a", "<s>", "b"]


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        count_pretokens(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError):
        count_pretokens([tmp_path / "missing.txt"])
    with pytest.raises(IsADirectoryError):
        count_pretokens(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(IsADirectoryError):  # refused before the files ahead of it are counted
        count_pretokens([tmp_path / "a.txt", tmp_path])
    with pytest.raises(NotADirectoryError):  # the errno open() would give, not "no such file"
        count_pretokens(tmp_path / "a.txt" / "b.txt")
    # A list of str is paths, bytes are documents: a mix would read a path as text.
    with pytest.raises(TypeError, match="inputs mixes str and bytes"):
        count_pretokens([str(tmp_path / "a.txt"), b"x y"])
    with pytest.raises(TypeError, match=r"inputs\[1\] must be str or bytes"):
        count_pretokens(["a", 3])
    with pytest.raises(TypeError, match="inputs must be"):
        count_pretokens(42)
    with pytest.raises(TypeError, match="inputs must be"):
        count_pretokens(b"raw bytes")
    with pytest.raises(ValueError, match=r"inputs\[0\] contains a lone surrogate"):
        count_pretokens(iter(["\ud800"]))
    with pytest.raises(TypeError, match="text must be a str"):
        pretokenize(b"bytes")
    with pytest.raises(ValueError, match="errors must be one of"):
        count_pretokens(["x"], errors="surrogateescape")
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        count_pretokens(["x"], num_threads=0)
    with pytest.raises(TypeError, match="num_threads must be an int"):
        count_pretokens(["x"], num_threads=1.5)
    with pytest.raises(ValueError, match="num_threads must be <= 4096"):
        count_pretokens(iter(["x"]), num_threads=10**9)
    with pytest.raises(TypeError, match="show_progress must be a bool"):
        count_pretokens(["x"], show_progress="yes")
    with pytest.raises(ValueError, match="pattern must be 0"):
        _core.bpe_pretokenize("x", 7, [])


def test_progress_reporting(tmp_path, caplog):
    path = tmp_path / "doc.txt"
    path.write_text("hello world\n" * 1000)
    with caplog.at_level("INFO", logger="trainfast.bpe"):
        assert count_pretokens(path, show_progress=True) == count_pretokens(path)
    assert any("pre-tokenized" in record.getMessage() for record in caplog.records)


def test_progress_counts_utf8_bytes_of_str_documents(caplog):
    # A str's length is in code points; progress reports the UTF-8 bytes counted, as for files.
    docs = ["héllo wörld ☃ 😀 " * 20] * 70_000 + [b"caf\xc3\xa9 " * 1000, "plain ascii " * 1000]  # several batches
    expected = sum(len(d) if isinstance(d, bytes) else len(d.encode()) for d in docs)
    counter = _core.BpePretokenCounter(0, [], 0, 2)
    assert counter.add_documents(docs) == expected
    caplog.clear()
    with caplog.at_level("INFO", logger="trainfast.bpe"):
        count_pretokens(iter(docs), show_progress=True)
    assert [r.getMessage() for r in caplog.records if "pre-tokenized" in r.getMessage()] == [
        f"pre-tokenized {expected / 1e6:.1f} MB"]


@pytest.mark.parametrize("errors", ["strict", "replace", "ignore"])
@pytest.mark.parametrize("dirt", [b"\r", b"\r\n", b"\xe9", b"\xe2\x82", b"<|e|>\r"])
def test_file_turning_unclean_midway(tmp_path, errors, dirt):
    # Clean blocks are counted in place (memory-mapped); decoding takes over from the first unclean one.
    rng = random.Random(len(dirt))
    lines = ["".join(rng.choice(HARD[:40] + ["word", " the", "<|e|>"]) for _ in range(30)) for _ in range(200)]
    data = "\n".join(lines).encode("utf-8", "surrogatepass") + b" x" + dirt + b"tail\r"
    data += "\n".join(lines[:50]).encode("utf-8")
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    for block_bytes, chunk_bytes in [(64, 16), (1000, 1), (1 << 20, 1 << 20)]:
        counter = _core.BpePretokenCounter(1, ["<|e|>"], ["strict", "replace", "ignore"].index(errors), 2,
                                           chunk_bytes=chunk_bytes, block_bytes=block_bytes)
        try:
            expected_text = ref.read_text(path, errors)
        except UnicodeDecodeError as error:
            with pytest.raises(ValueError, match=f"byte offset {error.start}:"):
                counter.add_file(str(path))
            continue
        counter.add_file(str(path))
        got = counter.finish()
        expected = ref.count_pretokens([expected_text], "cl100k", ["<|e|>"])
        assert got == expected and list(got) == list(expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and MADV_DONTNEED are Linux's")
def test_file_memory_bounded_by_block(tmp_path):
    # A memory-mapped file is dropped block by block as it is counted: peak RSS grows by about one
    # block and the table, not by the file size. Measured in a fresh process that loads only the
    # extension (the package would import torch) by VmHWM, the peak of this process's own memory
    # (ru_maxrss would include the parent's, inherited through fork).
    path = tmp_path / "big.txt"
    line = "the quick brown fox jumps over the lazy dog 0123456789, again and again\n"
    path.write_text(line * (96 * 2**20 // len(line)))
    script = (
        "import importlib.util, re, sys\n"
        "def peak_kib():\n"
        "    with open('/proc/self/status') as status:\n"
        "        return int(re.search(r'VmHWM:\\s*(\\d+)', status.read()).group(1))\n"
        "spec = importlib.util.spec_from_file_location('trainfast._core', sys.argv[1])\n"
        "core = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(core)\n"
        "counter = core.BpePretokenCounter(0, [], 0, 1, block_bytes=1 << 20)\n"
        "before = peak_kib()\n"
        "counter.add_file(sys.argv[2])\n"
        "counts = counter.finish()\n"
        "print(peak_kib() - before, counts[b' the'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script, _core.__file__, str(path)],
                            capture_output=True, text=True, check=True)
    grown_kib, num_the = map(int, result.stdout.split())
    assert num_the == path.stat().st_size // len(line)
    assert grown_kib < 48 * 1024, f"peak RSS grew by {grown_kib} KiB counting a 96 MiB file"


def test_cli_pretokenize(tmp_path, capsys):
    from trainfast.cli import main

    path = tmp_path / "doc.txt"
    path.write_text("the cat<|endoftext|> the dog the end\n")
    assert main(["pretokenize", str(path), "--special-token", "<|endoftext|>", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "7 pre-tokens, 6 unique" in out and "b' the'" in out
    assert main(["pretokenize", str(tmp_path / "missing.txt")]) == 2


def test_cli_invalid_utf8_names_the_option(tmp_path, caplog):
    # The library's hint names its keyword argument; on the command line it names the option.
    from trainfast.cli import main

    path = tmp_path / "doc.txt"
    path.write_bytes(b"ok \xff")
    assert main(["pretokenize", str(path)]) == 2
    assert "invalid UTF-8 at byte offset 3" in caplog.text and "pass --errors replace or --errors ignore" in caplog.text
    assert main(["pretokenize", str(path), "--errors", "replace"]) == 0


def test_ctrl_c_stops_counting(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 3_000_000)  # 132 MB
    _assert_ctrl_c_stops_counting(path, after_seconds=0.05)


def _assert_ctrl_c_stops_counting(path, after_seconds: float, setup: str = "") -> None:
    # In a fresh process, which SIGINTs itself while count_pretokens(path) runs.
    script = (
        "import os, signal, sys, threading, time\n"
        "from trainfast.bpe import count_pretokens\n"
        # Python's Ctrl-C handler, as in a terminal: a job started in the background by a shell
        # without job control (nohup, some CI runners) inherits SIGINT ignored, which Python keeps.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"{setup}"
        f"threading.Timer({after_seconds}, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    count_pretokens(sys.argv[1], num_threads=2)\n"
        "    print('finished')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"  # daemon threads of `setup` may still be running
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stdout.strip() == "interrupted", out.stderr


@pytest.mark.parametrize("name", NAMES)
def test_file_blocks_seeded(tmp_path, name):
    # Files cut into small raw blocks (memory-mapped path): CRLF, invalid bytes and special tokens
    # near block edges must not change anything.
    rng = random.Random(5 + NATIVE_ID[name])
    path = tmp_path / "doc.txt"
    specials = ["<|e|>", "\n\n"]
    for trial in range(60):
        parts = []
        for _ in range(rng.randrange(1, 60)):
            roll = rng.random()
            if roll < 0.6:
                parts.append(_random_text(rng, 20).encode("utf-8"))
            else:
                parts.append(rng.choice([b"\r\n", b"\r", b"\n", b" ", b"<|e|>", b"<|e", b"\xff", b"\xe2\x82", b"\r\r\n"]))
        data = b"".join(parts)
        path.write_bytes(data)
        errors = ["strict", "replace", "ignore"][trial % 3]
        counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, trial % 3, 1 + trial % 3,
                                           chunk_bytes=1 + trial % 7, block_bytes=16 + trial % 50)
        try:
            expected_text = ref.read_text(path, errors)
        except UnicodeDecodeError as error:
            with pytest.raises(ValueError, match=f"byte offset {error.start}:"):
                counter.add_file(str(path))
            continue
        counter.add_file(str(path))
        assert counter.finish() == ref.count_pretokens([expected_text], name, specials), (trial, data)


def _feed_fifo(path: Path, data: bytes) -> threading.Thread:
    def write() -> None:
        with open(path, "wb") as fifo:
            for start in range(0, len(data), 4096):
                fifo.write(data[start:start + 4096])

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name", NAMES)
def test_pipe_read_in_order(tmp_path, name):
    # A pipe cannot be memory-mapped: it is read, decoded and cut as it arrives. Safe cuts are
    # rare here (long runs without whitespace), so cuts must resume where the last read stopped.
    rng = random.Random(11 + NATIVE_ID[name])
    specials = ["<|e|>"]
    for trial in range(12):
        pieces = []
        for _ in range(rng.randrange(1, 40)):
            roll = rng.random()
            if roll < 0.3:
                pieces.append(("x" * rng.randrange(1, 300)).encode())
            elif roll < 0.8:
                pieces.append(_random_text(rng, 30).encode("utf-8", "surrogatepass"))
            else:
                pieces.append(rng.choice([b" ", b"\r\n", b"\r", b"<|e|>", b"\xff", b"\xe2\x82"]))
        data = b"".join(pieces)
        errors = ["strict", "replace", "ignore"][trial % 3]
        fifo = tmp_path / f"pipe{trial}"
        os.mkfifo(fifo)
        writer = _feed_fifo(fifo, data)
        counter = _core.BpePretokenCounter(NATIVE_ID[name], specials, trial % 3, 1 + trial % 2,
                                           chunk_bytes=1 + trial % 5, block_bytes=16 + 7 * trial)
        try:
            text = ref.decode_like_file(data, errors)
        except UnicodeDecodeError as error:
            with pytest.raises(ValueError, match=f"byte offset {error.start}:"):
                counter.add_file(str(fifo))
            writer.join(timeout=10)
            continue
        counter.add_file(str(fifo))
        writer.join(timeout=10)
        got = counter.finish()
        expected = ref.count_pretokens([text], name, specials)
        assert got == expected and list(got) == list(expected)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_ctrl_c_stops_reading_a_pipe_without_cuts(tmp_path):
    # No whitespace ever arrives, so no chunk can be cut and nothing is counted while the text
    # grows: Ctrl-C must still stop the read.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    endless_writer = (
        "def write():\n"
        "    with open(sys.argv[1], 'wb') as fifo:\n"
        "        while True:\n"
        "            fifo.write(b'a' * 65536)\n"
        "            time.sleep(0.0005)\n"
        "threading.Thread(target=write, daemon=True).start()\n"
    )
    _assert_ctrl_c_stops_counting(fifo, after_seconds=0.3, setup=endless_writer)


def test_ctrl_c_in_progress_callback_stops_counting():
    counter = _core.BpePretokenCounter(0, [], 0, 1, chunk_bytes=16)
    calls = []

    def progress(done):
        calls.append(done)
        if len(calls) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        counter.add_documents(["hello world " * 1000], 0, progress)
    assert len(calls) == 1


def test_counter_refuses_use_after_a_failed_call(tmp_path):
    counter = _core.BpePretokenCounter(0, [], 0, 2, chunk_bytes=16, block_bytes=64)
    counter.add_documents(["hello world"])
    # Documents are decoded before anything is counted: a bad one leaves the counter as it was.
    with pytest.raises(ValueError, match="invalid UTF-8"):
        counter.add_documents([b"ok", b"\xff"])
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world " * 40 + b"\xff")
    # A file fails part way, after its first blocks were counted.
    with pytest.raises(ValueError, match="invalid UTF-8 at byte offset 480"):
        counter.add_file(str(path))
    for call in (counter.finish, counter.finish_arrays, lambda: counter.add_documents(["x"])):
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            call()
    fresh = _core.BpePretokenCounter(0, [], 0, 2, chunk_bytes=16, block_bytes=64)
    fresh.add_documents(["hello world"])
    with pytest.raises(FileNotFoundError):  # fails before counting: the counter stays usable
        fresh.add_file(str(tmp_path / "missing.txt"))
    assert fresh.finish() == {b"hello": 1, b" world": 1}


def test_counter_breaks_when_a_later_run_of_documents_fails():
    """str and bytes documents are counted run by run: a bad bytes document after a str one failed
    the call with the str run counted, and finish() then gave those partial counts silently."""
    counter = _core.BpePretokenCounter(0, [], 0, 1)
    with pytest.raises(ValueError, match=r"inputs\[1\]"):
        counter.add_documents(["ok doc", b"\xff bad", "more"])
    with pytest.raises(RuntimeError, match="failed in an earlier call"):
        counter.finish()
    # The last progress report comes after everything is counted (the reports while counting run
    # inside the core's own guard): an error there (Ctrl-C, or what a signal handler raised inside
    # the callback) fails the call as itself. The public _Progress keeps display errors to itself.
    total = {"docs": len("hello world"), "file": os.path.getsize(__file__)}
    for source, error in itertools.product(total, (KeyboardInterrupt, ValueError)):
        counter = _core.BpePretokenCounter(0, [], 0, 1)
        calls = []

        def progress(done):
            calls.append(done)
            if done == total[source]:
                raise error

        if source == "docs":
            call = lambda: counter.add_documents(["hello world"], 0, progress)  # noqa: E731
        else:
            call = lambda: counter.add_file(__file__, progress)  # noqa: E731
        with pytest.raises(error):
            call()
        with pytest.raises(RuntimeError, match="failed in an earlier call"):
            counter.finish()
        assert calls[-1] == total[source] and calls.count(total[source]) == 1, calls


def test_counter_rejects_use_from_its_own_progress_callback():
    counter = _core.BpePretokenCounter(0, [], 0, 1, chunk_bytes=16)
    errors = []

    def progress(done):
        try:
            counter.finish()
        except RuntimeError as error:
            errors.append(str(error))

    counter.add_documents(["hello world " * 1000], 0, progress)
    assert errors and all("in use by another call" in error for error in errors)
    assert counter.finish()[b" world"] == 1000


def test_file_name_not_utf8(tmp_path):
    raw_name = os.path.join(os.fsencode(tmp_path), b"caf\xe9.txt")
    with open(raw_name, "wb") as handle:
        handle.write(b"the cat the dog\n")
    path = os.fsdecode(raw_name)  # a str with a surrogate escape
    assert count_pretokens(path) == {b"the": 1, b" cat": 1, b" the": 1, b" dog": 1, b"\n": 1}
    assert count_pretokens(Path(path), num_threads=2) == count_pretokens(path)


def test_counter_first_index_is_range_checked():
    # first_index numbers the documents in error messages (inputs[first_index + k]): no int64 overflow.
    counter = _core.BpePretokenCounter(0, [], 0, 1)
    for first_index in (-1, 2**63 - 1):
        with pytest.raises(ValueError, match=r"first_index must be in \[0, 2\^62\]"):
            counter.add_documents(["x"], first_index=first_index)


def test_cli_without_regex_says_what_to_install(tmp_path, monkeypatch, caplog):
    import sys

    from trainfast.cli import main

    (tmp_path / "x.txt").write_text("hello world")
    monkeypatch.setitem(sys.modules, "regex", None)  # as if not installed: import raises ImportError
    with caplog.at_level("ERROR", logger="trainfast"):
        assert main(["pretokenize", str(tmp_path / "x.txt"), "--pattern", r"\w+"]) == 2
    assert "need the `regex` package (pip install regex)" in caplog.text
    assert main(["pretokenize", str(tmp_path / "x.txt")]) == 0  # the named patterns need no regex


@pytest.mark.parametrize("error, dropped", [
    (ValueError("I/O operation on closed file"), True),
    (BrokenPipeError(32, "Broken pipe"), True),
    (OSError(5, "Input/output error"), True),  # EIO: the terminal hung up
    (TimeoutError("deadline"), False),  # a signal handler's, raised inside the write: the caller's
    (OSError(28, "No space left on device"), False),
])
def test_progress_keeps_only_the_terminals_own_errors(error, dropped):
    from trainfast._util import Progress

    class FailingBar:
        def update(self, n):
            raise error

    progress = Progress(enabled=False, total=100, desc="x", unit="B", logger=logging.getLogger("x"))
    progress.enabled, progress.bar = True, FailingBar()
    if dropped:
        progress.update_to(10)
        assert progress.bar is None and progress.done == 10
    else:
        with pytest.raises(type(error)):
            progress.update_to(10)


def test_progress_display_failure_does_not_stop_counting():
    """A closed stderr makes tqdm raise ValueError: the bar is dropped, the count goes on."""
    import sys

    progress_type = sys.modules["trainfast.bpe.pretokenize"]._Progress

    class ClosedBar:
        def update(self, n):
            raise ValueError("I/O operation on closed file")

    progress = progress_type(False, 100)
    progress.enabled, progress.bar = True, ClosedBar()
    progress.update_to(10)
    assert progress.bar is None and progress.done == 10
