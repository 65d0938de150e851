"""BPE training: trainfast vs HF tokenizers vs rustbpe vs the Python oracle (tests/reference/bpe.py).

Every system runs in its own subprocess (so peak RSS is its own) with the same thread count
(TRAINFAST_NUM_THREADS and RAYON_NUM_THREADS). Phases: pre-tokenize + count, then merges; HF tokenizers
and rustbpe only report their total. Inputs: CS336 corpus.en (vocab 500), gcide (40 MB; vocab 10000
and 32000) and a >= 200 MB concatenation of the shared corpora.
"""

from __future__ import annotations

import json
import lzma
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TRAINFAST_SHARED", ROOT.parent / "shared"))
SPECIAL = "<|endoftext|>"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# --- one system, one input (runs in a subprocess) ---------------------------------------------


def _run_trainfast(path: str, vocab_size: int, threads: int) -> dict:
    from trainfast.bpe import train as train_module  # train_bpe's two phases, timed one by one

    start = time.perf_counter()
    table = train_module._count_words(path, "gpt2", [SPECIAL], threads, "strict", False)  # stays native
    middle = time.perf_counter()
    _, merges = train_module._train(table, vocab_size, [SPECIAL], False)
    end = time.perf_counter()
    return {"pretok": middle - start, "merges": end - middle, "total": end - start, "num_merges": len(merges),
            "digest": _digest(merges)}


def _digest(merges: list[tuple[bytes, bytes]]) -> str:
    import hashlib

    return hashlib.sha256(repr(merges).encode()).hexdigest()


