"""BPE pre-tokenization throughput: `regex.findall` + Counter and HF `tokenizers` vs trainfast.

One run times, on gcide (English) and multilingual (26 languages) from ../shared/corpora:
  - regex:       Counter(t.encode() for t in regex.findall(PATTERN, text)), one thread
  - HF ByteLevel: tokenizers' ByteLevel(use_regex=True).pre_tokenize_str(text) (GPT-2 pattern
                  via Oniguruma, output mapped to byte-level characters; no counting), one thread
  - trainfast:   count_pretokens(path) with 1 thread and with every core, split in two phases:
                 "scan+count" = file read (mmap) + UTF-8 check/decode + scan + count + merge of the
                 per-thread hash parts into flat arrays in first-occurrence order (the native counter's
                 add_file + finish_arrays), and "+dict" = the whole public call, which also builds the
                 dict[bytes, int] (Python objects, one thread, GIL held); pretokenize(text) -> list[str]
  - per core:    the one-thread scan+count pinned to each core in turn. The cores of a shared VM
                 need not run at one speed (on the 2-vCPU dev VM one of them, either one, at times ran
                 25-40% slower than the other), and an unpinned one-thread call runs on whichever the
                 kernel picks, often the faster. "vs the average core" divides, round by round, the
                 all-thread throughput by the mean throughput of the cores timed in that round: on
                 equal cores it is the plain scaling, on unequal ones what N threads make of N cores
                 rather than of the fastest one
The Python baselines run on the first 8 MB of each corpus (2 with --quick; they take ~10 s per
40 MB); native timings use the whole file. MB/s are decoded MB of text per second of wall time
(median of the repeats; regex, the 1-thread and the all-thread calls take turns, so a slow spell of
a shared machine hits them all alike); "per CPU-s" divides by the CPU time the process used instead
(user + sys, all threads), which stays meaningful when the machine is shared.
"""

from __future__ import annotations

import lzma
import os
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, parse_args, write_section  # noqa: E402

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
    """(result, median wall s, median CPU s) over `repeats` calls."""
    walls, cpus = [], []
    result = None
    for _ in range(repeats):
        cpu_start, wall_start = cpu_seconds(), time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - wall_start)
        cpus.append(cpu_seconds() - cpu_start)
    return result, statistics.median(walls), statistics.median(cpus)


def interleaved(fns: dict, repeats: int, rotating=None) -> tuple[dict, list[dict]]:
    """({name: (median wall s, median CPU s, best wall s)}, [{name: wall s} per round]): the
    functions take turns, `repeats` rounds, so a slow spell of a shared machine hits them all alike
    instead of one of them. The best round is timeit's estimate of the undisturbed time (slower
    rounds are mostly other work on the machine, not variance of the code). `rotating(r)`: more
    {name: fn} for round r, run after `fns` in an order rotated by one each round (a call right
    after one that built and freed a large dict ran ~7% slower: no call always gets that place)."""
    walls, cpus, rounds = {}, {}, []
    for r in range(repeats):
        extra = list(rotating(r).items()) if rotating is not None else []
        shift = r % len(extra) if extra else 0
        rounds.append({})
        for name, fn in list(fns.items()) + extra[shift:] + extra[:shift]:
            cpu_start, wall_start = cpu_seconds(), time.perf_counter()
            fn()
            rounds[-1][name] = time.perf_counter() - wall_start
            walls.setdefault(name, []).append(rounds[-1][name])
            cpus.setdefault(name, []).append(cpu_seconds() - cpu_start)
    summary = {name: (statistics.median(walls[name]), statistics.median(cpus[name]), min(walls[name])) for name in walls}
    return summary, rounds


def pinned(fn, cpu: int):
    """fn run on core `cpu` only (this thread's affinity, restored afterwards)."""
    def call():
        cores = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
        try:
            return fn()
        finally:
            os.sched_setaffinity(0, cores)
    return call


