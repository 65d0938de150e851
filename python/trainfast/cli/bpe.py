"""``trainfast bpe train``: train a byte-level BPE tokenizer (CS336 semantics) and save it."""

from __future__ import annotations

import argparse
import lzma
import time
from collections import Counter
from pathlib import Path

_NAME = "bpe"
_DEMO_CORPUS = Path(__file__).resolve().parents[1] / "bpe" / "data" / "corpus.en.xz"


def _thread_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def add_pretokenizer_arguments(parser: argparse.ArgumentParser, *, pattern_default: str | None = "gpt2",
                               pattern_help: str = "gpt2 (default), cl100k, o200k or a regular expression",
                               errors_default: str | None = "strict") -> None:
    """--special-token, --pattern, --threads and --errors: how a command that reads text files splits it.

    ``pattern_default`` / ``errors_default`` None let the handler tell "not given" from the default's
    spelling (``bpe train`` takes the pattern of its --from-counts files then, and refuses --errors
    there); ``pattern_help`` should say what the default is."""
    parser.add_argument("--special-token", action="append", default=[], dest="special_tokens",
                        help="special token (repeatable), e.g. '<|endoftext|>': split out first, never counted")
    parser.add_argument("--pattern", default=pattern_default, help=pattern_help)
    parser.add_argument("--threads", type=_thread_count, default=None, help="pre-tokenizer threads (default: all cores)")
    parser.add_argument("--errors", default=errors_default, choices=["strict", "replace", "ignore"],
                        help="invalid UTF-8: fail naming the byte offset (default), replace or ignore")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(_NAME, help="byte-level BPE tokenizer training")
    commands = parser.add_subparsers(dest="bpe_command", required=True)
    train = commands.add_parser("train", help="train BPE merges on text files (CS336 train_bpe semantics)")
    train.add_argument("corpus", nargs="+", help="UTF-8 text files")
    train.add_argument("--vocab-size", type=int, required=True, help="256 bytes + specials + merges")
    train.add_argument("--out", required=True, help="directory for vocab.json and merges.txt")
    add_pretokenizer_arguments(train, pattern_default=None,
                               pattern_help="gpt2, cl100k, o200k or a regular expression (default: gpt2 for text "
                                            "files, the counts' own pattern with --from-counts)",
                               errors_default=None)
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(handler=_train_command)


def check_special_tokens_fit_vocab_json(special_tokens: list[str], source: str = "--special-token") -> None:
    """Before training, not at the save after it: vocab.json maps each token to one id, so a one-byte
    special token (already a byte token) cannot be saved."""
    for token in special_tokens:
        if len(token.encode("utf-8", "surrogatepass")) == 1:
            raise ValueError(f"{source} {token!r} is one byte, already token {ord(token)} of the byte "
                             "vocabulary: vocab.json cannot hold it under two ids")


def _train_command(args: argparse.Namespace) -> int:
    from trainfast._util import check_output_dir
    from trainfast.bpe import save, train_bpe

    check_output_dir("--out", args.out)  # before the work, not at the save after it
    for name in ("vocab.json", "merges.txt"):
        if (Path(args.out) / name).is_dir():
            raise IsADirectoryError(f"--out {args.out!r}: {name} in it is a directory")
    check_special_tokens_fit_vocab_json(args.special_tokens)
    start = time.perf_counter()
    # --pattern defaults to None so that --from-counts can tell an explicit gpt2 from none given.
    pattern = "gpt2" if args.pattern is None else args.pattern
    vocab, merges = train_bpe(args.corpus, args.vocab_size, args.special_tokens, pattern=pattern,
                              num_threads=args.threads, errors=args.errors or "strict",
                              show_progress=not args.no_progress)
    seconds = time.perf_counter() - start
    save(vocab, merges, args.out)
    print(f"bpe: {len(merges):,} merges, vocab {len(vocab):,} in {seconds:.2f} s -> {args.out}/vocab.json, merges.txt")
    return 0


def demo() -> None:
    from trainfast.bpe import train_from_counts
    from trainfast.bpe import count_pretokens

    special = "<|endoftext|>"
    text = lzma.decompress(_DEMO_CORPUS.read_bytes()).decode("utf-8")
    print(f"bpe: training a 500-token BPE vocab on CS336's corpus.en ({len(text.encode()) / 1e3:.0f} kB)")
    start = time.perf_counter()
    counts = count_pretokens(iter([text]), special_tokens=(special,), show_progress=False)
    pretok_s = time.perf_counter() - start
    native_s = float("inf")
    for _ in range(3):  # best of 3: the first call also loads the extension
        start = time.perf_counter()
        _, merges = train_from_counts(counts, 500, [special], show_progress=False)
        native_s = min(native_s, time.perf_counter() - start)
    start = time.perf_counter()
    python_merges = _naive_python_merges(counts, 500 - 257)
    python_s = time.perf_counter() - start
    shown = ", ".join(f"{(a + b).decode('utf-8', 'replace')!r}" for a, b in merges[:8])
    print(f"  first merges: {shown}, ...")
    print(f"  pre-tokenize {pretok_s * 1e3:.1f} ms; merges: native {native_s * 1e3:.2f} ms (best of 3) vs naive Python "
          f"(recount every step) {python_s * 1e3:.0f} ms = {python_s / native_s:.0f}x, "
          f"identical={merges == python_merges}")


def _naive_python_merges(word_counts: dict[bytes, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """The textbook loop: recount all pairs, take the max (count, left, right), merge everywhere."""
    words = {tuple(bytes([b]) for b in word): count for word, count in word_counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        merged_words = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged_words[tuple(out)] = count
        words = merged_words
    return merges
