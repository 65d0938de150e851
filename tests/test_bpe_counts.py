"""WordCounts (count, add, serialize), train_from_counts == train_bpe, distributed counting on gloo."""

from __future__ import annotations

import logging
import lzma
import multiprocessing
import pickle
import struct
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainfast.bpe import count_pretokens, train_bpe
from trainfast.bpe import distributed
from trainfast.bpe.counts import WordCounts, count_words, train_from_counts

EOT = "<|endoftext|>"


def _fixture(shared_dir: Path, name: str) -> Path:
    return shared_dir / "fixtures" / "cs336" / name


@pytest.fixture(scope="module")
def parts(shared_dir, tmp_path_factory) -> list[Path]:
    """Five text files cut from the corpora (different sizes, specials, languages)."""
    out = tmp_path_factory.mktemp("parts")
    paths = []
    for idx, (name, start, size) in enumerate([("austen", 0, 120_000), ("kjv", 5000, 60_000),
                                               ("multilingual", 100_000, 90_000), ("gcide", 0, 30_000),
                                               ("austen", 700_000, 10_000)]):
        with lzma.open(shared_dir / "corpora" / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
            text = f.read(start + size)[start:]
        path = out / f"part{idx}.txt"
        path.write_text(text + f"\n{EOT}\n", encoding="utf-8")
        paths.append(path)
    return paths


def test_count_words_equals_count_pretokens(parts):
    counts = count_words(parts, [EOT], show_progress=False)
    assert counts.counts == count_pretokens(parts, special_tokens=(EOT,), show_progress=False)
    assert counts.pattern == "gpt2" and counts.special_tokens == (EOT,)
    assert counts.total == sum(counts.counts.values()) and len(counts) == len(counts.counts)


def test_addition_equals_counting_everything(parts):
    whole = count_words(parts, [EOT], show_progress=False)
    pieces = [count_words([p], [EOT], show_progress=False) for p in parts]
    total = pieces[0] + pieces[1]
    for piece in pieces[2:]:
        total += piece
    assert total.counts == whole.counts  # same items (order may differ)
    assert sorted((pieces[3] + pieces[1]).items()) == sorted((pieces[1] + pieces[3]).items())
    assert pieces[0] + WordCounts(special_tokens=[EOT]) == pieces[0]


@pytest.mark.parametrize("pattern", ["gpt2", "o200k"])
def test_train_from_counts_equals_train_bpe(parts, pattern):
    expected = train_bpe(parts, 900, [EOT], pattern=pattern, show_progress=False)
    counts = sum((count_words([p], [EOT], pattern=pattern, show_progress=False) for p in parts[1:]),
                 count_words([parts[0]], [EOT], pattern=pattern, show_progress=False))
    assert train_from_counts(counts, 900, show_progress=False) == expected
    assert train_from_counts(WordCounts.from_bytes(counts.to_bytes()), 900, [EOT], show_progress=False) == expected
    assert train_from_counts(counts.counts, 900, [EOT], show_progress=False) == expected
    numpy_counts = {word: np.int64(count) for word, count in counts.counts.items()}
    assert train_from_counts(numpy_counts, 900, [EOT], show_progress=False) == expected


def test_train_from_counts_changed_by_index():
    counts: dict = {b"ab": 3, b"cd": 2}

    class Evil:
        def __index__(self):
            counts.clear()  # frees the words read so far unless the reader holds them
            return 5

    counts[b"ef"] = Evil()
    with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
        train_from_counts(counts, 300, show_progress=False)


def test_cs336_reference_merges_from_counts(shared_dir):
    from trainfast.bpe.io import bytes_to_unicode

    table = {c: b for b, c in bytes_to_unicode().items()}
    lines = _fixture(shared_dir, "train-bpe-reference-merges.txt").read_text(encoding="utf-8").splitlines()
    reference = [tuple(bytes(table[c] for c in part) for part in line.split(" ")) for line in lines]
    counts = count_words(_fixture(shared_dir, "corpus.en"), [EOT], show_progress=False)
    _, merges = train_from_counts(counts, 500, show_progress=False)
    assert merges == reference


def test_serialization_round_trip(parts, tmp_path):
    counts = count_words(parts[:2], [EOT, "<|pad|>"], pattern="cl100k", show_progress=False)
    data = counts.to_bytes()
    again = WordCounts.from_bytes(data)
    assert again == counts and list(again.counts) == list(counts.counts)  # order kept
    path = counts.save(tmp_path / "sub" / "c.tfwc")
    assert WordCounts.load(path) == counts
    assert WordCounts.from_bytes(WordCounts().to_bytes()) == WordCounts()
    big = WordCounts({b"a": 2**63 - 1, b"\x00\xff": 1})
    assert WordCounts.from_bytes(big.to_bytes()).counts == {b"a": 2**63 - 1, b"\x00\xff": 1}


# --- bad input -----------------------------------------------------------------------------------


def test_pattern_spellings_add_up(parts):
    from trainfast.bpe.pretokenize import PATTERNS

    by_name = count_words(parts[:1], [EOT], pattern="cl100k", show_progress=False)
    by_alias = count_words(parts[1:2], [EOT], pattern="cl100k_base", show_progress=False)
    by_regex = count_words(parts[:1], [EOT], pattern=PATTERNS["cl100k"], show_progress=False)
    assert by_regex == by_name
    assert (by_name + by_alias).counts == count_words(parts[:2], [EOT], pattern="cl100k", show_progress=False).counts


def test_train_from_counts_special_tokens_read_once_and_checked(parts):
    counts = count_words(parts, [EOT], show_progress=False)
    expected = train_from_counts(counts, 600, show_progress=False)
    # A one-shot iterable: compared with the counts' tokens, then trained with, not used up first.
    assert train_from_counts(counts, 600, iter([EOT]), show_progress=False) == expected
    assert train_from_counts(counts.counts, 600, iter([EOT]), show_progress=False) == expected
    for word_counts in (counts, counts.counts):
        with pytest.raises(TypeError, match="not a single str"):
            train_from_counts(word_counts, 600, EOT, show_progress=False)
    with pytest.raises(ValueError, match="repeats an earlier special token"):
        train_from_counts(counts.counts, 600, [EOT, EOT], show_progress=False)


def test_mismatched_settings(parts):
    a = count_words(parts[:1], [EOT], show_progress=False)
    with pytest.raises(ValueError, match="different settings"):
        _ = a + count_words(parts[:1], [], show_progress=False)
    with pytest.raises(ValueError, match="different settings"):
        _ = a + count_words(parts[:1], [EOT], pattern="cl100k", show_progress=False)
    with pytest.raises(ValueError, match="special_tokens .* differ from those the counts were taken with"):
        train_from_counts(a, 600, ["<|pad|>"], show_progress=False)
    with pytest.raises(TypeError, match="word_counts must be a WordCounts"):
        train_from_counts([1, 2], 600)
    with pytest.raises(ValueError, match="vocab_size"):
        train_from_counts(a, 10, show_progress=False)
    with pytest.raises(OverflowError, match="exceeds 2\\^63-1"):
        _ = WordCounts({b"a": 2**62}) + WordCounts({b"a": 2**62})
    with pytest.raises(ValueError, match="exceeds 2\\^63-1"):  # the package's bad-input error type too
        _ = WordCounts({b"a": 2**62}) + WordCounts({b"a": 2**62})
    total = WordCounts({b"aa": 1, b"zz": 2**63 - 1})
    with pytest.raises(OverflowError, match="exceeds 2\\^63-1"):
        total += WordCounts({b"aa": 5, b"zz": 1})
    assert total.counts == {b"aa": 1, b"zz": 2**63 - 1}  # a failed += adds nothing
    with pytest.raises(ValueError, match=r"special_tokens\[0\] contains a lone surrogate"):
        train_from_counts({b"ab": 3}, 300, ["\ud800"], show_progress=False)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"counts\[b'a'\] must be in \[1, 2\^63-1\]"):
        WordCounts({b"a": 0})
    with pytest.raises(TypeError, match="keys must be non-empty bytes"):
        WordCounts({"a": 1})
    with pytest.raises(TypeError, match=r"counts\[b'a'\] must be an int"):
        WordCounts({b"a": 1.5})
    with pytest.raises(TypeError, match="pattern must be a str"):
        WordCounts(pattern=3)
    with pytest.raises(ValueError, match="repeats"):
        count_words([Path("x")], [EOT, EOT])


