"""BPE encode/decode with GPT-2's vocabulary: tiktoken vs trainfast.bpe.Tokenizer, single thread and batch.

tiktoken's ``gpt2`` encoding is rebuilt offline from the CS336 fixture (same ranks, tiktoken's own
pattern string); HF ``tokenizers`` runs our exported ``tokenizer.json``. Every row checks that the
ids are identical to tiktoken's.
"""

from __future__ import annotations

import gc
import lzma
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

from _common import markdown_table, parse_args, timeit, write_section  # noqa: E402

from trainfast.bpe import Tokenizer  # noqa: E402

SHARED = Path(os.environ.get("TRAINFAST_SHARED", Path(__file__).resolve().parents[2] / "shared"))
FIXTURES = SHARED / "fixtures" / "cs336"
EOT = "<|endoftext|>"


def corpus(name: str, num_chars: int | None) -> str:
    with lzma.open(SHARED / "corpora" / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        return f.read(num_chars) if num_chars is not None else f.read()


def main() -> None:
    args = parse_args(__doc__)
    from reference.bpe_tokenizer import tiktoken_gpt2

    repeats = 2 if args.quick else 3
    limit = 500_000 if args.quick else None
    tok = Tokenizer.from_files(FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", [EOT])
    enc = tiktoken_gpt2(FIXTURES / "gpt2_vocab.json")
    hf = None
    try:
        import tokenizers

        from trainfast.bpe.export import to_hf_tokenizer_json

        with tempfile.TemporaryDirectory() as tmp:
            to_hf_tokenizer_json(tok.vocab, tok.merges, [EOT], Path(tmp) / "tokenizer.json")
            hf = tokenizers.Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
    except ImportError:
        pass
    num_threads = os.cpu_count() or 1
    rows = []

    def cold(call):
        """Times ``call(tokenizer)`` on a fresh Tokenizer each run: the encoder keeps a cache of
        pre-tokens across calls, and a text it has seen encodes up to ~1.8x faster again."""
        def run():
            fresh = Tokenizer(tok.vocab, tok.merges, [EOT])
            gc.collect()
            start = time.perf_counter()
            result = call(fresh)
            return result, time.perf_counter() - start
        results = [run() for _ in range(repeats)]
        return results[-1][0], statistics.median(seconds for _, seconds in results)

    def row(what: str, num_bytes: int, reference_fn, native_call, hf_fn=None) -> None:
        expected, reference_s = timeit(reference_fn, repeats=repeats)
        got, native_s = cold(native_call)
        hf_cell = "-"
        same = got == expected
        if hf_fn is not None:
            hf_got, hf_s = timeit(hf_fn, repeats=repeats)
            same = same and hf_got == expected
            hf_cell = f"{num_bytes / hf_s / 1e6:.1f}"
        rows.append([what, f"{num_bytes / 1e6:.1f}", f"{num_bytes / reference_s / 1e6:.1f}", hf_cell,
                     f"{num_bytes / native_s / 1e6:.1f}", f"{reference_s / native_s:.2f}x", same])
        print(rows[-1], flush=True)

    for name in ("austen", "kjv", "multilingual", "gcide"):
        text = corpus(name, limit if limit else (8_000_000 if name == "gcide" else None))
        num_bytes = len(text.encode("utf-8"))
        row(f"`encode` {name} (1 thread)", num_bytes, lambda: enc.encode(text, allowed_special="all"),
            lambda t: t.encode(text),
            (lambda: hf.encode(text, add_special_tokens=False).ids) if hf is not None and name == "austen" else None)
        docs = [line for line in text.split("\n") if line]
        row(f"`encode_batch` {name} lines ({len(docs):,} texts, {num_threads} threads)", num_bytes,
            lambda: enc.encode_batch(docs, num_threads=num_threads, allowed_special="all"),
            lambda t: t.encode_batch(docs, num_threads=num_threads),
            (lambda: [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)])
            if hf is not None and name == "austen" else None)
        if name == "austen":
            blocks = [text[k:k + 65536] for k in range(0, len(text), 65536)]
            row(f"`encode_batch` austen 64 KiB blocks ({len(blocks)} texts, {num_threads} threads)", num_bytes,
                lambda: enc.encode_batch(blocks, num_threads=num_threads, allowed_special="all"),
                lambda t: t.encode_batch(blocks, num_threads=num_threads))
            ids = tok.encode(text)
            row("`decode` austen", num_bytes, lambda: enc.decode(ids), lambda t: t.decode(ids))

    header = ["input", "MB", "tiktoken MB/s", "HF tokenizers MB/s", "trainfast MB/s", "vs tiktoken",
              "same ids"]
    table = markdown_table(header, rows)
    print(table)
    if args.write_readme:
        write_section("bpe_encode", "### BPE encode/decode (GPT-2 vocab, `trainfast.bpe.Tokenizer`)\n\n"
                      "tiktoken's gpt2 encoding is rebuilt offline from the CS336 GPT-2 fixture; HF tokenizers "
                      "loads our `to_hf_tokenizer_json` export. Throughput in MB of UTF-8 input per second "
                      "(median of runs); `same ids` checks every output against tiktoken's. tiktoken batch uses "
                      "its own thread pool with the same thread count. Each trainfast call runs on a fresh "
                      "`Tokenizer` (its pre-token cache empty; tiktoken keeps none across calls, HF tokenizers "
                      "keeps its own).\n\n" + table)


if __name__ == "__main__":
    main()
