"""trainfast.bpe.Tokenizer == tiktoken's gpt2 encoding (built from the CS336 fixtures) and the
pure-Python oracle (tests/reference/bpe_tokenizer.py); CS336 Tokenizer semantics; bad input."""

from __future__ import annotations

import itertools
import json
import lzma
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.bpe_tokenizer import ReferenceTokenizer, tiktoken_gpt2
from trainfast.bpe import Tokenizer, train_bpe
from trainfast.bpe import tokenizer as tokenizer_module

EOT = "<|endoftext|>"
FIXTURES = ("address.txt", "german.txt", "tinystories_sample.txt", "special_token_double_newlines_non_whitespace.txt",
            "special_token_trailing_newlines.txt", "corpus.en")


def _fixture(shared_dir: Path, name: str) -> Path:
    return shared_dir / "fixtures" / "cs336" / name


@pytest.fixture(scope="module")
def gpt2(shared_dir) -> Tokenizer:
    return Tokenizer.from_files(_fixture(shared_dir, "gpt2_vocab.json"), _fixture(shared_dir, "gpt2_merges.txt"),
                                special_tokens=[EOT])


@pytest.fixture(scope="module")
def gpt2_plain(shared_dir) -> Tokenizer:
    return Tokenizer.from_files(_fixture(shared_dir, "gpt2_vocab.json"), _fixture(shared_dir, "gpt2_merges.txt"))


@pytest.fixture(scope="module")
def tiktoken_enc(shared_dir):
    return tiktoken_gpt2(_fixture(shared_dir, "gpt2_vocab.json"))


@pytest.fixture(scope="module")
def small(shared_dir) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """A 600-token vocab trained on the CS336 corpus.en fixture."""
    return train_bpe(_fixture(shared_dir, "corpus.en"), 600, [EOT], show_progress=False)


def _corpus(shared_dir: Path, name: str, num_chars: int | None = None) -> str:
    with lzma.open(shared_dir / "corpora" / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read(num_chars) if num_chars is not None else f.read()


# --- equality with tiktoken's gpt2 encoding -----------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures_match_tiktoken(shared_dir, gpt2, gpt2_plain, tiktoken_enc, name):
    text = _fixture(shared_dir, name).read_text(encoding="utf-8")
    ids = gpt2.encode(text)
    assert ids == tiktoken_enc.encode(text, allowed_special={EOT})
    assert gpt2.decode(ids) == text
    assert gpt2_plain.encode(text) == tiktoken_enc.encode_ordinary(text)


@pytest.mark.slow
@pytest.mark.parametrize("name,num_chars", [("austen", None), ("kjv", None), ("multilingual", None), ("gcide", None)])
def test_corpora_match_tiktoken(shared_dir, gpt2, tiktoken_enc, name, num_chars):
    text = _corpus(shared_dir, name, num_chars)
    ids = gpt2.encode(text)
    assert ids == tiktoken_enc.encode(text, allowed_special={EOT})
    assert gpt2.decode(ids) == text
    lines = text.splitlines(keepends=True)[:20000]
    assert gpt2.encode_batch(lines, num_threads=2) == tiktoken_enc.encode_batch(lines, allowed_special={EOT})


_TEXT_ALPHABET = st.sampled_from(
    list("aAzZ09 '\n\t\r.,!?-sdmtlvre") + ["  ", "\n\n", " \n", "'s", "'ll", "é", "ß", "中", "文", "😀", "\u00a0",
                                           "\u2003", "\u3000", "。", "١", "Ⅻ", "\u0301", "\x00", "x\n", "中\n", "<|endoftext|>", "<|endof", "ext|>"]
)
_texts = st.lists(_TEXT_ALPHABET, max_size=60).map("".join)
_any_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)


@given(text=st.one_of(_texts, _any_text))
def test_hypothesis_matches_tiktoken(gpt2, gpt2_plain, tiktoken_enc, text):
    ids = gpt2.encode(text)
    assert ids == tiktoken_enc.encode(text, allowed_special={EOT})
    assert gpt2.decode(ids) == text
    assert gpt2_plain.encode(text) == tiktoken_enc.encode_ordinary(text)


@pytest.mark.parametrize("text", ["a" * 300, "ab" * 5000, " " * 1000 + "x", "\n" * 777, "9" * 4000,
                                  "supercalifragilistic" * 40, "😀" * 200])
def test_long_pretokens_match_tiktoken(gpt2, tiktoken_enc, text):
    assert gpt2.encode(text) == tiktoken_enc.encode(text)


