"""``trainfast pretokenize``: count BPE pre-tokens of text files (GPT-2 / cl100k / o200k patterns)."""

from __future__ import annotations

import argparse
import random
import time

_NAME = "pretokenize"


def register(subparsers: argparse._SubParsersAction) -> None:
    from trainfast.cli.bpe import add_pretokenizer_arguments

    parser = subparsers.add_parser(_NAME, help="count BPE pre-tokens of text files, like regex.findall + Counter")
    parser.add_argument("files", nargs="+", help="UTF-8 text files")
    add_pretokenizer_arguments(parser)
    parser.add_argument("--top", type=int, default=20, help="print the N most frequent pre-tokens (default 20)")
    parser.add_argument("--progress", action="store_true", help="show progress")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from trainfast._util import check_int
    from trainfast.bpe import count_pretokens

    check_int(args.top, "--top", min_value=0)
    paths = [Path(f) for f in args.files]
    start = time.perf_counter()
    counts = count_pretokens(paths, pattern=args.pattern, special_tokens=args.special_tokens,
                             num_threads=args.threads, errors=args.errors, show_progress=args.progress)
    seconds = time.perf_counter() - start
    num_bytes = sum(os.path.getsize(p) for p in paths)
    total = sum(counts.values())
    print(f"{total:,} pre-tokens, {len(counts):,} unique, in {num_bytes / 1e6:,.1f} MB: "
          f"{seconds:.2f} s ({num_bytes / 1e6 / max(seconds, 1e-9):,.0f} MB/s)")
    for token, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[: args.top]:
        print(f"  {count:>12,}  {token!r}")
    return 0


_WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from at which but "
          "have an they you were their one all we can her has there been if more when will would who so no "
          "don't it's we're they've I'll she'd 1913 2024 42 — “quoted” (parenthetical) naïve café Zürich").split()


def _sample_text(num_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines, size = [], 0
    while size < num_bytes:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(4, 16)))
        line = line[0].upper() + line[1:] + rng.choice([".", ",", "?", "!", ";", ":"])
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def demo() -> None:
    from collections import Counter

    from trainfast._util import resolve_num_threads
    from trainfast.bpe import PATTERNS, count_pretokens

    text = _sample_text(4_000_000)
    mb = len(text.encode("utf-8")) / 1e6
    threads = resolve_num_threads(None)
    print(f"pretokenize: counting GPT-2 pre-tokens of {mb:.1f} MB of synthetic English text")
    start = time.perf_counter()
    native_one = count_pretokens(iter([text]), num_threads=1)
    one_s = time.perf_counter() - start
    start = time.perf_counter()
    native_all = count_pretokens(iter([text]), num_threads=threads)
    all_s = time.perf_counter() - start
    print(f"  native, 1 thread    {one_s * 1e3:8.1f} ms  {mb / one_s:7.1f} MB/s")
    print(f"  native, {threads} threads  {all_s * 1e3:8.1f} ms  {mb / all_s:7.1f} MB/s  "
          f"same counts={native_all == native_one}")
    try:
        import regex
    except ImportError:
        print("  (the `regex` package is not installed: no comparison with regex.findall + Counter)")
        return
    start = time.perf_counter()
    expected = Counter(token.encode("utf-8") for token in regex.findall(PATTERNS["gpt2"], text))
    regex_s = time.perf_counter() - start
    print(f"  regex.findall+Counter {regex_s * 1e3:6.1f} ms  {mb / regex_s:7.1f} MB/s  "
          f"-> native {regex_s / one_s:.0f}x (1 thread), {regex_s / all_s:.0f}x ({threads} threads); "
          f"identical={native_one == expected}")