def _blob(header: dict | bytes, lengths: list[int], counts: list[int], words: bytes, version: int = 1) -> bytes:
    import json

    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = struct.pack("<4sII", b"TFWC", version, len(head)) + head + struct.pack(f"<{len(lengths)}I", *lengths) + \
        struct.pack(f"<{len(counts)}q", *counts) + words
    return body + struct.pack("<I", zlib.crc32(body))


def test_corrupt_count_files(tmp_path):
    good = WordCounts({b"ab": 3, b"c": 1}).to_bytes()
    header = {"pattern": "gpt2", "special_tokens": [], "num_words": 2}
    cases = [
        (b"", "too short"),
        (b"XXXX" + good[4:], "bad magic"),
        (good[:-1] + bytes([good[-1] ^ 1]), "checksum mismatch"),
        (good[:-5] + good[-4:], "checksum mismatch"),
        (_blob(header, [2, 1], [3, 1], b"abc", version=2), "unsupported version 2"),
        (_blob(b"{not json", [2, 1], [3, 1], b"abc"), "unreadable header"),
        (_blob({"pattern": "gpt2"}, [2, 1], [3, 1], b"abc"), "unreadable header"),
        (_blob({**header, "num_words": -1}, [2, 1], [3, 1], b"abc"), "malformed header"),
        (_blob({**header, "num_words": 10**9}, [2, 1], [3, 1], b"abc"), "do not fit"),
        (_blob(header, [2, 0], [3, 1], b"ab"), "empty or has a count below 1"),
        (_blob(header, [2, 1], [3, -5], b"abc"), "empty or has a count below 1"),
        (_blob(header, [2, 1], [3, 1], b"abcd"), "word bytes take 3 bytes, the file has 4"),
        (_blob(header, [1, 1], [3, 1], b"aa"), "appears twice"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            WordCounts.from_bytes(data)
    path = tmp_path / "bad.tfwc"
    path.write_bytes(good[:20])
    with pytest.raises(ValueError, match=r"counts file '.*bad.tfwc' is not a valid WordCounts file"):
        WordCounts.load(path)


@given(data=st.binary(max_size=200), position=st.integers(0, 10**6), value=st.integers(0, 255))
def test_random_corruption_never_crashes(data, position, value):
    good = bytearray(WordCounts({b"hello": 7, b" world": 2, b"\xe4\xb8": 1}, special_tokens=[EOT]).to_bytes())
    good[position % len(good)] = value
    for blob in (bytes(good), data, bytes(good[: position % len(good)])):
        try:
            WordCounts.from_bytes(blob)
        except ValueError:
            pass


# --- distributed ---------------------------------------------------------------------------------


def _dist_worker(rank: int, world_size: int, init_file: str, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Every message, sent and received, within max_message_bytes (the 8-byte size header aside).
        sizes = {"send": [], "recv": []}
        send, recv = dist.send, dist.recv

        def recording(kind, call):
            def record(tensor, *args, **kwargs):
                sizes[kind].append(tensor.numel() * tensor.element_size())
                return call(tensor, *args, **kwargs)
            return record

        dist.send, dist.recv = recording("send", send), recording("recv", recv)
        # show_progress=False (the default) logs nothing, summary lines included.
        logger = logging.getLogger("trainfast")
        records: list = []
        handler = logging.Handler(logging.INFO)
        handler.emit = records.append
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            try:
                counts = distributed.count_words(paths, [EOT], max_message_bytes=5000)
            finally:
                dist.send, dist.recv = send, recv
            result["logged_silently"] = [record.getMessage() for record in records]
            distributed.count_words(paths[:2], [EOT], show_progress=True)
            result["logged_with_progress"] = [record.getMessage() for record in records]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)
        result["message_sizes"] = sizes
        result["counts"] = None if counts is None else counts.to_bytes()
        result["trained"] = distributed.train_bpe(paths, 800, [EOT], max_message_bytes=1 << 20)
        result["no_specials"] = distributed.train_bpe(paths, 300, None)  # None: no special tokens
        subgroup = dist.new_group([1, 2])  # every rank must create it
        if rank in (1, 2):
            sub = distributed.count_words(paths[:3], [EOT], group=subgroup)
            result["sub"] = None if sub is None else sub.to_bytes()
        bad = paths + [str(Path(out_dir) / "invalid.txt")]
        try:
            distributed.train_bpe(bad, 800, [EOT])
        except (ValueError, RuntimeError) as error:
            result["error"] = str(error)
        # A file missing on one rank only (a node without the shared mount): every rank hears of it.
        local_paths = paths[:-1] + [str(Path(out_dir) / "missing_on_rank_2.txt")] if rank == 2 else paths
        try:
            distributed.train_bpe(local_paths, 800, [EOT])
        except (FileNotFoundError, RuntimeError) as error:
            result["missing"] = str(error)
        # Training fails on src with an error other than ValueError/TypeError: every rank hears of it.
        train = distributed.train_from_counts
        if rank == 0:
            def out_of_memory(*args, **kwargs):
                raise MemoryError("no room for the merges")
            distributed.train_from_counts = out_of_memory
        try:
            distributed.train_bpe(paths, 800, [EOT])
        except RuntimeError as error:
            result["train_error"] = str(error)
        distributed.train_from_counts = train
        # Counts from rank 1 that dst cannot add: dst still receives rank 2's, then reports rank 1.
        from_bytes = distributed.WordCounts.from_bytes
        if rank == 0:
            def corrupt(blob, source="counts"):
                if "rank 1" in source:
                    raise ValueError(f"{source}: corrupt")
                return from_bytes(blob, source=source)
            distributed.WordCounts.from_bytes = corrupt
        try:
            result["merge"] = distributed.count_words(paths, [EOT])
        except RuntimeError as error:
            result["merge"] = str(error)
        distributed.WordCounts.from_bytes = from_bytes
        dist.destroy_process_group()
    except BaseException:  # report to the test process
        result["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def test_distributed_equals_single_process(parts, tmp_path):
    world_size = 3
    (tmp_path / "invalid.txt").write_bytes(b"ok \xff\xfe not utf-8")
    paths = [str(p) for p in parts]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_dist_worker, args=(r, world_size, str(tmp_path / "init"), paths, str(tmp_path)))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    assert not alive, "distributed workers hung"
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    for r, result in enumerate(results):
        assert "crash" not in result, f"rank {r}: {result['crash']}"
    single = count_words([Path(p) for p in paths], [EOT], show_progress=False)
    assert WordCounts.from_bytes(results[0]["counts"]).counts == single.counts
    for r, result in enumerate(results):
        messages = result["message_sizes"]["recv" if r == 0 else "send"]
        assert messages[0] == 8 and max(messages[1:]) == 5000 and sum(messages[1:]) > 5000, (r, messages)
    assert len(results[0]["message_sizes"]["recv"]) == sum(len(r["message_sizes"]["send"]) for r in results[1:])
    assert results[1]["counts"] is None and results[2]["counts"] is None
    for r, result in enumerate(results):
        assert result["logged_silently"] == [], (r, result["logged_silently"])
        assert any(f"bpe: rank {r} counted " in line for line in result["logged_with_progress"]), result
    expected = train_bpe([Path(p) for p in paths], 800, [EOT], show_progress=False)
    assert all(result["trained"] == expected for result in results)
    no_specials = train_bpe([Path(p) for p in paths], 300, [], show_progress=False)
    assert all(result["no_specials"] == no_specials for result in results)
    assert WordCounts.from_bytes(results[1]["sub"]).counts == count_words([Path(p) for p in paths[:3]], [EOT],
                                                                          show_progress=False).counts
    assert results[2]["sub"] is None
    assert all("UTF-8" in result.get("error", "") for result in results), [r.get("error") for r in results]
    assert all("MemoryError: no room" in result.get("train_error", "") for result in results), results
    assert results[0]["missing"].startswith("counting failed on rank 2: FileNotFoundError"), results[0]
    assert results[1]["missing"].startswith("BPE training failed on rank 0: RuntimeError: counting failed on rank 2")
    assert "missing_on_rank_2.txt" in results[2]["missing"]
    assert results[0]["merge"] == "counting failed on rank 1: ValueError: counts from rank 1: corrupt"
    assert results[1]["merge"] is None and results[2]["merge"] is None


def test_shard_files_balances_bytes(parts):
    shards = distributed.shard_files(parts, 2)
    assert sorted(p for shard in shards for p in shard) == sorted(map(str, parts))
    assert distributed.shard_files(parts, 1) == [[str(p) for p in sorted(parts, key=lambda p: -p.stat().st_size)]]


def test_distributed_needs_initialized_process_group(parts):
    with pytest.raises(RuntimeError, match="not initialized"):
        distributed.count_words(parts)


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_count_then_train_from_counts(parts, tmp_path, capsys):
    from trainfast.bpe import load
    from trainfast.cli import main

    for idx, part in enumerate(parts[:3]):
        assert main(["bpe", "count", str(part), "--out", str(tmp_path / f"c{idx}.tfwc"), "--special-token", EOT,
                     "--no-progress"]) == 0
    assert main(["bpe", "train", "--from-counts", *(str(tmp_path / f"c{idx}.tfwc") for idx in range(3)),
                 "--vocab-size", "700", "--out", str(tmp_path / "from_counts"), "--no-progress"]) == 0
    assert main(["bpe", "train", *map(str, parts[:3]), "--vocab-size", "700", "--special-token", EOT,
                 "--out", str(tmp_path / "direct"), "--no-progress"]) == 0
    assert load(tmp_path / "from_counts") == load(tmp_path / "direct") == train_bpe(parts[:3], 700, [EOT],
                                                                                    show_progress=False)
    assert "distinct pre-tokens" in capsys.readouterr().out


def test_cli_pattern_of_the_counts_under_another_spelling(parts, tmp_path):
    from trainfast.cli import main

    counts = str(tmp_path / "c.tfwc")
    assert main(["bpe", "count", str(parts[0]), "--out", counts, "--pattern", "cl100k", "--no-progress"]) == 0
    for spelling in ("cl100k_base", "cl100k"):
        assert main(["bpe", "train", "--from-counts", counts, "--vocab-size", "300", "--pattern", spelling,
                     "--out", str(tmp_path / spelling), "--no-progress"]) == 0
    assert main(["bpe", "train", "--from-counts", counts, "--vocab-size", "300", "--pattern", "o200k",
                 "--out", str(tmp_path / "o200k"), "--no-progress"]) == 2


def test_cli_pattern_must_match_the_counts_pattern(parts, tmp_path, caplog):
    from trainfast.bpe import load
    from trainfast.bpe.pretokenize import PATTERNS
    from trainfast.cli import main

    counts = str(tmp_path / "c.tfwc")
    assert main(["bpe", "count", str(parts[0]), "--out", counts, "--pattern", "cl100k_base", "--no-progress"]) == 0
    # gpt2, by name or as its regex text, is no longer let through as "the flag's default".
    for pattern in ("gpt2", PATTERNS["gpt2"]):
        caplog.clear()
        assert main(["bpe", "train", "--from-counts", counts, "--vocab-size", "300", "--pattern", pattern,
                     "--out", str(tmp_path / "refused"), "--no-progress"]) == 2
        assert f"--pattern {pattern!r} differs from the counts' pattern 'cl100k_base'" in caplog.text
    assert not (tmp_path / "refused").exists()
    # No --pattern: the counts' own pattern, so the same merges as training on the text with cl100k.
    assert main(["bpe", "train", "--from-counts", counts, "--vocab-size", "400",
                 "--out", str(tmp_path / "own"), "--no-progress"]) == 0
    assert load(tmp_path / "own") == train_bpe([parts[0]], 400, pattern="cl100k", show_progress=False)


def test_cli_train_on_text_defaults_to_gpt2(parts, tmp_path):
    from trainfast.bpe import load
    from trainfast.cli import main

    assert main(["bpe", "train", str(parts[0]), "--vocab-size", "400", "--out", str(tmp_path / "t"),
                 "--no-progress"]) == 0
    assert load(tmp_path / "t") == train_bpe([parts[0]], 400, pattern="gpt2", show_progress=False)
    assert load(tmp_path / "t") != train_bpe([parts[0]], 400, pattern="cl100k", show_progress=False)


def test_counts_of_a_pattern_matching_the_empty_string_save_and_load():
    # regex.findall(r"a*", "baab") has empty matches; an empty word has no pair, so it is not kept.
    counts = count_words(iter(["baab"]), pattern=r"a*", show_progress=False)
    assert counts.counts == {b"aa": 1} and counts.total == 1
    assert WordCounts.from_bytes(counts.to_bytes()) == counts
    assert train_from_counts(counts, 258) == train_bpe(iter(["baab"]), 258, pattern=r"a*", show_progress=False)


def test_cli_count_total_leaves_out_empty_matches(tmp_path, capsys):
    from trainfast.cli import main

    (tmp_path / "t.txt").write_text("baab", encoding="utf-8")
    assert main(["bpe", "count", str(tmp_path / "t.txt"), "--out", str(tmp_path / "c.tfwc"), "--pattern", "a*",
                 "--no-progress"]) == 0
    assert "1 distinct pre-tokens, 1 in all (empty matches not counted)" in capsys.readouterr().out


def test_cli_bad_input(parts, tmp_path):
    from trainfast.cli import main

    (tmp_path / "bad.tfwc").write_bytes(b"TFWC\x01\x00\x00\x00garbage")
    assert main(["bpe", "train", "--from-counts", str(tmp_path / "bad.tfwc"), "--vocab-size", "300",
                 "--out", str(tmp_path / "x")]) == 2
    assert main(["bpe", "train", "--vocab-size", "300", "--out", str(tmp_path / "x")]) == 2
    assert main(["bpe", "train", str(parts[0]), "--from-counts", str(tmp_path / "bad.tfwc"), "--vocab-size", "300",
                 "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("option", [["--threads", "1"], ["--errors", "ignore"], ["--errors", "strict"]])
def test_cli_train_from_counts_refuses_pretokenizer_options(parts, tmp_path, caplog, option):
    # The counts are already pre-tokenized: these options would silently do nothing.
    from trainfast.cli import main

    counts = str(tmp_path / "c.tfwc")
    assert main(["bpe", "count", str(parts[0]), "--out", counts, "--no-progress"]) == 0
    assert main(["bpe", "train", "--from-counts", counts, "--vocab-size", "300", *option,
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert f"{option[0]} reads text files" in caplog.text
    assert not (tmp_path / "o").exists()
    # Training on text still takes both.
    assert main(["bpe", "train", str(parts[0]), "--vocab-size", "300", *option,
                 "--out", str(tmp_path / "t"), "--no-progress"]) == 0
