"""Exports load in the real libraries and encode exactly as trainfast.bpe.Tokenizer does."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest
import tiktoken
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from reference.bpe_tokenizer import ReferenceTokenizer, gpt2_ranks_from_fixtures
from trainfast.bpe import Tokenizer, save, train_bpe
from trainfast.bpe.export import to_hf_tokenizer_json, to_tiktoken

EOT = "<|endoftext|>"


def _fixture(shared_dir: Path, name: str) -> Path:
    return shared_dir / "fixtures" / "cs336" / name


def _corpus(shared_dir: Path, name: str, num_chars: int) -> str:
    with lzma.open(shared_dir / "corpora" / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read(num_chars)


@pytest.fixture(scope="module")
def gpt2(shared_dir) -> Tokenizer:
    return Tokenizer.from_files(_fixture(shared_dir, "gpt2_vocab.json"), _fixture(shared_dir, "gpt2_merges.txt"),
                                [EOT])


@pytest.fixture(scope="module")
def gpt2_hf(gpt2, tmp_path_factory) -> tokenizers.Tokenizer:
    path = to_hf_tokenizer_json(gpt2.vocab, gpt2.merges, [EOT], tmp_path_factory.mktemp("hf") / "tokenizer.json")
    return tokenizers.Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def gpt2_tiktoken(gpt2):
    return to_tiktoken(gpt2.vocab, gpt2.merges, [EOT], "gpt2")


def _hf_ids(hf: tokenizers.Tokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def test_gpt2_tiktoken_ranks_are_gpt2s(shared_dir, gpt2_tiktoken):
    ranks, encoding = gpt2_tiktoken
    assert ranks == gpt2_ranks_from_fixtures(_fixture(shared_dir, "gpt2_vocab.json"))
    assert encoding.n_vocab == 50257 and encoding.eot_token == 50256


@pytest.mark.parametrize("name", ["address.txt", "german.txt", "tinystories_sample.txt", "corpus.en",
                                  "special_token_double_newlines_non_whitespace.txt"])
def test_gpt2_exports_encode_fixtures_identically(shared_dir, gpt2, gpt2_hf, gpt2_tiktoken, name):
    text = _fixture(shared_dir, name).read_text(encoding="utf-8")
    ids = gpt2.encode(text)
    assert _hf_ids(gpt2_hf, text) == ids
    assert gpt2_tiktoken[1].encode(text, allowed_special="all") == ids
    assert gpt2_hf.decode(ids, skip_special_tokens=False) == text == gpt2_tiktoken[1].decode(ids)


@pytest.mark.parametrize("name", ["austen", "kjv", "multilingual", "gcide"])
def test_gpt2_exports_encode_corpora_identically(shared_dir, gpt2, gpt2_hf, gpt2_tiktoken, name):
    text = _corpus(shared_dir, name, 1_000_000)
    ids = gpt2.encode(text)
    assert _hf_ids(gpt2_hf, text) == ids
    assert gpt2_tiktoken[1].encode(text, allowed_special="all") == ids


_texts = st.lists(st.sampled_from(list("aZ9 '\n\t.,!") + ["  ", "\n\n", "'s", "é", "中", "😀", "\u00a0", EOT]),
                  max_size=40).map("".join)


@given(text=st.one_of(_texts, st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)))
def test_gpt2_exports_hypothesis(gpt2, gpt2_hf, gpt2_tiktoken, text):
    ids = gpt2.encode(text)
    assert _hf_ids(gpt2_hf, text) == ids
    assert gpt2_tiktoken[1].encode(text, allowed_special="all") == ids


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
def test_trained_vocab_exports(shared_dir, tmp_path, pattern):
    train_text = _corpus(shared_dir, "austen", 300_000) + EOT + _corpus(shared_dir, "multilingual", 200_000)
    specials = [EOT, EOT + EOT, "<|pad|>"]
    vocab, merges = train_bpe(iter([train_text]), 1500, specials, pattern=pattern, show_progress=False)
    tok = Tokenizer(vocab, merges, specials, pattern=pattern)
    hf = tokenizers.Tokenizer.from_file(str(to_hf_tokenizer_json(vocab, merges, specials, tmp_path / "t.json",
                                                                 pattern=pattern)))
    ranks, encoding = to_tiktoken(vocab, merges, specials, pattern)
    assert ranks == {token: idx for idx, token in vocab.items() if token.decode("utf-8", "replace") not in specials}
    text = _corpus(shared_dir, "multilingual", 400_000) + f"a{EOT}{EOT}{EOT} <|pad|>\n 1234567 x"
    ids = tok.encode(text)
    assert _hf_ids(hf, text) == ids
    assert encoding.encode(text, allowed_special="all") == ids
    assert hf.decode(ids, skip_special_tokens=False) == text == encoding.decode(ids)


def test_special_tokens_of_any_spelling(shared_dir, tmp_path):
    # Spaces, newlines and characters outside GPT-2's byte map: HF must find them under their own
    # text (not the byte-mapped one), or it gives them new ids past the vocab.
    specials = ["<|end of text|>", "<|eot|>\n", "<|€ 中|>", "a é"]
    vocab, merges = train_bpe(iter([_corpus(shared_dir, "austen", 100_000)]), 600, specials, show_progress=False)
    tok = Tokenizer(vocab, merges, specials)
    hf = tokenizers.Tokenizer.from_file(str(to_hf_tokenizer_json(vocab, merges, specials, tmp_path / "t.json")))
    _, encoding = to_tiktoken(vocab, merges, specials)
    text = "The end<|end of text|>x<|eot|>\n\nof <|€ 中|> a é, and a  é."
    ids = tok.encode(text)
    assert hf.get_vocab_size() == len(vocab)
    assert _hf_ids(hf, text) == ids == encoding.encode(text, allowed_special="all")
    assert hf.decode(ids, skip_special_tokens=False) == text == encoding.decode(ids)


def test_one_byte_special_token(shared_dir, tmp_path):
    # train_bpe (like CS336's) gives a one-byte special token its own id beside its byte's.
    vocab, merges = train_bpe(iter([_corpus(shared_dir, "austen", 100_000) + "|a|b"]), 400, ["|"],
                              show_progress=False)
    assert vocab[ord("|")] == vocab[256] == b"|"
    tok = Tokenizer(vocab, merges, ["|"])
    text = "x | y|z"
    assert tok.encode(text) == ReferenceTokenizer(vocab, merges, ["|"]).encode(text)
    assert tok.encode("|") == [256] and tok.decode([ord("|"), 256]) == "||"
    _, encoding = to_tiktoken(vocab, merges, ["|"])
    assert encoding.encode(text, allowed_special="all") == tok.encode(text)
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = '\|' is also an ordinary vocab token \(ids \[124, 256\]\)"):
        to_hf_tokenizer_json(vocab, merges, ["|"], tmp_path / "t.json")
    with pytest.raises(ValueError, match="ids 124 and 256 to the same token"):
        save(vocab, merges, tmp_path / "out")
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "out" / "vocab.json").exists()


def test_hf_json_layout(gpt2, tmp_path):
    path = to_hf_tokenizer_json(gpt2.vocab, gpt2.merges, [EOT], tmp_path / "sub" / "tokenizer.json")
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                         "use_regex": True}
    assert document["model"]["type"] == "BPE" and len(document["model"]["merges"]) == 50000
    assert document["added_tokens"][0]["content"] == EOT and document["added_tokens"][0]["id"] == 50256
    assert document["model"]["vocab"]["Ġthe"] == 262
    assert not list(path.parent.glob(".*tmp"))


# --- bad input -----------------------------------------------------------------------------------


def _byte_vocab() -> dict[int, bytes]:
    return {i: bytes([i]) for i in range(256)}


def test_special_tokens_must_be_in_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = '<\|x\|>' is not in vocab"):
        to_hf_tokenizer_json(_byte_vocab(), [], ["<|x|>"], tmp_path / "t.json")
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = '<\|x\|>' is not in vocab"):
        to_tiktoken(_byte_vocab(), [], ["<|x|>"])
    assert not (tmp_path / "t.json").exists()


def test_hf_refuses_specials_it_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = 'éé' would decode as other bytes"):
        to_hf_tokenizer_json({**_byte_vocab(), 256: "éé".encode()}, [], ["éé"], tmp_path / "t.json")
    vocab = {**_byte_vocab(), 256: b" b", 257: b"a b"}
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = 'a b' is also in a merge, spelled 'aĠb' there"):
        to_hf_tokenizer_json(vocab, [(b" ", b"b"), (b"a", b" b")], ["a b"], tmp_path / "t.json")
    with pytest.raises(ValueError, match=r"special_tokens\[0\] = '\\n' is also in a merge, spelled 'Ċ' there"):
        to_hf_tokenizer_json({**_byte_vocab(), 256: b"\n\n"}, [(b"\n", b"\n")], ["\n"], tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_bad_merges_and_paths(tmp_path):
    with pytest.raises(ValueError, match=r"merges\[0\].*unknown token"):
        to_hf_tokenizer_json(_byte_vocab(), [(b"a", b"b")], [], tmp_path / "t.json")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        to_hf_tokenizer_json(_byte_vocab(), [], [], tmp_path)
    with pytest.raises(ValueError, match="possessive counted repeat"):
        to_hf_tokenizer_json(_byte_vocab(), [], [], tmp_path / "t.json", pattern=r"\p{N}{1,2}+|\s+|\S")
    with pytest.raises(ValueError, match="unknown pattern name"):
        to_hf_tokenizer_json(_byte_vocab(), [], [], tmp_path / "t.json", pattern="gpt4")


def test_tiktoken_needs_rank_order():
    vocab = {**_byte_vocab(), 256: b"ab", 257: b"cd"}
    with pytest.raises(ValueError, match=r"merges\[1\] makes id 256, not above the previous merge's id 257"):
        to_tiktoken(vocab, [(b"c", b"d"), (b"a", b"b")])
    with pytest.raises(ValueError, match=r"makes b'ab' again"):
        to_tiktoken({**vocab, 258: b"aab"}, [(b"a", b"b"), (b"a", b"b")])
    with pytest.raises(ValueError, match=r"vocab\[257\] = b'cd' is neither a byte, a merge result"):
        to_tiktoken(vocab, [(b"a", b"b")])
    ranks, encoding = to_tiktoken(vocab, [(b"a", b"b"), (b"c", b"d")])
    assert encoding.encode("abcd") == Tokenizer(vocab, [(b"a", b"b"), (b"c", b"d")]).encode("abcd") == [256, 257]
    assert isinstance(encoding, tiktoken.Encoding)


def _tiktoken_match(vocab: dict[int, bytes], specials: list[str], text: str) -> list[int]:
    """tiktoken's ids for `text`, built as to_tiktoken builds it (specials inserted in list order):
    which of two prefix-related specials it tries first is its hash map's order (of the tokens and
    their insertion order), which a tiktoken release may change."""
    from tiktoken_ext.openai_public import r50k_pat_str

    ids = {token: token_id for token_id, token in vocab.items()}
    encoding = tiktoken.Encoding("probe", pat_str=r50k_pat_str, mergeable_ranks={bytes([i]): i for i in range(256)},
                                 special_tokens={token: ids[token.encode()] for token in specials})
    return encoding.encode(text, allowed_special="all")


@pytest.mark.parametrize("specials", [["<|a", "<|a|>"], ["<|a|>", "<|a"]])
def test_tiktoken_prefix_special_tokens(specials):
    # Refused exactly when tiktoken would match the shorter token inside the longer one; otherwise the
    # encoding must give each its own id (whichever order this tiktoken version tries them in).
    vocab = {**_byte_vocab(), 256: b"<|a", 257: b"<|a|>"}
    if _tiktoken_match(vocab, specials, "<|a|>") != [257]:
        with pytest.raises(ValueError, match=r"special token '<\|a\|>' starts with special token '<\|a'"):
            to_tiktoken(vocab, [], specials)
    else:
        _, encoding = to_tiktoken(vocab, [], specials)
        assert encoding.encode("z<|a|>z<|a", allowed_special="all") == [ord("z"), 257, ord("z"), 256]


def test_tiktoken_prefix_error_names_the_token_tiktoken_matched():
    # "xbc" has two special prefixes; the error must name the one tiktoken matches, not the first listed.
    vocab = {**_byte_vocab(), 256: b"x", 257: b"xb", 258: b"xbc"}
    specials = ["x", "xb", "xbc"]
    first_ids = {token: _tiktoken_match(vocab, specials, token) for token in specials}
    refused = [(token, vocab[ids[0]].decode()) for token, ids in first_ids.items()
               if ids != [256 + specials.index(token)]]
    if not refused:
        assert to_tiktoken(vocab, [], specials)[1].encode("xbcxbx", allowed_special="all") == [258, 257, 256]
        return
    token, matched = refused[0]
    with pytest.raises(ValueError, match=f"special token '{token}' starts with special token '{matched}',"):
        to_tiktoken(vocab, [], specials)


def test_to_tiktoken_without_tiktoken_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # what an absent package looks like to import
    vocab = {b: bytes([b]) for b in range(256)}
    with pytest.raises(ImportError, match=r"pip install tiktoken"):
        to_tiktoken(vocab, [])