def test_pickle_round_trip(small):
    import pickle

    vocab, merges = small
    tok = Tokenizer(vocab, merges, [EOT, "<|pad|>"], pattern="cl100k")
    again = pickle.loads(pickle.dumps(tok))
    text = f"some text<|pad|> 123456{EOT}"
    assert again.encode(text) == tok.encode(text) and again.vocab == tok.vocab and again.pattern == "cl100k"


def test_encode_iterable_surrogate_pair_across_chunks(gpt2, tiktoken_enc, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_STREAM_CHARS", 4)
    chunks = ["ab cd x\ud83d", "\ude00 yz ab", "\ud800", " ok"]
    assert list(gpt2.encode_iterable(chunks)) == gpt2.encode("".join(chunks)) == tiktoken_enc.encode("".join(chunks))


def test_lone_surrogates_replaced_like_tiktoken(gpt2, tiktoken_enc):
    for text in ["a\ud800b", "\udfff", "x\ud83d\ude00y", "ok"]:
        assert gpt2.encode(text) == tiktoken_enc.encode(text)
    assert gpt2.encode_batch(["a\ud800b", "ok"], num_threads=2) == [tiktoken_enc.encode("a\ud800b"),
                                                                    tiktoken_enc.encode("ok")]


@pytest.mark.parametrize("wide", ["\xe9", "\u4e2d", "\U0001f600"])  # Python stores 1, 2, 4 bytes per code point
def test_long_non_ascii_text_matches_tiktoken_and_is_left_as_it_was(gpt2, tiktoken_enc, wide):
    # Longer than the native UTF-8 encoder's block (2^20 code points), with wide characters at its cut.
    words = [w for w in ["the", " cat", "\n", " caf\xe9", "\xa0", " \u4e2d\u6587", "\U0001f600!", wide * 3] if max(map(ord, w)) <= ord(wide)]
    rng = random.Random(3)
    text = "".join(rng.choice(words) for _ in range(400_000))
    text = text[: (1 << 20) - 1] + wide + wide + text[(1 << 20) + 1 :]
    size_before = sys.getsizeof(text)
    ids = gpt2.encode(text)
    assert gpt2.encode_batch([text, "x"], num_threads=2) == [ids, [87]]
    assert sys.getsizeof(text) == size_before  # no UTF-8 copy cached inside the str (tiktoken leaves one)
    assert ids == tiktoken_enc.encode(text)


@pytest.mark.parametrize("pattern", ["cl100k", "o200k"])
def test_other_patterns_match_tiktoken(shared_dir, pattern, tiktoken_enc):
    from trainfast.bpe.pretokenize import PATTERNS
    from reference.bpe_tokenizer import tiktoken_gpt2 as build

    enc = build(_fixture(shared_dir, "gpt2_vocab.json"), pattern=PATTERNS[pattern])
    tok = Tokenizer.from_files(_fixture(shared_dir, "gpt2_vocab.json"), _fixture(shared_dir, "gpt2_merges.txt"),
                               [EOT], pattern=pattern)
    text = _corpus(shared_dir, "multilingual", 3_000_000)
    assert tok.encode(text) == enc.encode(text, allowed_special={EOT})


# --- the oracle on a small trained vocabulary ---------------------------------------------------


@given(text=st.one_of(_texts, _any_text), specials=st.sampled_from([[], [EOT], [EOT, EOT + EOT], ["ab", "a", "\n\n"]]))
def test_matches_oracle_small_vocab(small, text, specials):
    vocab, merges = small
    tok = Tokenizer(vocab, merges, specials)
    ref = ReferenceTokenizer(vocab, merges, specials)
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == text


def test_oracle_on_odd_merge_lists():
    # Non-standard merge lists: repeated pairs keep their first rank; late merges of early tokens.
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256: b"aa", 257: b"ab", 258: b"aab", 259: b"aaa", 260: b"ba", 261: b"aaaa"})
    merges = [(b"a", b"b"), (b"a", b"a"), (b"a", b"ab"), (b"a", b"a"), (b"aa", b"a"), (b"b", b"a"),
              (b"aa", b"aa")]
    tok, ref = Tokenizer(vocab, merges), ReferenceTokenizer(vocab, merges)
    for text in ["aaab", "abababa", "aaaa", "baaaab", "a" * 301, "ab" * 200 + "a" * 199, "ba" * 150]:
        assert tok.encode(text) == ref.encode(text), text


# --- CS336 semantics -----------------------------------------------------------------------------


