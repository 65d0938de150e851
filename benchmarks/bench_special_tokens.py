"""Special-token splitting on adversarial text: `regex.split` (CS336's reference) vs trainfast.

Text made of near misses of long special tokens (a run of "a" against "a" * L + "b") makes a
search that walks each position cost up to L bytes per position; text where an occurrence covers
every point the pattern could cut at made each cut attempt read a long token's whole reach. One run times, one thread:
  - regex:      regex.split(f"({'|'.join(escaped tokens, longest first)})", text), as CS336 splits
  - trainfast:  pretokenize(text, special_tokens=...) -> list[str], and count_pretokens([bytes])
and checks that both find the same special-token occurrences. The last row is ordinary text (the
first 8 MB of gcide with "<|endoftext|>" every ~4 KB) to show the common case. Seconds are the
median of the repeats.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, parse_args, timeit, write_section  # noqa: E402
from bench_pretokenize import corpus_path  # noqa: E402

from trainfast.bpe import count_pretokens, pretokenize  # noqa: E402

EOT = "<|endoftext|>"


def cases(quick: bool) -> list[tuple[str, str, list[str]]]:
    mb = 1_000_000 if quick else 4_000_000
    runs = "a" * mb
    out = [
        (f"one 16 KiB token, {mb // 1_000_000} MB of its near misses", runs, ["a" * 16384 + "b"]),
        (f"one 400 KB token, {mb // 1_000_000} MB of its near misses", runs, ["a" * 400_000 + "b"]),
        ("three tokens of 2 KiB, 1 MB of their near misses", "a" * 1_000_000,
         ["a" * 2048 + "b", "a" * 2000 + "c", "a" * 1000 + "d"]),
        ("a 64-byte token and a 1 KiB one, 1 MB of `a ` with occurrences", ("a " * 600 + "b") * 830,
         ["a " * 32, "a " * 512 + "b"]),
        ("`a ` over every cut point, beside a 10 KB token, 1 MB", "a " * 500_000, ["a ", "x" * 10_000]),
    ]
    text = corpus_path("gcide").read_text(encoding="utf-8")[: 2_000_000 if quick else 8_000_000]
    out.append(("ordinary text: gcide with an end-of-text token every ~4 KB", EOT.join(
        text[k:k + 4096] for k in range(0, len(text), 4096)), [EOT]))
    return out


def main() -> None:
    args = parse_args(__doc__)
    import regex

    repeats = 1 if args.quick else 3
    rows = []
    for label, text, specials in cases(args.quick):
        pattern = regex.compile("(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        # The reference is slow here by design: once is enough where it takes seconds.
        parts, regex_s = timeit(lambda: pattern.split(text), repeats=1)
        pieces, pretok_s = timeit(lambda: pretokenize(text, special_tokens=specials), repeats=repeats)
        data = text.encode()
        _, count_s = timeit(lambda: count_pretokens([data], special_tokens=specials, num_threads=1), repeats=repeats)
        special_set = set(specials)
        expected = parts[1::2]
        got = [p for p in pieces if p in special_set]
        assert got == expected and "".join(pieces) == text, label
        mb = len(data) / 1e6
        rows.append([label, f"{mb:.1f}", len(expected), f"{regex_s:.3f}", f"{pretok_s:.3f}", f"{count_s:.3f}"])
    header = ["case", "MB", "occurrences", "regex.split s", "pretokenize s", "count_pretokens s (1 thread)"]
    body = (
        "Special-token splitting on text full of near misses of long tokens, one thread "
        f"(`benchmarks/bench_special_tokens.py`; occurrences checked equal to `regex.split`'s; "
        f"1-minute load average at the end: {os.getloadavg()[0]:.1f}). `pretokenize` and `count_pretokens` "
        "also pre-tokenize the text between the occurrences (`regex.split` only splits), so on ordinary text "
        "they take longer than the split alone.\n\n" + markdown_table(header, rows)
    )
    print(body)
    if args.write_readme:
        write_section("special_tokens", body)


if __name__ == "__main__":
    main()
