"""``trainfast bpe count|encode|decode|export`` and ``trainfast bpe train --from-counts``: count
pre-tokens once (and add shards up), train from counts, encode files and decode them back, export to
HF tokenizers.

Adds to the ``bpe`` subcommand that ``trainfast.cli.bpe`` registers (modules register in name order).
"""

from __future__ import annotations

import argparse
import codecs
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_log = logging.getLogger("trainfast.bpe")


def _bpe_commands(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    parser = subparsers.choices["bpe"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the 'bpe' subcommand has no subcommands")  # pragma: no cover


def register(subparsers: argparse._SubParsersAction) -> None:
    from trainfast.cli.bpe import add_pretokenizer_arguments

    commands = _bpe_commands(subparsers)

    count = commands.add_parser("count", help="count pre-tokens of text files into a counts file (addable)")
    count.add_argument("corpus", nargs="+", help="UTF-8 text files")
    count.add_argument("--out", required=True, help="counts file to write (e.g. counts.tfwc)")
    add_pretokenizer_arguments(count)
    count.add_argument("--no-progress", action="store_true", help="no progress bars")
    count.set_defaults(handler=_count_command)

    train = commands.choices["train"]
    train.add_argument("--from-counts", nargs="+", default=None, metavar="COUNTS",
                       help="train from counts files written by `trainfast bpe count` (added up) instead of text")
    for action in train._actions:
        if action.dest == "corpus":
            action.nargs = "*"  # optional when --from-counts is given
    corpus_handler = train.get_default("handler")
    train.set_defaults(handler=lambda args: _train_command(args, corpus_handler))

    encode = commands.add_parser("encode", help="encode a text file to token ids (.npy, uint32)")
    encode.add_argument("input", help="UTF-8 text file")
    _add_tokenizer_args(encode)
    encode.add_argument("--out", required=True, help=".npy file for the ids")
    encode.add_argument("--errors", default="strict", choices=["strict", "replace", "ignore"],
                        help="invalid UTF-8: fail naming the byte offset (default), replace or ignore")
    encode.add_argument("--no-progress", action="store_true", help="no progress bar")
    encode.set_defaults(handler=_encode_command)

    decode = commands.add_parser("decode", help="decode token ids (.npy, as `bpe encode` writes) to a file")
    decode.add_argument("input", help=".npy file of token ids (1-D, integer)")
    decode.add_argument("--tokenizer", required=True, help="directory with vocab.json and merges.txt")
    decode.add_argument("--special-token", action="append", default=[], dest="special_tokens",
                        help="special token (repeatable), in the order given to `bpe encode`")
    decode.add_argument("--out", required=True, help="file for the decoded bytes")
    decode.add_argument("--no-progress", action="store_true", help="no progress bar")
    decode.set_defaults(handler=_decode_command)

    export = commands.add_parser("export", help="write a HF tokenizers tokenizer.json")
    _add_tokenizer_args(export)
    export.add_argument("--hf", required=True, help="tokenizer.json path to write")
    export.set_defaults(handler=_export_command)


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", required=True, help="directory with vocab.json and merges.txt")
    parser.add_argument("--special-token", action="append", default=[], dest="special_tokens",
                        help="special token (repeatable)")
    parser.add_argument("--pattern", default="gpt2", help="gpt2 (default), cl100k, o200k or a regex")


def _count_command(args: argparse.Namespace) -> int:
    from trainfast.bpe.counts import count_words

    start = time.perf_counter()
    counts = count_words([Path(p) for p in args.corpus], args.special_tokens, args.pattern, args.threads,
                         errors=args.errors, show_progress=not args.no_progress)
    path = counts.save(args.out)
    # count_words drops the empty word a custom regex can match, so the total leaves those matches out.
    print(f"bpe count: {len(counts):,} distinct pre-tokens, {counts.total:,} in all (empty matches not counted), "
          f"from {len(args.corpus)} file(s) in {time.perf_counter() - start:.2f} s -> {path}")
    return 0


def _train_command(args: argparse.Namespace, corpus_handler) -> int:
    if args.from_counts is None:
        if not args.corpus:
            raise ValueError("give text files to train on, or --from-counts COUNTS...")
        # count_pretokens reads a list of str as documents; Path objects make them files.
        args.corpus = [Path(p) for p in args.corpus]
        return corpus_handler(args)
    if args.corpus:
        raise ValueError("give either text files or --from-counts, not both")
    # Counts are already pre-tokenized: options of the pre-tokenizer would do nothing.
    for name in ("threads", "errors"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name} reads text files; --from-counts trains on counted pre-tokens")
    from trainfast.bpe import save
    from trainfast.bpe.counts import WordCounts, _pattern_key, train_from_counts
    from trainfast._util import check_output_dir
    from trainfast.cli.bpe import check_special_tokens_fit_vocab_json

    check_output_dir("--out", args.out)  # before the work, not at the save after it
    start = time.perf_counter()
    counts = WordCounts.load(args.from_counts[0])
    for path in args.from_counts[1:]:
        counts += WordCounts.load(path)
    if args.special_tokens:
        check_special_tokens_fit_vocab_json(args.special_tokens)
    else:
        check_special_tokens_fit_vocab_json(list(counts.special_tokens), "the counts' special token")
    # Training never re-reads the text, so --pattern can only be a check: any spelling of the counts'
    # pattern passes ("cl100k_base" is "cl100k", the GPT-2 regex text is "gpt2"), anything else is refused.
    if args.pattern is not None and _pattern_key(args.pattern) != _pattern_key(counts.pattern):
        raise ValueError(f"--pattern {args.pattern!r} differs from the counts' pattern {counts.pattern!r}")
    special_tokens = args.special_tokens or None
    vocab, merges = train_from_counts(counts, args.vocab_size, special_tokens, show_progress=not args.no_progress)
    save(vocab, merges, args.out)
    print(f"bpe: {len(merges):,} merges, vocab {len(vocab):,} from {len(counts):,} counted pre-tokens in "
          f"{time.perf_counter() - start:.2f} s -> {args.out}/vocab.json, merges.txt")
    return 0


def _load_tokenizer(args: argparse.Namespace):
    from trainfast.bpe import Tokenizer

    directory = Path(args.tokenizer)
    return Tokenizer.from_files(directory / "vocab.json", directory / "merges.txt", args.special_tokens,
                                pattern=args.pattern)


def _decoded_chunks(path: str, errors: str, on_progress: Any) -> Iterator[str]:
    """The file's text as Python text mode reads it (UTF-8, universal newlines), in about 1 MiB
    pieces; invalid UTF-8 (errors="strict") raises a ValueError naming the file and byte offset."""
    from trainfast.bpe.pretokenize import _decode_error

    inner = codecs.getincrementaldecoder("utf-8")(errors)
    decoder = io.IncrementalNewlineDecoder(inner, translate=True)
    offset = 0  # bytes read before this block
    with open(path, "rb") as raw:
        while True:
            block = raw.read(1 << 20)
            pending = len(inner.getstate()[0])  # bytes of an unfinished character from the last block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                raise _decode_error(path, error, offset - pending + error.start) from None
            offset += len(block)
            on_progress(offset)
            if text:
                yield text
            if not block:
                return


def _encode_command(args: argparse.Namespace) -> int:
    import numpy as np

    from trainfast._util import Progress, check_output_file, write_atomic

    out = args.out if str(args.out).endswith(".npy") else f"{args.out}.npy"  # the name np.save writes
    check_output_file("--out", args.out, out)  # fail before the work, not after it
    tokenizer = _load_tokenizer(args)
    size = Path(args.input).stat().st_size
    start = time.perf_counter()
    with Progress(enabled=not args.no_progress, total=size, desc="bpe encode", unit="B", logger=_log,
                  describe=lambda done: f"{100 * done / max(size, 1):.0f}% of {args.input}", unit_scale=True,
                  leave=False) as progress:
        ids = np.fromiter(tokenizer.encode_iterable(_decoded_chunks(args.input, args.errors, progress.update_to)),
                          dtype=np.uint32)
    seconds = time.perf_counter() - start
    write_atomic(out, lambda f: np.save(f, ids))  # a failed write keeps the old file, not a truncated one
    print(f"bpe encode: {len(ids):,} tokens from {size / 1e6:.1f} MB in {seconds:.2f} s "
          f"({size / 1e6 / max(seconds, 1e-9):.1f} MB/s) -> {out}")
    return 0


def _decode_command(args: argparse.Namespace) -> int:
    import numpy as np

    from trainfast._util import Progress, check_output_file, write_atomic

    check_output_file("--out", args.out)  # fail before the work, not after it
    with open(args.input, "rb") as f:
        if f.read(6) != b"\x93NUMPY":  # numpy would report a text file as "pickled data"
            raise ValueError(f"{args.input}: not a .npy file (give the ids `trainfast bpe encode` wrote)")
    try:
        ids = np.load(args.input, mmap_mode="r", allow_pickle=False)
    except ValueError as error:
        raise ValueError(f"{args.input}: not a .npy file of token ids ({error})") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{args.input}: token ids must be a 1-D integer array (got shape {ids.shape}, "
                         f"dtype {ids.dtype})")
    args.pattern = "gpt2"  # decoding does not pre-tokenize; any pattern gives the same bytes
    tokenizer = _load_tokenizer(args)
    start = time.perf_counter()
    num_bytes = 0
    progress = Progress(enabled=not args.no_progress, total=len(ids), desc="bpe decode", unit="tok", logger=_log,
                        unit_scale=True, leave=False)

    def write_slices(f: Any) -> None:
        # In slices of 1M ids: memory stays bounded (ids become Python ints) and Ctrl-C is seen between them.
        nonlocal num_bytes
        for begin in range(0, len(ids), 1 << 20):
            part = np.asarray(ids[begin:begin + (1 << 20)])
            try:
                data = tokenizer.decode_bytes(part)
            except ValueError:  # an unknown id: named by its index in the file, not in the slice
                vocab = tokenizer.vocab
                idx = next((k for k, token_id in enumerate(part.tolist()) if token_id not in vocab), None)
                if idx is None:
                    raise
                raise ValueError(f"{args.input}: ids[{begin + idx}] = {part[idx]} is not a token id of this "
                                 "vocabulary") from None
            f.write(data)
            num_bytes += len(data)
            progress.update_to(begin + len(part))

    # The bytes as the tokens hold them: encode read the text with universal newlines, so a file
    # with "\r\n" comes back with "\n", and nothing is replaced (a slice of ids may end mid-character).
    with progress:
        write_atomic(args.out, write_slices)  # a refused id or Ctrl-C leaves no partial file
    print(f"bpe decode: {len(ids):,} tokens -> {num_bytes:,} bytes in {time.perf_counter() - start:.2f} s "
          f"-> {args.out}")
    return 0


def _export_command(args: argparse.Namespace) -> int:
    from trainfast.bpe.export import to_hf_tokenizer_json

    tokenizer = _load_tokenizer(args)
    path = to_hf_tokenizer_json(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, args.hf,
                                pattern=args.pattern)
    print(f"bpe export: {len(tokenizer):,} tokens -> {path}")
    return 0


def demo() -> None:
    import lzma

    from trainfast.bpe import Tokenizer, train_bpe
    from trainfast.cli.bpe import _DEMO_CORPUS

    special = "<|endoftext|>"
    text = lzma.decompress(_DEMO_CORPUS.read_bytes()).decode("utf-8")
    vocab, merges = train_bpe(iter([text]), 1000, [special], show_progress=False)
    tokenizer = Tokenizer(vocab, merges, [special])
    sample = text * 20
    start = time.perf_counter()
    ids = tokenizer.encode(sample)
    ours = time.perf_counter() - start
    line = "bpe encode: 1000-token vocab trained on corpus.en; encoding it 20x "
    line += f"({len(sample.encode()) / 1e6:.1f} MB): {ours * 1e3:.0f} ms"
    try:
        from trainfast.bpe.export import to_tiktoken

        _, encoding = to_tiktoken(vocab, merges, [special])
        start = time.perf_counter()
        expected = encoding.encode(sample, allowed_special="all")
        theirs = time.perf_counter() - start
        line += f" vs tiktoken {theirs * 1e3:.0f} ms = {theirs / ours:.1f}x, identical={ids == expected}"
    except ImportError:
        line += " (tiktoken not installed for comparison)"
    print(line)
    print(f"  round trip decode(encode(text)) == text: {tokenizer.decode(ids) == sample}")