def test_overlapping_special_tokens_keep_the_longest(gpt2_plain, shared_dir):
    tok = Tokenizer.from_files(_fixture(shared_dir, "gpt2_vocab.json"), _fixture(shared_dir, "gpt2_merges.txt"),
                               special_tokens=[EOT, EOT + EOT])
    text = f"Hello, how {EOT}{EOT} are you?{EOT}"
    ids = tok.encode(text)
    tokens = [tok.decode([i]) for i in ids]
    assert tokens.count(EOT + EOT) == 1 and tokens.count(EOT) == 1
    assert tok.decode(ids) == text
    assert tok.vocab[ids[tokens.index(EOT + EOT)]] == (EOT + EOT).encode()
    assert len(tok) == 50258  # the double token is appended after GPT-2's 50257


def test_special_tokens_not_given_are_plain_text(gpt2_plain, tiktoken_enc):
    text = f"a{EOT}b"
    assert gpt2_plain.encode(text) == tiktoken_enc.encode_ordinary(text)
    assert 50256 not in gpt2_plain.encode(text)


def test_worked_example(gpt2):
    assert gpt2.encode("Hello world<|endoftext|>") == [15496, 995, 50256]
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert gpt2.encode("") == [] and gpt2.decode([]) == ""


def test_decode_invalid_utf8_gives_replacement_character(gpt2):
    lone_continuation = gpt2.token_to_id(b"\x80")
    first_half = gpt2.token_to_id(b"\xe4")
    assert gpt2.decode([lone_continuation]) == "\ufffd"
    assert gpt2.decode([15496, first_half, 995]) == "Hello\ufffd world"
    assert gpt2.decode_bytes([first_half]) == b"\xe4"
    ids = gpt2.encode("\U0001f9ec")  # split over several byte tokens
    assert len(ids) > 1 and gpt2.decode(ids[:1]) == "\ufffd"


def test_decode_accepts_arrays(gpt2):
    ids = gpt2.encode("The quick brown fox")
    assert gpt2.decode(np.array(ids)) == gpt2.decode(torch.tensor(ids)) == gpt2.decode(tuple(ids)) == \
        gpt2.decode(iter(ids)) == "The quick brown fox"
    # NumPy integers in a list, as Python's own indexing takes them.
    assert gpt2.decode(list(np.array(ids))) == gpt2.decode([np.int32(i) for i in ids]) == "The quick brown fox"
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int \(got float64\)"):
        gpt2.decode([np.float64(ids[0])])
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int \(got bool\)"):
        gpt2.decode([True])


def test_decode_survives_ids_changed_by_index():
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [])
    ids = [0] * 64

    class Evil:
        def __index__(self):
            ids.clear()  # with items read from the caller's list in place, this freed them
            return 104

    ids[:2] = [Evil(), 105]
    assert tok.decode(ids) == "hi" + "\x00" * 62
    # Plain ints first (read in place), then one whose __index__ empties the list: the rest as it was.
    ids[:] = [72, 105, 33, Evil(), 106, 107]
    assert tok.decode(ids) == "Hi!hjk"


@pytest.mark.parametrize("chunker", ["lines", "chars", "random"])
def test_encode_iterable_equals_encode(shared_dir, gpt2, monkeypatch, chunker):
    monkeypatch.setattr(tokenizer_module, "_STREAM_CHARS", 64)  # force many cuts
    text = _fixture(shared_dir, "tinystories_sample.txt").read_text(encoding="utf-8") + \
        _corpus(shared_dir, "multilingual", 20_000) + f"x {EOT}{EOT}\n\n a  \n\n"
    if chunker == "lines":
        chunks = text.splitlines(keepends=True)
    elif chunker == "chars":
        chunks = list(text)
    else:
        rng = np.random.default_rng(0)
        cuts = sorted(rng.integers(0, len(text), 400).tolist())
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert list(gpt2.encode_iterable(chunks)) == gpt2.encode(text)