def _run_oracle(path: str, vocab_size: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from reference import bpe as ref

    start = time.perf_counter()
    counts = ref.count_pretokens([ref.read_text(path)], [SPECIAL])
    middle = time.perf_counter()
    _, merges = ref.train_from_counts(counts, vocab_size, [SPECIAL])
    end = time.perf_counter()
    return {"pretok": middle - start, "merges": end - middle, "total": end - start, "num_merges": len(merges),
            "digest": _digest(merges)}


def _run_hf(path: str, vocab_size: int, threads: int) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    start = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2 regex
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([path], trainer)
    return {"total": time.perf_counter() - start, "num_merges": tokenizer.get_vocab_size() - 257}


def _run_rustbpe(path: str, vocab_size: int, threads: int) -> dict:
    import rustbpe

    def pieces():  # ~1 MB pieces cut at line ends, special tokens removed (rustbpe has none)
        with open(path, encoding="utf-8") as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    return
                chunk += f.readline()
                yield from chunk.split(SPECIAL)

    start = time.perf_counter()
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(pieces(), vocab_size - 1, pattern=GPT2_PATTERN)
    return {"total": time.perf_counter() - start, "num_merges": tokenizer.vocab_size - 256}


_SYSTEMS = {"trainfast": _run_trainfast, "HF tokenizers": _run_hf, "rustbpe": _run_rustbpe,
            "Python oracle": _run_oracle}


def _peak_rss() -> int:
    """Peak RSS of this process in bytes (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(system: str, path: str, vocab_size: int, threads: int, repeats: int) -> None:
    results = [_SYSTEMS[system](path, vocab_size, threads) for _ in range(repeats)]
    result = sorted(results, key=lambda r: r["total"])[len(results) // 2]  # the median run
    result["rss"] = _peak_rss()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu"] = (usage.ru_utime + usage.ru_stime) / repeats  # all threads, per run (with imports)
    print("RESULT " + json.dumps(result))


# --- orchestration ----------------------------------------------------------------------------


def _measure(system: str, path: Path, vocab_size: int, threads: int, repeats: int = 1) -> dict | None:
    env = dict(os.environ, TRAINFAST_NUM_THREADS=str(threads), RAYON_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--worker", system, str(path), str(vocab_size), str(threads),
                           str(repeats)], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {system}: failed ({proc.stderr.strip().splitlines()[-1:] or proc.returncode})")
        return None
    return json.loads(lines[-1][len("RESULT "):])


def _available(system: str) -> bool:
    module = {"HF tokenizers": "tokenizers", "rustbpe": "rustbpe"}.get(system)
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _fmt(seconds: float | None) -> str:
    from _common import fmt_seconds

    return "–" if seconds is None else fmt_seconds(seconds)


def main() -> None:
    from _common import markdown_table, parse_args

    args = parse_args(__doc__)
    from trainfast._util import resolve_num_threads

    threads = resolve_num_threads(None)
    workdir = Path(tempfile.mkdtemp(prefix="bench_bpe_"))
    try:
        gcide = workdir / "gcide.txt"
        gcide.write_bytes(lzma.decompress((SHARED / "corpora" / "gcide.txt.xz").read_bytes()))
        cases = [("corpus.en (133 kB)", SHARED / "fixtures" / "cs336" / "corpus.en", 500, 5, True)]
        if args.quick:
            small = workdir / "gcide_4mb.txt"
            small.write_bytes(gcide.read_bytes()[:4_000_000].rsplit(b"\n", 1)[0])
            cases.append(("gcide 4 MB", small, 10_000, 1, True))
        else:
            cases += [("gcide (40 MB)", gcide, 10_000, 1, True), ("gcide (40 MB)", gcide, 32_000, 1, False)]
            corpora = [lzma.decompress((SHARED / "corpora" / f"{name}.txt.xz").read_bytes())
                       for name in ("austen", "kjv", "gcide", "multilingual")]
            for times, vocab_sizes in ((3, (10_000, 32_000)), (30, (32_000,))):
                concat = workdir / f"concat_x{times}.txt"
                with open(concat, "wb") as out:
                    for _ in range(times):
                        for corpus in corpora:
                            out.write(corpus)
                            out.write(f"\n{SPECIAL}\n".encode())
                size = concat.stat().st_size
                size_label = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
                cases += [(f"4 corpora x{times} ({size_label})", concat, vocab_size, 1, False)
                          for vocab_size in vocab_sizes]

        rows, notes = [], set()
        for label, path, vocab_size, repeats, with_oracle in cases:
            results = {}
            for system in _SYSTEMS:
                if not _available(system) or (system == "Python oracle" and not with_oracle):
                    continue
                print(f"{label} vocab {vocab_size}: {system} ...", flush=True)
                results[system] = _measure(system, path, vocab_size, threads, repeats)
            native = results.get("trainfast")
            for system, result in results.items():
                if result is None:
                    continue
                if result.get("note"):
                    notes.add(result["note"])
                ratio = "1.0x" if system == "trainfast" else (
                    f"{result['total'] / native['total']:.1f}x slower" if native else "–")
                oracle = results.get("Python oracle")
                same = "–"
                if system in ("trainfast", "Python oracle") and oracle and native:
                    same = str(native["digest"] == oracle["digest"])
                rows.append([label, vocab_size, system, _fmt(result.get("pretok")), _fmt(result.get("merges")),
                             _fmt(result["total"]), ratio, _fmt(result["cpu"]), f"{result['rss'] / 2**20:.0f} MiB",
                             same])
                print("  " + " | ".join(map(str, rows[-1])), flush=True)

        table = markdown_table(
            ["corpus", "vocab", "system", "pre-tokenize + count", "merges", "total (wall)", "vs trainfast", "CPU time",
             "peak RSS", "merges = oracle's"], rows)
        print(table)
        body = (f"BPE training (`trainfast.bpe.train_bpe`, CS336 semantics), {threads} threads for every system but "
                "the Python oracle (one thread), each in its own process (peak RSS includes the interpreter). "
                "`merges = oracle's`: trainfast's merge list equals the oracle's, where the oracle runs. HF tokenizers: BpeTrainer with the "
                "ByteLevel pre-tokenizer (GPT-2 regex, add_prefix_space=False; it pre-tokenizes line by line); "
                "rustbpe: GPT-2 pattern, ~1 MB pieces. Both report only their total. trainfast totals include "
                "the file read; merges are exactly CS336's (HF/rustbpe break ties differently). CPU time: user + sys "
                "of the whole process, all threads, per run, including interpreter start-up and imports (less sensitive than wall time to a busy machine).\n\n" + table)
        if notes:
            body += "\n\n" + "\n".join(f"Note: {note}." for note in sorted(notes))
        if args.write_readme:
            from _common import write_section

            write_section("bpe", body)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, system_name, input_path, vocab, num_threads, num_repeats = sys.argv
        _worker(system_name, input_path, int(vocab), int(num_threads), int(num_repeats))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        main()
