"""Shared by every benchmarks/bench_*.py: timing, a printed table, and the README section rewrite.

Each benchmark prints its table; with ``--write-readme`` it also replaces its own section of
benchmarks/README.md (between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

README = Path(__file__).with_name("README.md")


def parse_args(docstring: str) -> argparse.Namespace:
    """Parses the benchmark's flags; --help shows the first paragraph of its module docstring."""
    parser = argparse.ArgumentParser(description=" ".join(docstring.split("\n\n")[0].split()))
    parser.add_argument("--write-readme", action="store_true", help="rewrite this benchmark's README section")
    parser.add_argument("--quick", action="store_true", help="smaller inputs, fewer repeats (smoke run)")
    return parser.parse_args()


def timeit(fn: Callable[[], Any], *, repeats: int = 5, min_time: float = 0.0) -> tuple[Any, float]:
    """(last result, median seconds) over ``repeats`` calls (more while under ``min_time`` total).

    The garbage left by earlier work is collected before each call, untimed: otherwise a call
    pays for the collection of what the previous benchmark row allocated (a Python upstream timed
    twice in one run measured 2-3x apart). A call's own collections stay in its time."""
    times = []
    result = None
    start_all = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start_all < min_time:
        result = None  # the previous call's result is garbage too
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        if len(times) >= 1000:
            break
    return result, statistics.median(times)


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(name: str, body: str) -> None:
    """Replaces the ``name`` section of benchmarks/README.md (appended if missing)."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n\n_Measured {time.strftime('%Y-%m-%d')} on {machine()}._\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    README.write_text(text)
