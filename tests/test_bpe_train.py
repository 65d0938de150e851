"""trainfast.bpe.train_bpe == the CS336 semantics (tests/reference/bpe.py oracle and fixtures)."""

from __future__ import annotations

import json
import lzma
import logging
import os
import re
from pathlib import Path

import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

from reference import bpe as ref
from trainfast.bpe import PATTERNS, load, save, train_bpe, train_from_counts
from trainfast.bpe.io import bytes_to_unicode

SPECIAL = "<|endoftext|>"


def _fixture(shared_dir: Path, name: str) -> Path:
    return shared_dir / "fixtures" / "cs336" / name


def _decode_gpt2(text: str) -> bytes:
    table = {char: b for b, char in bytes_to_unicode().items()}
    return bytes(table[c] for c in text)


def _reference_merges(shared_dir: Path) -> list[tuple[bytes, bytes]]:
    lines = _fixture(shared_dir, "train-bpe-reference-merges.txt").read_text(encoding="utf-8").splitlines()
    return [tuple(_decode_gpt2(part) for part in line.split(" ")) for line in lines]


def _corpus_text(shared_dir: Path, name: str, num_chars: int | None = None) -> str:
    with lzma.open(shared_dir / "corpora" / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read(num_chars) if num_chars is not None else f.read()


def _train(*args, **kwargs):
    return train_bpe(*args, show_progress=False, **kwargs)


# --- CS336 fixtures ---------------------------------------------------------------------------


def test_cs336_reference_merges_and_vocab(shared_dir):
    vocab, merges = _train(_fixture(shared_dir, "corpus.en"), 500, [SPECIAL])
    assert merges == _reference_merges(shared_dir)
    reference_vocab = json.loads(_fixture(shared_dir, "train-bpe-reference-vocab.json").read_text(encoding="utf-8"))
    # The fixture holds the special token at id 0; we place it after the 256 bytes: same sets.
    assert set(vocab) == set(reference_vocab.values()) == set(range(500))
    assert set(vocab.values()) == {_decode_gpt2(token) for token in reference_vocab}


def test_vocab_id_layout(shared_dir):
    vocab, merges = _train(_fixture(shared_dir, "corpus.en"), 500, [SPECIAL, "<|pad|>"])
    assert list(vocab) == list(range(500))
    assert all(type(k) is int and type(v) is bytes for k, v in vocab.items())
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert vocab[256] == SPECIAL.encode() and vocab[257] == b"<|pad|>"
    assert [vocab[258 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert all(type(a) is bytes and type(b) is bytes for a, b in merges)


def test_tinystories_special_token_never_merged(shared_dir):
    vocab, _ = _train(_fixture(shared_dir, "tinystories_sample.txt"), 1000, [SPECIAL])
    assert [token for token in vocab.values() if b"<|" in token] == [SPECIAL.encode()]


@pytest.mark.parametrize("name", ["special_token_trailing_newlines.txt", "special_token_double_newlines_non_whitespace.txt",
                                  "german.txt", "address.txt"])
def test_small_fixtures_match_oracle(shared_dir, name):
    path = _fixture(shared_dir, name)
    assert _train(path, 400, [SPECIAL]) == ref.train_bpe(path, 400, [SPECIAL])


def test_save_load_round_trip_and_fixture_format(shared_dir, tmp_path):
    vocab, merges = _train(_fixture(shared_dir, "corpus.en"), 500, [SPECIAL])
    save(vocab, merges, tmp_path / "tok")
    assert sorted(os.listdir(tmp_path / "tok")) == ["merges.txt", "vocab.json"]
    assert load(tmp_path / "tok") == (vocab, merges)
    fixture_merges = _fixture(shared_dir, "train-bpe-reference-merges.txt").read_text(encoding="utf-8")
    assert (tmp_path / "tok" / "merges.txt").read_text(encoding="utf-8").splitlines() == fixture_merges.splitlines()


def test_save_load_arbitrary_bytes(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = "<|é ok|>".encode()
    vocab[257] = b"\x00\xff"
    vocab[258] = b" \n"
    vocab[259] = b"\x00\xff \n"
    merges = [(b"\x00\xff", b" \n")]  # save, like Tokenizer, needs every merge token in the vocab
    save(vocab, merges, tmp_path)
    assert load(tmp_path) == (vocab, merges)


def test_save_load_keeps_a_first_merge_that_looks_like_a_version_header(tmp_path):
    # Readers skip a first line starting with "#version"; save writes a header before such a merge.
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"#version", 257: b"#version:"}
    merges = [(b"#version", b":")]
    save(vocab, merges, tmp_path)
    assert load(tmp_path) == (vocab, merges)
    assert (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines() == ["#version: 0.2", "#version :"]


def test_load_reads_crlf_merges(shared_dir, tmp_path):
    vocab, merges = _train(_fixture(shared_dir, "corpus.en"), 300, [SPECIAL])
    save(vocab, merges, tmp_path)
    merges_file = tmp_path / "merges.txt"
    merges_file.write_bytes(merges_file.read_bytes().replace(b"\n", b"\r\n"))
    assert load(tmp_path) == (vocab, merges)


def test_progress_without_stderr(shared_dir, monkeypatch):
    # pythonw, daemons: sys.stderr is None, and progress (on by default) must not need it.
    monkeypatch.setattr("sys.stderr", None)
    path = _fixture(shared_dir, "corpus.en")
    assert train_bpe(path, 300, [SPECIAL], show_progress=True) == _train(path, 300, [SPECIAL])


class _ClosedTerminal:
    """A terminal stderr that has gone away: tqdm's writes raise as on a closed file."""

    def isatty(self):
        return True

    def write(self, text):
        raise ValueError("I/O operation on closed file")

    def flush(self):
        raise ValueError("I/O operation on closed file")


def test_progress_on_a_closed_terminal_does_not_stop_training(shared_dir, monkeypatch):
    # The bar is best effort: losing the terminal mid-run must not cost the run.
    path = _fixture(shared_dir, "corpus.en")
    expected = _train(path, 300, [SPECIAL])
    monkeypatch.setattr("sys.stderr", _ClosedTerminal())
    assert train_bpe(path, 300, [SPECIAL], show_progress=True) == expected


def test_save_rejects_duplicate_tokens(tmp_path):
    with pytest.raises(ValueError, match="vocab"):
        save({0: b"a", 1: b"a"}, [], tmp_path / "out")
    assert not (tmp_path / "out" / "vocab.json").exists()


def test_save_rejects_an_empty_token_that_load_would_refuse(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match=r"vocab\[256\] must be non-empty"):
        save({**vocab, 256: b""}, [], tmp_path / "out")
    assert not (tmp_path / "out" / "vocab.json").exists()


def test_load_names_the_line_of_an_empty_key(tmp_path):
    # The key '"' is written '"\\""', which ends in '"":' too: the error must point at the empty key.
    vocab = {i: bytes([i]) for i in range(256)}
    save(vocab, [], tmp_path / "out")
    path = tmp_path / "out" / "vocab.json"
    text = path.read_text(encoding="utf-8").replace("\n}", ',\n  "": 256\n}')
    path.write_text(text, encoding="utf-8")
    empty_key_line = text.splitlines().index('  "": 256') + 1
    with pytest.raises(ValueError, match=rf"vocab.json:{empty_key_line}: empty token"):
        load(tmp_path / "out")


# --- Differential: native == oracle on the shared corpora -------------------------------------


@pytest.fixture(scope="module")
def austen_counts(shared_dir):
    return ref.count_pretokens([_corpus_text(shared_dir, "austen")], [SPECIAL])


def test_austen_vocab_5000_and_prefix_1000(austen_counts):
    expected = ref.train_from_counts(austen_counts, 5000, [SPECIAL])
    assert train_from_counts(austen_counts, 5000, [SPECIAL], show_progress=False) == expected
    vocab, merges = train_from_counts(austen_counts, 1000, [SPECIAL], show_progress=False)
    assert merges == expected[1][: 1000 - 257]  # training is greedy: a smaller vocab is a prefix


def test_austen_end_to_end_from_file(shared_dir, tmp_path, austen_counts):
    path = tmp_path / "austen.txt"
    path.write_text(_corpus_text(shared_dir, "austen"), encoding="utf-8")
    expected = ref.train_from_counts(austen_counts, 1000, [SPECIAL])
    assert _train(path, 1000, [SPECIAL]) == expected
    assert _train([path, path], 1000, [SPECIAL])[1] == ref.train_from_counts(
        {k: 2 * v for k, v in austen_counts.items()}, 1000, [SPECIAL])[1]


@pytest.mark.parametrize(
    ("name", "num_chars", "vocab_size"),
    [("kjv", None, 5000), ("gcide", 2_000_000, 10_000), ("multilingual", 400_000, 3000)],
)
def test_corpus_matches_oracle(shared_dir, name, num_chars, vocab_size):
    counts = ref.count_pretokens([_corpus_text(shared_dir, name, num_chars)], [SPECIAL])
    expected = ref.train_from_counts(counts, vocab_size, [SPECIAL])
    assert train_from_counts(counts, vocab_size, [SPECIAL], show_progress=False) == expected


def test_thread_count_does_not_change_result(shared_dir, tmp_path):
    path = tmp_path / "multi.txt"
    path.write_text(_corpus_text(shared_dir, "multilingual", 300_000), encoding="utf-8")
    results = [_train(path, 1500, [SPECIAL], num_threads=n) for n in (1, 2, 7)]
    assert results[0] == results[1] == results[2]


# --- Hypothesis: small corpora with many ties ----------------------------------------------------

_small_words = st.dictionaries(
    st.binary(min_size=1, max_size=8).map(lambda b: bytes(x % 4 + 0x61 if x < 200 else x for x in b)),
    st.integers(min_value=1, max_value=4),
    max_size=12,
)


@given(word_counts=_small_words, vocab_size=st.integers(min_value=256, max_value=300))
def test_hypothesis_counts_match_oracle(word_counts, vocab_size):
    assert train_from_counts(word_counts, vocab_size, show_progress=False) == ref.train_from_counts(
        word_counts, vocab_size)


_wide_counts = st.dictionaries(
    st.binary(min_size=1, max_size=10).map(lambda b: bytes(x % 3 + 0x61 if x < 220 else x for x in b)),
    st.integers(min_value=0, max_value=40).map(lambda e: 1 + (1 << e) // 3),
    max_size=30,
)


@given(word_counts=_wide_counts, vocab_size=st.integers(min_value=256, max_value=330))
def test_hypothesis_wide_counts_match_oracle(word_counts, vocab_size):
    # Counts over many magnitudes: rare pairs wait outside the heap until the top counts come down.
    assert train_from_counts(word_counts, vocab_size, show_progress=False) == ref.train_from_counts(
        word_counts, vocab_size)


_huge_counts = st.dictionaries(
    st.binary(min_size=1, max_size=6).map(lambda b: bytes(x % 4 + 0x61 for x in b)),
    st.integers(min_value=2**60, max_value=2**63 - 1),
    max_size=6,
)


@given(word_counts=_huge_counts, vocab_size=st.integers(min_value=256, max_value=280))
def test_hypothesis_huge_counts_match_oracle_or_name_the_byte_pair(word_counts, vocab_size):
    # Exact in 64 bits while every byte pair's weighted count fits; else refused, naming such a pair.
    pair_totals = {}
    for word, count in word_counts.items():
        for pair in zip(word, word[1:]):
            pair_totals[pair] = pair_totals.get(pair, 0) + count
    too_big = [pair for pair, total in pair_totals.items() if total > 2**63 - 1]
    if not too_big:
        assert train_from_counts(word_counts, vocab_size, show_progress=False) == ref.train_from_counts(
            word_counts, vocab_size)
        return
    with pytest.raises(ValueError, match=r"word_counts: the byte pair \((\d+), (\d+)\)") as error:
        train_from_counts(word_counts, vocab_size, show_progress=False)
    named = tuple(int(b) for b in re.search(r"\((\d+), (\d+)\)", str(error.value)).groups())
    assert named in too_big


_small_text = st.text(alphabet=st.sampled_from(list("aab ba\n'sé1  \u00a0\u3000日本<|>")), max_size=60)


@given(documents=st.lists(_small_text, min_size=1, max_size=4),
       special_tokens=st.sampled_from([[], ["<|"], ["<|", "<|>"], ["ab", "a"]]),
       vocab_size=st.integers(min_value=258, max_value=320))
def test_hypothesis_text_matches_oracle(documents, special_tokens, vocab_size):
    got = _train(iter(documents), vocab_size, special_tokens)
    counts = ref.count_pretokens(documents, special_tokens)
    assert got == ref.train_from_counts(counts, vocab_size, special_tokens)


def test_ties_go_to_greatest_pair_as_unsigned_bytes():
    # Every pair has count 1: (b"\xff", b"a") is greatest by unsigned bytes (signed would pick (a, ...)).
    vocab, merges = train_from_counts({b"a\xff": 1, b"\xffa": 1, b"ab": 1}, 257, show_progress=False)
    assert merges == [(b"\xff", b"a")]
    # Ties compare (left, right) as a tuple, not the concatenation: (ab, c) beats (a, z).
    _, merges = train_from_counts({b"ab": 10, b"abc": 3, b"az": 3}, 258, show_progress=False)
    assert merges == [(b"a", b"b"), (b"ab", b"c")]


def test_overlapping_pairs_and_left_to_right_merge():
    _, merges = train_from_counts({b"aaa": 1}, 260, show_progress=False)
    assert merges == [(b"a", b"a"), (b"aa", b"a")]  # (a,a) counted twice; "aaa" -> "aa a"
    assert ref.train_from_counts({b"aaaa": 3, b"abab": 1}, 300) == train_from_counts(
        {b"aaaa": 3, b"abab": 1}, 300, show_progress=False)


def test_stops_when_no_pair_is_left():
    vocab, merges = train_from_counts({b"abc": 5, b"d": 7}, 10_000, show_progress=False)
    assert merges == [(b"b", b"c"), (b"a", b"bc")]
    assert len(vocab) == 258
    assert train_from_counts({b"abc": 5}, 2**70, show_progress=False)[1] == merges
    assert train_from_counts({}, 300, show_progress=False) == ({i: bytes([i]) for i in range(256)}, [])


def test_counts_beyond_32_bits():
    word_counts = {b"ab": 2**40 + 1, b"ba": 2**40, b"abab": 3 * 2**32, b"xyxyxy": 2**62 // 8}
    got = train_from_counts(word_counts, 270, show_progress=False)
    assert got == ref.train_from_counts(word_counts, 270)
    assert got[1][0] == (b"x", b"y")  # 3 * 2^59 occurrences beats 2^40-ish


@pytest.mark.parametrize(
    "word_counts",
    [{b"abc": 2**62, b"de": 2**62}, {b"abc": 2**63 - 1, b"xyz": 2**63 - 1, b"pq": 1, b"qpq": 2}],
)
def test_counts_near_2_63_train_while_every_pair_count_fits(word_counts):
    # Pair counts over all words pass 2^63-1, but no single pair's: later pairs never count more
    # than one byte pair does, so training is exact in 64 bits.
    assert train_from_counts(word_counts, 262, show_progress=False) == ref.train_from_counts(word_counts, 262)


def test_a_byte_pair_counted_past_2_63_names_the_pair():
    with pytest.raises(ValueError, match=r"word_counts: the byte pair \(97, 98\) occurs more than 2\^63-1 times"):
        train_from_counts({b"ab": 2**63 - 1, b"xab": 1}, 300, show_progress=False)


# --- Bad input ------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="nope.txt"):
        _train(tmp_path / "nope.txt", 300, [SPECIAL])


def test_directory(tmp_path):
    with pytest.raises((IsADirectoryError, ValueError), match=str(tmp_path.name)):
        _train(tmp_path, 300, [SPECIAL])


def test_invalid_utf8_names_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world\n" * 3 + b"ab\xffcd")
    with pytest.raises(ValueError, match="38"):
        _train(path, 300)
    assert _train(path, 300, errors="replace") == ref.train_from_counts(
        ref.count_pretokens(["hello world\n" * 3 + "ab\ufffdcd"]), 300)
    assert _train(path, 300, errors="ignore") == ref.train_from_counts(
        ref.count_pretokens(["hello world\n" * 3 + "abcd"]), 300)


def test_universal_newlines(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"one two\r\nthree\rfour\n\r\n")
    assert _train(path, 300) == ref.train_from_counts(ref.count_pretokens(["one two\nthree\nfour\n\n"]), 300)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"vocab_size": 256}, ValueError, "vocab_size"),
        ({"vocab_size": 255, "special_tokens": []}, ValueError, "vocab_size"),
        ({"vocab_size": 300.0}, TypeError, "vocab_size"),
        ({"special_tokens": [SPECIAL, SPECIAL]}, ValueError, "special_tokens"),
        ({"special_tokens": [""]}, ValueError, "special_tokens"),
        ({"special_tokens": [b"<|endoftext|>"]}, TypeError, "special_tokens"),
        ({"special_tokens": SPECIAL}, TypeError, "special_tokens"),
        ({"num_threads": 0}, ValueError, "num_threads"),
        ({"errors": "surrogateescape"}, ValueError, "errors"),
    ],
)
def test_bad_arguments(shared_dir, kwargs, error, name):
    arguments = {"vocab_size": 300, "special_tokens": [SPECIAL], **kwargs}
    with pytest.raises(error, match=name):
        _train(_fixture(shared_dir, "german.txt"), **arguments)


def test_special_tokens_none_means_none(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("low lower lowest newer wider " * 40)
    assert _train(path, 300, special_tokens=None) == _train(path, 300, special_tokens=[])
    counts = {b"low": 5, b" lower": 2}
    assert train_from_counts(counts, 260, None, show_progress=False) == train_from_counts(
        counts, 260, [], show_progress=False)


@pytest.mark.parametrize(
    ("word_counts", "error"),
    [({"ab": 1}, TypeError), ({b"ab": 1.0}, TypeError), ({b"ab": 0}, ValueError), ({b"ab": 2**63}, ValueError),
     ([(b"ab", 1)], TypeError)],
)
def test_bad_word_counts(word_counts, error):
    with pytest.raises(error, match="word_counts"):
        train_from_counts(word_counts, 300, show_progress=False)


def test_show_progress_must_be_bool():
    for call in (lambda: train_from_counts({b"ab": 2}, 300, show_progress="no"),
                 lambda: train_bpe(iter(["ab"]), 300, show_progress=1)):
        with pytest.raises(TypeError, match="show_progress must be a bool"):
            call()


def test_progress_goes_through_logging(shared_dir, caplog, monkeypatch):
    from trainfast._util import Progress

    monkeypatch.setattr(Progress, "LOG_INTERVAL_S", 0.0)  # every report becomes a line
    with caplog.at_level(logging.INFO, logger="trainfast.bpe"):
        train_bpe(_fixture(shared_dir, "corpus.en"), 500, [SPECIAL], show_progress=True)
    messages = [record.getMessage() for record in caplog.records]
    assert any(re.fullmatch(r"pre-tokenizing: [\d.]+ MB of [\d.,]+ MB", m) for m in messages), messages
    assert any(re.fullmatch(r"bpe: 243/243 merges", m) for m in messages), messages
    assert any(re.fullmatch(r"bpe: 243 merges in [\d.]+ s", m) for m in messages), messages


def test_merges_are_reported_while_they_run(caplog, monkeypatch):
    import random

    from trainfast._util import Progress

    monkeypatch.setattr(Progress, "LOG_INTERVAL_S", 0.0)
    rng = random.Random(0)
    letters = bytes(97 + i % 26 for i in range(256))
    blob = rng.randbytes(200_000 * 16).translate(letters)
    word_counts = {blob[i:i + 4 + i % 17]: 1 + i % 997 for i in range(0, len(blob), 16)}  # ~0.7 s of merges
    with caplog.at_level(logging.INFO, logger="trainfast.bpe"):
        _, merges = train_from_counts(word_counts, 200_256, show_progress=True)
    pattern = re.compile(r"bpe: ([\d,]+)/200,000 merges")
    done = [int(m.group(1).replace(",", "")) for m in map(pattern.fullmatch, caplog.messages) if m]
    # The native loop calls back every 0.1 s: counts that grow, before the last one.
    assert len(done) > 1 and done == sorted(done) and done[0] < done[-1] == len(merges), caplog.messages


def test_cli_train(shared_dir, tmp_path):
    from trainfast.cli import main

    out = tmp_path / "tok"
    assert main(["bpe", "train", str(_fixture(shared_dir, "corpus.en")), "--vocab-size", "500",
                 "--special-token", SPECIAL, "--out", str(out), "--no-progress"]) == 0
    vocab, merges = load(out)
    assert merges == _reference_merges(shared_dir)
    assert vocab[256] == SPECIAL.encode()


def test_cli_train_refuses_before_training(shared_dir, tmp_path, caplog, capsys, monkeypatch):
    from trainfast.bpe import train as train_module
    from trainfast.cli import main

    corpus = str(_fixture(shared_dir, "corpus.en"))
    assert main(["bpe", "count", corpus, "--out", str(tmp_path / "c.tfwc"), "--special-token", "a",
                 "--no-progress"]) == 0
    assert main(["bpe", "count", corpus, "--out", str(tmp_path / "ok.tfwc"), "--no-progress"]) == 0

    def no_training(*args, **kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(train_module, "_train", no_training)  # train_bpe's and train_from_counts' merge loop
    (tmp_path / "file").write_text("x")
    cases = [
        (["bpe", "train", corpus, "--out", str(tmp_path / "file")], "--out .* is not a directory"),
        (["bpe", "train", corpus, "--out", str(tmp_path / "file" / "sub")], "is not a directory"),
        (["bpe", "train", corpus, "--special-token", "a", "--out", str(tmp_path / "o")], "'a' is one byte"),
        (["bpe", "train", corpus, "--out", ""], "--out must not be empty"),
        (["bpe", "train", "--from-counts", str(tmp_path / "ok.tfwc"), "--out", str(tmp_path / "file")],
         "--out .* is not a directory"),
        # The counts' own special tokens are checked as well as --special-token.
        (["bpe", "train", "--from-counts", str(tmp_path / "c.tfwc"), "--out", str(tmp_path / "o")], "'a' is one byte"),
    ]
    for argv, message in cases:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="trainfast"):
            assert main([*argv, "--vocab-size", "300", "--no-progress"]) == 2, argv
        assert re.search(message, caplog.text), (argv, caplog.text)
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # argparse's usage error names the flag
        main(["bpe", "train", corpus, "--threads", "two", "--vocab-size", "300", "--out", str(tmp_path / "o")])
    assert "argument --threads: must be an int (got 'two')" in capsys.readouterr().err


def test_ctrl_c_raises_keyboard_interrupt(sigint_repeatedly):
    import random

    rng = random.Random(0)
    letters = bytes(97 + i % 26 for i in range(256))
    blob = rng.randbytes(200_000 * 16).translate(letters)
    word_counts = {blob[i:i + 4 + i % 17]: 1 + i % 997 for i in range(0, len(blob), 16)}  # seconds of merges
    with pytest.raises(KeyboardInterrupt), sigint_repeatedly(0.1):
        train_from_counts(word_counts, 200_000, show_progress=False)


@pytest.mark.parametrize("pattern", ["cl100k", "o200k", r"\S+|\s+"])
def test_other_patterns(shared_dir, pattern, tmp_path):
    # German plus lines on which the three named patterns cut differently (case splits, contractions,
    # digit runs), so that the merges tell them apart.
    path = tmp_path / "mixed.txt"
    path.write_text(_fixture(shared_dir, "german.txt").read_text(encoding="utf-8")
                    + " camelCaseWord don't WE'LL 12345\n" * 40, encoding="utf-8")
    others = {name: _train(path, 350, [SPECIAL], pattern=name)[1] for name in PATTERNS if name != pattern}
    vocab, merges = _train(path, 350, [SPECIAL], pattern=pattern)
    assert len(merges) > 0 and len(vocab) == 257 + len(merges)
    # The oracle with the pattern's text: the named scanners (not mixed up) and the regex fallback.
    assert (vocab, merges) == ref.train_bpe(path, 350, [SPECIAL], pattern=PATTERNS.get(pattern, pattern))
    assert all(merges != other for other in others.values())
    # Compiled, as pretokenize and count_pretokens take it (a named one runs the native scanner).
    compiled = regex.compile(PATTERNS.get(pattern, pattern))
    assert _train(path, 350, [SPECIAL], pattern=compiled) == (vocab, merges)


def _failing_fsync(monkeypatch, fail_on_call: int):
    """os.fsync raising OSError (a full disk) on its fail_on_call-th call, the earlier ones working."""
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == fail_on_call:
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("fail_on_call", [1, 2])  # while writing vocab.json, then merges.txt
def test_save_that_fails_midway_leaves_no_partial_file(shared_dir, tmp_path, monkeypatch, fail_on_call):
    from trainfast.bpe import WordCounts, count_words
    from trainfast.bpe.export import to_hf_tokenizer_json

    old_vocab, old_merges = _train(_fixture(shared_dir, "corpus.en"), 300, [SPECIAL])
    new_vocab, new_merges = _train(_fixture(shared_dir, "corpus.en"), 320, [SPECIAL])
    save(new_vocab, new_merges, tmp_path / "new")
    new_vocab_json = (tmp_path / "new" / "vocab.json").read_bytes()
    tmp_path = tmp_path / "out"
    save(old_vocab, old_merges, tmp_path)
    counts = count_words(iter(["hello world"]), show_progress=False)
    counts.save(tmp_path / "counts.bin")
    to_hf_tokenizer_json(old_vocab, old_merges, [SPECIAL], tmp_path / "tokenizer.json")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}

    _failing_fsync(monkeypatch, fail_on_call)
    with pytest.raises(OSError, match="No space left"):
        save(new_vocab, new_merges, tmp_path)
    _failing_fsync(monkeypatch, 1)
    with pytest.raises(OSError, match="No space left"):
        count_words(iter(["other words"]), show_progress=False).save(tmp_path / "counts.bin")
    _failing_fsync(monkeypatch, 1)
    with pytest.raises(OSError, match="No space left"):
        to_hf_tokenizer_json(new_vocab, new_merges, [SPECIAL], tmp_path / "tokenizer.json")

    after = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    # Even when merges.txt failed after vocab.json was written, neither was replaced (the pair
    # belongs together); every file as it was, and no temp file left beside them.
    assert after == before
    save(new_vocab, new_merges, tmp_path)
    assert (tmp_path / "vocab.json").read_bytes() == new_vocab_json
    assert WordCounts.load(tmp_path / "counts.bin").counts == counts.counts


def test_a_one_byte_special_token_is_kept_and_logged(caplog):
    # CS336 makes the same vocab (the byte twice); save() cannot write it, so the trainer says so.
    with caplog.at_level(logging.WARNING, logger="trainfast.bpe"):
        vocab, _ = train_bpe(iter(["a|b|c a|b"]), 262, ["|"], show_progress=False)
    assert vocab[124] == vocab[256] == b"|"
    assert "special token '|' is one byte" in caplog.text