@pytest.mark.parametrize("stream_chars", [64, 1 << 16])
def test_long_special_tokens_among_near_misses(special_token_search, monkeypatch, stream_chars):
    # Tokens over 64 bytes are found by the matcher's reverse automaton; the streaming cut must
    # not fall inside an occurrence (it moves back to the occurrence's start).
    monkeypatch.setattr(tokenizer_module, "_STREAM_CHARS", stream_chars)
    specials = ["a " * 50 + "b", "a " * 40 + "c", "<" + "x" * 200 + ">", "a "]
    vocab = {b: bytes([b]) for b in range(256)} | {256 + k: s.encode() for k, s in enumerate(specials)}
    merges = [(b"x", b"x")]
    vocab[260] = b"xx"
    tok, oracle = Tokenizer(vocab, merges, specials), ReferenceTokenizer(vocab, merges, specials)
    rng = random.Random(5)
    pieces = specials + ["a " * 49, "a " * 60, "x" * 199, "<" + "x" * 199, "a", "b", " ", "\n", "é"]
    text = "".join(rng.choice(pieces) for _ in range(3000))
    ids = tok.encode(text)
    assert ids == oracle.encode(text)
    chunks = [text[k:k + 997] for k in range(0, len(text), 997)]
    assert list(tok.encode_iterable(chunks)) == ids


def test_encode_iterable_through_text_densely_covered_by_special_tokens(special_token_search, monkeypatch):
    # The streaming cut looks back past 64 occurrences at most, then finds the last safe point in
    # one forward pass: here every point before the stream's end is inside "a " or "a a".
    monkeypatch.setattr(tokenizer_module, "_STREAM_CHARS", 64)
    specials = ["a ", "a a", "<" + "x" * 100 + ">"]
    vocab = {b: bytes([b]) for b in range(256)} | {256 + k: s.encode() for k, s in enumerate(specials)}
    tok, oracle = Tokenizer(vocab, [], specials), ReferenceTokenizer(vocab, [], specials)
    text = ("a " * 500 + "b. " + "<" + "x" * 100 + "> ") * 20
    ids = oracle.encode(text)
    assert tok.encode(text) == ids
    for size in (61, 997, 5000):
        assert list(tok.encode_iterable(text[k:k + size] for k in range(0, len(text), size))) == ids


@pytest.mark.parametrize("line", ["12,345,6789\n", "3.14 2.72 1.41\n", "== ** ==\r\n"])
def test_encode_iterable_holds_a_bounded_window_of_text_without_letters(gpt2, monkeypatch, line):
    # Numbers and punctuation only: no "<space><letter>" to cut at, yet the window stays bounded.
    monkeypatch.setattr(tokenizer_module, "_STREAM_CHARS", 256)
    num_lines, consumed = 20_000, []

    def lines():
        for idx in range(num_lines):
            consumed.append(idx)
            yield line

    stream = gpt2.encode_iterable(lines())
    first = next(stream)
    assert len(consumed) < 100, "nothing came out before most of the input was read"
    assert [first, *stream] == gpt2.encode(line * num_lines)


@given(pieces=st.lists(st.one_of(_texts, _any_text), max_size=20))
def test_encode_iterable_hypothesis(gpt2, monkeypatch_module, pieces):
    assert list(gpt2.encode_iterable(pieces)) == gpt2.encode("".join(pieces))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_module, "_STREAM_CHARS", 8)
        yield mp


def test_encode_iterable_over_file_handle_is_lazy(shared_dir, gpt2, tmp_path):
    with open(_fixture(shared_dir, "tinystories_sample.txt"), encoding="utf-8") as f:
        ids = list(gpt2.encode_iterable(f))
    assert ids == gpt2.encode(_fixture(shared_dir, "tinystories_sample.txt").read_text(encoding="utf-8"))

    def endless():
        while True:
            yield "Once upon a time there was a tiny tokenizer.\n"

    first = list(itertools.islice(gpt2.encode_iterable(endless()), 100_000))
    assert len(first) == 100_000 and gpt2.decode(first[:10]).startswith("Once upon a time")


@pytest.mark.parametrize("line", ["中文的句子。\n", "Ñandú corre\n", "日本語\u3000テキスト\n", "a\n"])
def test_encode_iterable_streams_without_ascii(gpt2, line):
    consumed = 0

    def lines():
        nonlocal consumed
        for _ in range(100_000):
            consumed += 1
            yield line

    stream = gpt2.encode_iterable(lines())
    first = next(stream)
    assert consumed < 50_000  # yielded long before the input ran out: the buffer stays bounded
    assert [first, *stream] == gpt2.encode(line * 100_000)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_encode_batch_equals_encode(shared_dir, gpt2, num_threads):
    text = _corpus(shared_dir, "kjv", 300_000)
    texts = text.split("\n\n") + ["", EOT, "x"]
    assert gpt2.encode_batch(texts, num_threads=num_threads) == [gpt2.encode(t) for t in texts]
    assert gpt2.encode_batch([]) == []


