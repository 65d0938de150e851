"""BPE pre-tokenization throughput: `regex.findall` + Counter and HF `tokenizers` vs trainfast.

One run times, on gcide (English) and multilingual (26 languages) from ../shared/corpora:
  - regex:       Counter(t.encode() for t in regex.findall(PATTERN, text)), one thread
  - HF ByteLevel: tokenizers' ByteLevel(use_regex=True).pre_tokenize_str(text) (GPT-2 pattern
                  via Oniguruma, output mapped to byte-level characters; no counting), one thread
  - trainfast:   count_pretokens(path) with 1 thread and with every core; pretokenize(text) -> list[str]
The Python baselines run on the first --baseline-mb MB of each corpus (they take ~10 s per 40 MB);
native timings use the whole file. MB/s are decoded MB of text per second of wall time; "MB per
CPU-s" divides by the CPU time the process used instead, which stays meaningful when the machine
is shared.
"""

from __future__ import annotations

import lzma
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, parse_args, timeit, write_section  # noqa: E402

from trainfast._util import resolve_num_threads  # noqa: E402
from trainfast.bpe import PATTERNS, count_pretokens, pretokenize  # noqa: E402

SHARED = Path(os.environ.get("TRAINFAST_SHARED", Path(__file__).resolve().parents[2] / "shared"))
DATA = Path(__file__).resolve().parent / ".data"


def corpus_path(name: str) -> Path:
    DATA.mkdir(exist_ok=True)
    path = DATA / f"{name}.txt"
    if not path.exists():
        with lzma.open(SHARED / "corpora" / f"{name}.txt.xz") as src:
            path.write_bytes(src.read())
    return path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, repeats: int):
    """(result, median wall s, min CPU s per call)."""
    cpu = []

    def wrapped():
        start = cpu_seconds()
        result = fn()
        cpu.append(cpu_seconds() - start)
        return result

    result, wall = timeit(wrapped, repeats=repeats)
    return result, wall, min(cpu)


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def available_parallelism(num_procs: int, work: int = 5_000_000) -> float:
    """How many cores this machine gives us right now: N spinning processes vs one (ideal: N)."""
    import multiprocessing

    elapsed = []
    for procs in (1, num_procs):
        start = time.perf_counter()
        workers = [multiprocessing.Process(target=_spin, args=(work,)) for _ in range(procs)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        elapsed.append(time.perf_counter() - start)
    return num_procs * elapsed[0] / elapsed[1]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import regex

    baseline_mb = 2 if args.quick else 8
    repeats = 1 if args.quick else 3
    threads = resolve_num_threads(None)
    rows = []
    for corpus in ["gcide", "multilingual"]:
        path = corpus_path(corpus)
        text = path.read_text(encoding="utf-8")
        mb = len(text.encode("utf-8")) / 1e6
        prefix = text[: baseline_mb * 1_000_000]
        while len(prefix.encode("utf-8")) > baseline_mb * 1_000_000:
            prefix = prefix[: int(len(prefix) * 0.95)]
        prefix_mb = len(prefix.encode("utf-8")) / 1e6
        for name in ["gpt2", "cl100k", "o200k"]:
            compiled = regex.compile(PATTERNS[name])
            expected, regex_s, regex_cpu = timed(lambda: Counter(map(str.encode, compiled.findall(prefix))), 1)
            got_prefix = count_pretokens([prefix], pattern=name, num_threads=1)
            assert got_prefix == expected, f"{corpus}/{name}: native counts differ from regex"
            _, one_s, one_cpu = timed(lambda: count_pretokens(path, pattern=name, num_threads=1), repeats)
            _, all_s, all_cpu = timed(lambda: count_pretokens(path, pattern=name, num_threads=threads), repeats)
            _, list_s, _ = timed(lambda: pretokenize(text, pattern=name), 1)
            rows.append([
                corpus, name,
                f"{prefix_mb / regex_s:.1f} ({prefix_mb / regex_cpu:.1f})",
                f"{mb / one_s:.0f} ({mb / one_cpu:.0f})",
                f"{mb / all_s:.0f} ({mb / all_cpu:.0f})",
                f"{one_s / all_s:.2f}x",
                f"{(mb / one_s) / (prefix_mb / regex_s):.0f}x ({(mb / one_cpu) / (prefix_mb / regex_cpu):.0f}x)",
                f"{mb / list_s:.0f}",
            ])
            print(" | ".join(rows[-1]), flush=True)
        try:
            from tokenizers.pre_tokenizers import ByteLevel

            byte_level = ByteLevel(add_prefix_space=False, use_regex=True)
            _, hf_s, hf_cpu = timed(lambda: byte_level.pre_tokenize_str(prefix), 1)
            rows.append([corpus, "gpt2: HF tokenizers ByteLevel.pre_tokenize_str (baseline column)",
                         f"{prefix_mb / hf_s:.1f} ({prefix_mb / hf_cpu:.1f})", "", "", "", "", ""])
            print(" | ".join(rows[-1]), flush=True)
        except ImportError:
            print("tokenizers not installed: skipping the HF ByteLevel baseline")

    header = ["corpus", "pattern", "regex.findall+Counter MB/s", "native 1 thread MB/s",
              f"native {threads} threads MB/s", f"scaling 1->{threads} (wall)", "native 1 thread / regex",
              "pretokenize() -> list[str] MB/s"]
    table = markdown_table(header, rows)
    load = os.getloadavg()[0]
    parallelism = available_parallelism(threads)
    body = (
        "`count_pretokens` (dict[bytes, int]) vs `Counter(regex.findall(...))` (regex "
        f"{regex.__version__}) on the first {baseline_mb} MB, both checked equal; native on the whole file "
        f"(gcide 40 MB, multilingual 21.5 MB). 1-minute load average at the end: {load:.1f} "
        f"on {os.cpu_count()} cores; {threads} spinning processes ran {parallelism:.2f}x as fast as one "
        f"(the most any {threads}-thread scaling could show here). Cells read `wall (per CPU-second)`: MB per second of wall time, and "
        "in parentheses MB per second of CPU time the process used, which stays meaningful on a shared, "
        "busy machine (wall-clock scaling is only meaningful on an idle one).\n\n" + table
    )
    print(body)
    if args.write_readme:
        write_section("pretokenize", body)


if __name__ == "__main__":
    main()