def cores_by_round(repeats: int, per_round: int = 4) -> list[list[int]]:
    """The cores the pinned calls of each round run on: up to `per_round` a round, in rotation, so
    every core is timed in several rounds (all of them every round on a machine with <= per_round)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux: no pinning
        cores = []
    if len(cores) < 2:
        return [[] for _ in range(repeats)]
    k = min(per_round, len(cores))
    return [[cores[(r * k + i) % len(cores)] for i in range(k)] for r in range(repeats)]


def main() -> None:
    args = parse_args(__doc__)
    import regex

    from trainfast import _core

    baseline_mb = 2 if args.quick else 8
    repeats = 2 if args.quick else 9
    threads = resolve_num_threads(None)
    native_id = {"gpt2": 0, "cl100k": 1, "o200k": 2}
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
            expected = Counter(map(str.encode, compiled.findall(prefix)))
            got_prefix = count_pretokens(iter([prefix]), pattern=name, num_threads=1)
            assert got_prefix == expected, f"{corpus}/{name}: native counts differ from regex"

            def native(num_threads: int):
                counter = _core.BpePretokenCounter(native_id[name], [], 0, num_threads)
                counter.add_file(str(path))
                return counter.finish_arrays()

            def finish_only(as_dict: bool):
                counter = _core.BpePretokenCounter(native_id[name], [], 0, 1)
                counter.add_file(str(path))
                start = cpu_seconds()
                counter.finish() if as_dict else counter.finish_arrays()
                return cpu_seconds() - start

            # The dict build alone: CPU time of finish() (dict) minus finish_arrays(), best of the repeats.
            dict_cpu = min(finish_only(True) for _ in range(repeats)) - min(finish_only(False) for _ in range(repeats))
            # regex takes its turn in the same rounds: this machine's speed drifts over seconds, and
            # a ratio of two timings taken a minute apart would measure the drift.
            fns = {"regex": lambda: Counter(map(str.encode, compiled.findall(prefix)))}
            for n in (1, threads):
                fns[("full", n)] = lambda n=n: count_pretokens(path, pattern=name, num_threads=n)
            core_rounds = cores_by_round(repeats)

            def native_calls(r: int) -> dict:
                calls = {("native", n): lambda n=n: native(n) for n in (1, threads)}
                calls.update({("pinned", cpu): pinned(lambda: native(1), cpu) for cpu in core_rounds[r]})
                return calls

            medians, rounds = interleaved(fns, repeats, native_calls)
            # The timed calls, checked on the whole file: the counter (1 and all threads) and the
            # public call, against regex over the whole text, counts and first-occurrence order.
            whole = list(Counter(map(str.encode, compiled.findall(text))).items())
            for n in (1, threads):
                data, offsets, counts = native(n)
                keys = [bytes(data[offsets[k]:offsets[k + 1]]) for k in range(len(counts))]
                assert list(zip(keys, counts.tolist())) == whole, f"{corpus}/{name}/{n} threads: counter differs"
                assert list(count_pretokens(path, pattern=name, num_threads=n).items()) == whole, \
                    f"{corpus}/{name}/{n} threads: count_pretokens differs"
            regex_s, regex_cpu, _ = medians["regex"]
            regex_rate = prefix_mb / regex_s
            cells = {n: (*medians[("native", n)][:2], *medians[("full", n)][:2]) for n in (1, threads)}
            best_scaling = medians[("native", 1)][2] / medians[("native", threads)][2]
            _, list_s, _ = timed(lambda: pretokenize(text, pattern=name), 1)
            one, many = cells[1], cells[threads]
            if name == "gpt2":
                gpt2_one = one
            # MB/s of the one-thread call on each core; and per round, the all-thread call's speed
            # over the mean speed of the cores timed in that round (a ratio of calls seconds apart,
            # so the machine's drift over a run cancels), median over the rounds.
            per_core = {key[1]: mb / value[0] for key, value in medians.items() if key[0] == "pinned"}
            per_core_cell, vs_average_core = "", ""
            if per_core:
                per_core_cell = " / ".join(f"{rate:.0f}" for _, rate in sorted(per_core.items()))
                ratios = [1 / walls[("native", threads)]
                          / statistics.mean(1 / wall for key, wall in walls.items() if key[0] == "pinned")
                          for walls in rounds]
                vs_average_core = f"{statistics.median(ratios):.2f}x"
            rows.append([
                corpus, name,
                f"{regex_rate:.1f} ({prefix_mb / regex_cpu:.1f})",
                f"**{mb / one[0]:.0f}** ({mb / one[1]:.0f})",
                f"{mb / one[2]:.0f} ({mb / one[3]:.0f})",
                f"{mb / many[0]:.0f} ({mb / many[1]:.0f})",
                f"{mb / many[2]:.0f} ({mb / many[3]:.0f})",
                f"{one[0] / many[0]:.2f}x ({many[1] / one[1]:.2f})",
                f"{best_scaling:.2f}x",
                per_core_cell,
                vs_average_core,
                f"{one[2] / many[2]:.2f}x",
                f"{regex_s / prefix_mb / (one[0] / mb):.0f}x ({regex_cpu / prefix_mb / (one[1] / mb):.0f}x) / "
                f"{regex_s / prefix_mb / (one[2] / mb):.0f}x ({regex_cpu / prefix_mb / (one[3] / mb):.0f}x)",
                f"{dict_cpu * 1e3:.0f} ms",
                f"{mb / list_s:.0f}",
            ])
            print(" | ".join(rows[-1]), flush=True)
        try:
            from tokenizers.pre_tokenizers import ByteLevel

            byte_level = ByteLevel(add_prefix_space=False, use_regex=True)
            _, hf_s, hf_cpu = timed(lambda: byte_level.pre_tokenize_str(prefix), 1)
            gpt2_s, gpt2_cpu = gpt2_one[0] / mb, gpt2_one[1] / mb  # seconds per MB
            rows.append([corpus, "gpt2: HF tokenizers ByteLevel.pre_tokenize_str (in the regex column)",
                         f"{prefix_mb / hf_s:.1f} ({prefix_mb / hf_cpu:.1f})", "", "", "", "", "", "", "", "", "",
                         f"{hf_s / prefix_mb / gpt2_s:.0f}x ({hf_cpu / prefix_mb / gpt2_cpu:.0f}x) scan+count vs HF",
                         "", ""])
            print(" | ".join(rows[-1]), flush=True)
        except ImportError:
            print("tokenizers not installed: skipping the HF ByteLevel baseline")

    header = ["corpus", "pattern", "regex.findall+Counter MB/s",
              "native 1 thread scan+count MB/s", "1 thread +dict MB/s",
              f"{threads} threads scan+count MB/s", f"{threads} threads +dict MB/s",
              f"scaling 1->{threads} scan+count: wall (CPU-s ratio)", f"scaling 1->{threads} scan+count, best rounds",
              "1 thread scan+count pinned to each core MB/s", f"scaling: {threads} threads vs the average core",
              f"scaling 1->{threads} +dict (wall)",
              "1 thread vs regex, wall (CPU): scan+count / +dict", "dict build (CPU time)", "pretokenize() -> list[str] MB/s"]
    table = markdown_table(header, rows)
    load = os.getloadavg()[0]
    body = (
        "`count_pretokens` vs `Counter(regex.findall(...))` (regex "
        f"{regex.__version__}) on the first {baseline_mb} MB; native on the whole file, its results (the counter and "
        f"`count_pretokens`, 1 and {threads} threads) checked equal to regex over the whole file, counts and order "
        f"(gcide 40 MB, multilingual 21.5 MB), median of {repeats} rounds in which regex, the 1-thread "
        f"(unpinned and pinned to each core) and the {threads}-thread calls take turns. \"scan+count\": "
        "file read (mmap) + UTF-8 check + scan + count + parallel merge into flat arrays in "
        "first-occurrence order (the native counter alone); \"+dict\": the public `count_pretokens` call, "
        "which also builds the dict[bytes, int] on one thread (Python objects; its CPU time is the "
        f"\"dict build\" column). 1-minute load average at the end: {load:.1f} on {os.cpu_count()} cores. "
        "Cells read `wall (per CPU-second)`: MB per second of wall time, and in parentheses MB "
        "per second of CPU time the process used (all threads), which stays meaningful on a shared, busy "
        "machine; the scaling column's parenthesis is CPU-s with all threads / CPU-s with one (1.00 = "
        "no parallel overhead). \"best rounds\": fastest 1-thread round / fastest all-thread round "
        "(timeit's estimate of the undisturbed times). \"pinned to each core\": the one-thread "
        "scan+count with its thread pinned to core 0, core 1, ... (median MB/s per core); a VM's cores "
        "need not run at one speed, and the unpinned one-thread call runs on whichever core the kernel "
        f"picks. \"vs the average core\": in each round, {threads}-thread MB/s / the mean MB/s of the "
        "cores pinned to in that round, median over the rounds, from calls seconds apart (it has read "
        "above the plain scaling even when the pinned cores measured the same speed, so it is not the "
        "goal's measure). The HF row is timed once and not checked (ByteLevel maps bytes to other "
        "characters). Wall-clock scaling is only meaningful on an idle machine.\n\n" + table
    )
    print(body)
    if args.write_readme:
        write_section("pretokenize", body)


if __name__ == "__main__":
    main()