def test_custom_regex_pattern_matches_oracle(small):
    vocab, merges = small
    pattern = r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"
    tok = Tokenizer(vocab, merges, [EOT], pattern=pattern)
    ref = ReferenceTokenizer(vocab, merges, [EOT], pattern=pattern)
    text = f"the cat sat 123 on{EOT}the  mat!!"
    assert tok.encode(text) == ref.encode(text)
    assert list(tok.encode_iterable([text[:7], text[7:]])) == ref.encode(text)
    assert tok.encode_batch([text, text]) == [ref.encode(text)] * 2
    with pytest.raises(ValueError, match="pattern has 2 capturing groups"):
        Tokenizer(vocab, merges, [EOT], pattern=r"(\p{L})(\p{L})|\S")


# --- bad input -----------------------------------------------------------------------------------


def test_decode_unknown_ids(gpt2):
    with pytest.raises(ValueError, match=r"ids\[1\] = 60000 is not a token id"):
        gpt2.decode([1, 60000])
    with pytest.raises(ValueError, match=r"ids\[0\] = -1"):
        gpt2.decode([-1])
    with pytest.raises(ValueError, match=r"ids\[0\] = 1267650600228229401496703205376"):
        gpt2.decode([2**100])
    with pytest.raises(TypeError, match=r"ids\[2\] must be an int"):
        gpt2.decode([1, 2, "3"])
    with pytest.raises(TypeError, match="ids must be a sequence"):
        gpt2.decode("abc")
    with pytest.raises(ValueError, match="1-D"):
        gpt2.decode(np.zeros((2, 2), dtype=np.int64))


def test_bad_text_types(gpt2):
    with pytest.raises(TypeError, match="text must be a str"):
        gpt2.encode(b"bytes")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        gpt2.encode_batch(["a", 3])
    with pytest.raises(TypeError, match="not a str"):
        gpt2.encode_iterable("a string")
    with pytest.raises(TypeError, match="item 1 must be a str"):
        list(gpt2.encode_iterable(["a", b"b"]))
    with pytest.raises(ValueError, match="num_threads"):
        gpt2.encode_batch(["a"], num_threads=0)


def _byte_vocab() -> dict[int, bytes]:
    return {i: bytes([i]) for i in range(256)}


def test_bad_vocab_and_merges():
    with pytest.raises(ValueError, match="all 256 single-byte tokens"):
        Tokenizer({i: bytes([i]) for i in range(255)}, [])
    with pytest.raises(ValueError, match="both map to token"):
        Tokenizer({**_byte_vocab(), 256: b"a"}, [])
    with pytest.raises(TypeError, match="vocab keys must be int"):
        Tokenizer({**_byte_vocab(), "x": b"xy"}, [])
    with pytest.raises(ValueError, match=r"vocab\[256\] must be non-empty"):
        Tokenizer({**_byte_vocab(), 256: b""}, [])
    with pytest.raises(ValueError, match=r"merges\[0\] = \(b'a', b'b'\) refers to an unknown token: its merged"):
        Tokenizer(_byte_vocab(), [(b"a", b"b")])
    with pytest.raises(ValueError, match=r"merges\[1\].*its left token b'zz'"):
        Tokenizer({**_byte_vocab(), 256: b"ab", 257: b"zzq"}, [(b"a", b"b"), (b"zz", b"q")])
    with pytest.raises(TypeError, match=r"merges\[0\] must be a pair of bytes"):
        Tokenizer(_byte_vocab(), [("a", "b")])
    with pytest.raises(TypeError, match="vocab must be a dict"):
        Tokenizer([b"a"], [])


def test_bad_special_tokens():
    with pytest.raises(ValueError, match=r"special_tokens\[1\] = 'x' repeats"):
        Tokenizer(_byte_vocab(), [], ["x", "x"])
    with pytest.raises(ValueError, match=r"special_tokens\[0\] must not be empty"):
        Tokenizer(_byte_vocab(), [], [""])
    with pytest.raises(TypeError, match=r"special_tokens\[0\] must be a str"):
        Tokenizer(_byte_vocab(), [], [b"x"])
    with pytest.raises(TypeError, match="special_tokens must be a sequence of str, not a single str"):
        Tokenizer(_byte_vocab(), [], EOT)
    with pytest.raises(TypeError, match=r"special_tokens must be a sequence of str \(got int\)"):
        Tokenizer(_byte_vocab(), [], 5)
    with pytest.raises(ValueError, match=r"special_tokens\[0\] contains a lone surrogate \(at index 0\)"):
        Tokenizer(_byte_vocab(), [], ["\udc80"])
    with pytest.raises(ValueError, match="pattern"):
        Tokenizer(_byte_vocab(), [], pattern="gpt3")


def test_malformed_files_name_the_line(tmp_path, shared_dir):
    vocab_path = _fixture(shared_dir, "gpt2_vocab.json")
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\nĠ t\nĠ a b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges.txt:3: expected 'left right'"):
        Tokenizer.from_files(vocab_path, merges)
    merges.write_text("Ġ t\nĠ zzzqq\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges.txt:2: merge 'Ġ zzzqq' refers to an unknown token"):
        Tokenizer.from_files(vocab_path, merges)
    merges.write_text("Ġ t\na \u4e00\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges.txt:2: .*outside GPT-2's byte map"):
        Tokenizer.from_files(vocab_path, merges)

    vocab = tmp_path / "vocab.json"
    vocab.write_text('{\n  "a": 0,\n  "b": 1,\n  "c" 2\n}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json:4: malformed JSON"):
        Tokenizer.from_files(vocab, merges)
    vocab.write_text('{\n  "a": 0,\n  "b": "one"\n}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json:3: id of 'b' must be an int"):
        Tokenizer.from_files(vocab, merges)
    vocab.write_text('{\n  "a": 0,\n  "b": 0\n}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json:3: id 0 of 'b' is already used"):
        Tokenizer.from_files(vocab, merges)
    vocab.write_text('[1, 2]', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json:1: vocab must be a JSON object"):
        Tokenizer.from_files(vocab, merges)
    vocab.write_bytes(b'{"\xff": 0}')
    with pytest.raises(ValueError, match="not valid UTF-8"):
        Tokenizer.from_files(vocab, merges)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_files(tmp_path / "missing.json", merges)


def test_from_files_round_trips_saved_tokenizer(tmp_path, small):
    from trainfast.bpe import save

    vocab, merges = small
    save(vocab, merges, tmp_path)
    tok = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    ref = ReferenceTokenizer(vocab, merges, [EOT])
    text = f"Once upon a time{EOT} there was"
    assert tok.encode(text) == ref.encode(text)
    assert tok.vocab == vocab and tok.merges == merges
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))


def test_cli_encode_and_export(shared_dir, tmp_path, small, capsys):
    import tokenizers

    from trainfast.bpe import save
    from trainfast.cli import main

    vocab, merges = small
    save(vocab, merges, tmp_path / "tok")
    text_path = _fixture(shared_dir, "tinystories_sample.txt")
    assert main(["bpe", "encode", str(text_path), "--tokenizer", str(tmp_path / "tok"), "--special-token", EOT,
                 "--out", str(tmp_path / "ids.npy")]) == 0
    expected = ReferenceTokenizer(vocab, merges, [EOT]).encode(text_path.read_text(encoding="utf-8"))
    assert np.load(tmp_path / "ids.npy").tolist() == expected
    # Without ".npy" np.save appends it: the message names the file really written.
    assert main(["bpe", "encode", str(text_path), "--tokenizer", str(tmp_path / "tok"), "--special-token", EOT,
                 "--out", str(tmp_path / "ids2"), "--no-progress"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"-> {tmp_path / 'ids2.npy'}")
    assert np.load(tmp_path / "ids2.npy").tolist() == expected
    assert main(["bpe", "export", "--tokenizer", str(tmp_path / "tok"), "--special-token", EOT,
                 "--hf", str(tmp_path / "tokenizer.json")]) == 0
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False).ids == expected


def test_cli_decode_inverts_encode_and_refuses_bad_ids(tmp_path, small, caplog):
    from trainfast.bpe import save
    from trainfast.cli import main

    vocab, merges = small
    save(vocab, merges, tmp_path / "tok")
    text = f"Once upon a t\u00efme\r\n{EOT} there was\n" * 20
    (tmp_path / "in.txt").write_bytes(text.encode())
    tok_args = ["--tokenizer", str(tmp_path / "tok"), "--special-token", EOT]
    assert main(["bpe", "encode", str(tmp_path / "in.txt"), *tok_args, "--out", str(tmp_path / "ids.npy"),
                 "--no-progress"]) == 0
    assert main(["bpe", "decode", str(tmp_path / "ids.npy"), *tok_args, "--out", str(tmp_path / "back.txt")]) == 0
    assert (tmp_path / "back.txt").read_bytes() == text.replace("\r\n", "\n").encode()  # encode read text mode
    # Bytes as the tokens hold them: a slice ending inside a character is not replaced.
    ids = Tokenizer(vocab, merges, [EOT]).encode("\u00ef")
    np.save(tmp_path / "part.npy", np.array(ids[:1], dtype=np.int64))
    assert main(["bpe", "decode", str(tmp_path / "part.npy"), *tok_args, "--out", str(tmp_path / "part.txt")]) == 0
    assert (tmp_path / "part.txt").read_bytes() == vocab[ids[0]]

    (tmp_path / "out.txt").write_bytes(b"kept")
    bad = {"float.npy": (np.array([1.0]), "1-D integer array"),
           "2d.npy": (np.ones((2, 2), np.int32), "1-D integer array"),
           "range.npy": (np.array([1, len(vocab) + 5]), f"ids[1] = {len(vocab) + 5} is not a token id"),
           "negative.npy": (np.array([-1]), "ids[0] = -1 is not a token id"),
           # decoded in slices of 2^20 ids: the index is the file's
           "late.npy": (np.concatenate([np.full(1_100_000, ids[0]), [-3]]), "ids[1100000] = -3 is not a token id"),
           "text.npy": (None, "not a .npy file")}
    for name, (array, message) in bad.items():
        if array is None:
            (tmp_path / name).write_text("1 2 3")
        else:
            np.save(tmp_path / name, array)
        caplog.clear()
        with caplog.at_level("ERROR", logger="trainfast"):
            assert main(["bpe", "decode", str(tmp_path / name), *tok_args, "--out", str(tmp_path / "out.txt")]) == 2
        assert message in caplog.text, name
        assert (tmp_path / "out.txt").read_bytes() == b"kept"  # nothing written on a refusal


def test_cli_encode_reads_text_mode_and_names_bad_bytes(tmp_path, small, caplog):
    from trainfast.bpe import save
    from trainfast.cli import main

    vocab, merges = small
    save(vocab, merges, tmp_path / "tok")
    tok = Tokenizer(vocab, merges)

    def encode(data, *extra):
        (tmp_path / "in.txt").write_bytes(data)
        with caplog.at_level("ERROR", logger="trainfast"):
            code = main(["bpe", "encode", str(tmp_path / "in.txt"), "--tokenizer", str(tmp_path / "tok"),
                         "--out", str(tmp_path / "ids.npy"), "--no-progress", *extra])
        return code, np.load(tmp_path / "ids.npy").tolist() if code == 0 else None

    # The offset is the file's, not a read buffer's; a character split across the 1 MiB reads counts.
    for data, offset in ((b"a" * 120_000 + b"\xff b", 120_000),
                         (b"x" * ((1 << 20) - 1) + "é".encode() + b"\xc3(zz", (1 << 20) + 1)):
        caplog.clear()
        assert encode(data)[0] == 2
        assert f"in.txt: invalid UTF-8 at byte offset {offset}" in caplog.text
    # Universal newlines, also for a "\r" that ends one read and a "\n" that starts the next.
    data = b"ab\xffcd \r\n" * 50 + b"y" * ((1 << 20) - 401) + b"\r" + b"\nz\rq\r"  # "\r" is byte 2^20 - 1
    for errors in ("replace", "ignore"):
        text = data.decode("utf-8", errors).replace("\r\n", "\n").replace("\r", "\n")
        assert encode(data, "--errors", errors) == (0, tok.encode(text))


def test_ctrl_c_stops_encoding(gpt2, sigint_repeatedly):
    text = ("hello world 123 " * 100 + "\n") * 40_000  # 64 MB: seconds of work
    for run in (lambda: gpt2.encode(text), lambda: gpt2.encode_batch([text[:100_000]] * 600, num_threads=2)):
        with pytest.raises(KeyboardInterrupt), sigint_repeatedly():
            run()


@pytest.fixture(scope="module")
def small_by_pattern(small):
    from trainfast.bpe.pretokenize import PATTERNS

    vocab, merges = small
    specials = [EOT, EOT + EOT]
    return {name: (Tokenizer(vocab, merges, specials, pattern=name),
                   ReferenceTokenizer(vocab, merges, specials, pattern=PATTERNS[name]))
            for name in ("gpt2", "cl100k", "o200k")}


@given(pieces=st.lists(st.one_of(_texts, _any_text), max_size=12), pattern=st.sampled_from(["gpt2", "cl100k", "o200k"]))
def test_stream_cuts_all_patterns_match_oracle(small_by_pattern, monkeypatch_module, pieces, pattern):
    tok, ref = small_by_pattern[pattern]
    text = "".join(pieces)
    expected = ref.encode(text)
    assert tok.encode(text) == expected
    assert list(tok.encode_iterable(pieces)) == expected


def test_encode_batch_survives_the_caller_emptying_its_list(gpt2):
    # The native call holds its own references to the texts while the GIL is released.
    import threading

    texts = [f"text {k}: " + "hello world, " * 200_000 for k in range(8)]
    expected = gpt2.encode(texts[0])
    results = []
    worker = threading.Thread(target=lambda: results.append(gpt2._native.encode_batch(texts, 1)))
    worker.start()
    threading.Event().wait(0.05)
    texts.clear()
    worker.join()
    assert len(results[0]) == 8 and results[0][0] == expected


def test_sparse_vocab_ids_encode_and_decode():
    # Int objects are made only for ids in use; the ids in the gaps never appear in the output.
    vocab = {i: bytes([i]) for i in range(256)} | {3_000_000: b"ab"}
    tokenizer = Tokenizer(vocab, [(b"a", b"b")], ["<s>"])
    ids = tokenizer.encode("abab<s>x")
    assert ids == [3_000_000, 3_000_000, 3_000_001, 120] and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "abab<s>x"
    assert tokenizer.encode_batch(["ab", "<s>"], num_threads=2) == [[3_000_000], [3_000_001]]
    # Sparse ids are kept sorted, not in tables up to the largest id (which would take 50 GB here).
    vocab = {i: bytes([i]) for i in range(256)} | {150_000_000: b"ab", 2**31 - 2: b"abc"}
    tokenizer = Tokenizer(vocab, [(b"a", b"b"), (b"ab", b"c")], ["<s>"])
    ids = tokenizer.encode("abcab<s>x ab")
    assert ids == [2**31 - 2, 150_000_000, 2**31 - 1, 120, 32, 150_000_000]
    assert tokenizer.decode(ids) == "abcab<s>x ab"
    for unknown in (256, 150_000_001, 2**31 - 3):
        with pytest.raises(ValueError, match=f"ids\\[1\\] = {unknown} is not a token id"):
            tokenizer.decode([120, unknown])


@pytest.fixture(scope="module")
def small_sparse(small):
    """The small vocab with its merged tokens moved to ids far past the dense bound (kept sorted)."""
    vocab, merges = small
    sparse = {(i if i < 256 else 10**8 + 9973 * i): token for i, token in vocab.items()}
    return Tokenizer(sparse, merges, [EOT]), ReferenceTokenizer(sparse, merges, [EOT])


@given(text=st.one_of(_texts, _any_text))
def test_hypothesis_sparse_ids_match_oracle(small_sparse, text):
    tokenizer, reference = small_sparse
    ids = tokenizer.encode(text + EOT + text)
    assert ids == reference.encode(text + EOT + text)
    assert tokenizer.decode(ids) == text + EOT + text


def test_special_tokens_from_dict_keys_keep_their_order():
    vocab = {i: bytes([i]) for i in range(256)}
    specials = {"<b>": None, "<a>": None}
    ids = Tokenizer(vocab, [], specials.keys()).encode("<a><b>")
    assert ids == Tokenizer(vocab, [], list(specials)).encode("<a><b>") == [257, 256]
    with pytest.raises(TypeError, match="ordered sequence"):
        Tokenizer(vocab, [], set(specials))


def test_encode_iterable_keeps_a_special_token_cut_after_its_first_byte():
    # Found by mutation testing: the streaming cut falls between "!" and " " of the special token.
    vocab = {b: bytes([b]) for b in range(256)} | {256: b"! "}
    tok = Tokenizer(vocab, [], ["! "])
    text = "a" * (1 << 16) + "! world"
    assert list(tok.encode_iterable([text])) == tok.encode(text) == ReferenceTokenizer(vocab, [], ["! "]).encode(text)
    assert tok.encode(text)[-8:] == [97, 97, 256, 119, 111, 114, 108, 100]


def test_custom_pattern_prefers_the_longest_special_token():
    # Found by mutation testing: the regex fallback must try longer special tokens first however
    # they were listed, like the native splitter.
    vocab = {b: bytes([b]) for b in range(256)} | {256: b"<a>", 257: b"<a><b>"}
    specials = ["<a>", "<a><b>"]
    custom = Tokenizer(vocab, [], specials, pattern=r"\S+|\s+")
    assert custom.encode("x<a><b>y") == [120, 257, 121]
    assert Tokenizer(vocab, [], specials).encode("x<a><b>y") == [120, 257, 121]
    assert ReferenceTokenizer(vocab, [], specials, pattern=r"\S+|\s+").encode("x<a><b>y") == [120, 257, 121]
