"""The bad-input matrix (issue: hardening): every public function x every class of bad input that
applies. Each row must raise ValueError/TypeError (AssertionError-compatible where upstream asserts)
whose message names the argument; rows in ACCEPTED must work. tests/README.md lists the matrix; it is
generated from these tables (`python tests/test_bad_input.py > tests/README.md`) and a test keeps it
current.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from trainfast import bpe, buckets, checkpoint, eplb, pipeline


@dataclass(frozen=True)
class Case:
    function: str
    bad_class: str
    call: Callable[[], object]
    error: type | tuple = (ValueError, TypeError)
    match: str = "."


class _Item:
    """A duck-typed WriteItem."""

    def __init__(self, type, tensor_data=None):
        self.type = type
        self.tensor_data = tensor_data


def _tensor_item(sizes, dtype=torch.float32):
    from types import SimpleNamespace as NS

    from torch.distributed.checkpoint.planner import WriteItemType

    data = NS(chunk=NS(sizes=sizes), size=sizes, properties=NS(dtype=dtype))
    return _Item(WriteItemType.TENSOR, data)


def _cli(*argv: str) -> None:
    """Runs the CLI in-process; a non-zero exit becomes ValueError carrying its log output."""
    out = subprocess.run([sys.executable, "-m", "trainfast.cli", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(out.stderr + out.stdout)


INT64_MAX = np.iinfo(np.int64).max
_TINY_VOCAB = {i: bytes([i]) for i in range(256)} | {256: b"ab"}
_TINY_TOKENIZER = bpe.Tokenizer(_TINY_VOCAB, [(b"a", b"b")])


def _file(name: str, data: bytes) -> str:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="trainfast-bad-input-")) / name
    path.write_bytes(data)
    return str(path)


LAYOUT = buckets.plan_layout([100, 200, 300], bucket_size=256, data_parallel_world_size=2)

CASES: list[Case] = [
    # --- checkpoint.split_by_size_and_type -----------------------------------------------------
    Case("checkpoint.split_by_size_and_type", "wrong type", lambda: checkpoint.split_by_size_and_type("2", []), TypeError, "bins"),
    Case("checkpoint.split_by_size_and_type", "wrong type", lambda: checkpoint.split_by_size_and_type(2, 5), TypeError, "items"),
    Case("checkpoint.split_by_size_and_type", "zero", lambda: checkpoint.split_by_size_and_type(0, []), ValueError, "bins"),
    Case("checkpoint.split_by_size_and_type", "negative", lambda: checkpoint.split_by_size_and_type(-3, []), ValueError, "bins"),
    Case("checkpoint.split_by_size_and_type", "malformed object", lambda: checkpoint.split_by_size_and_type(2, [object()]), TypeError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "negative", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((3, -1))]), ValueError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "int64 overflow", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((2**40, 2**40))]), ValueError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "wrong dtype", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((2,), "f32")]), ValueError, "dtype"),
    Case("checkpoint.split_by_size_and_type", "NaN/inf", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((float("nan"),))]), TypeError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "malformed string", lambda: checkpoint.split_by_size_and_type(2, [], sizing="chunks"), ValueError, "sizing"),
    # --- checkpoint.assign_bins -----------------------------------------------------------------
    Case("checkpoint.assign_bins", "wrong type", lambda: checkpoint.assign_bins({0}, [1], 2), TypeError, "is_bytes"),
    Case("checkpoint.assign_bins", "wrong dtype", lambda: checkpoint.assign_bins([0], [1.5], 2), TypeError, "sizes"),
    Case("checkpoint.assign_bins", "wrong ndim/shape", lambda: checkpoint.assign_bins([[0]], [[1]], 2), ValueError, "is_bytes"),
    Case("checkpoint.assign_bins", "wrong ndim/shape", lambda: checkpoint.assign_bins([0, 1], [1], 2), ValueError, "same length"),
    Case("checkpoint.assign_bins", "negative", lambda: checkpoint.assign_bins([0], [-1], 2), ValueError, "sizes"),
    Case("checkpoint.assign_bins", "zero", lambda: checkpoint.assign_bins([0], [1], 0), ValueError, "bins"),
    Case("checkpoint.assign_bins", "int64 overflow", lambda: checkpoint.assign_bins([0, 0], [INT64_MAX, 1], 2), ValueError, "sizes"),
    Case("checkpoint.assign_bins", "NaN/inf", lambda: checkpoint.assign_bins([0], torch.tensor([float("inf")]), 2), TypeError, "sizes"),
    Case("checkpoint.assign_bins", "malformed string", lambda: checkpoint.assign_bins([0], [1], 2, balance="best"), ValueError, "balance"),
    Case("checkpoint.write_item_sizes", "malformed string", lambda: checkpoint.write_item_sizes([], sizing="x"), ValueError, "sizing"),
    Case("checkpoint.write_item_sizes", "wrong type", lambda: checkpoint.write_item_sizes(3), TypeError, "items"),
    # --- buckets --------------------------------------------------------------------------------------
    Case("buckets.plan_layout", "wrong type", lambda: buckets.plan_layout("100"), TypeError, "numels"),
    Case("buckets.plan_layout", "wrong dtype", lambda: buckets.plan_layout([1.5, 2.0]), TypeError, "numels"),
    Case("buckets.plan_layout", "wrong ndim/shape", lambda: buckets.plan_layout([[1, 2]]), ValueError, "numels"),
    Case("buckets.plan_layout", "negative", lambda: buckets.plan_layout([10, -1]), ValueError, "numels"),
    Case("buckets.plan_layout", "zero", lambda: buckets.plan_layout([10], data_parallel_world_size=0), ValueError, "data_parallel_world_size"),
    Case("buckets.plan_layout", "zero", lambda: buckets.plan_layout([10], bucket_size=0), ValueError, "bucket_size"),
    Case("buckets.plan_layout", "int64 overflow", lambda: buckets.plan_layout([INT64_MAX, INT64_MAX]), ValueError, "numels"),
    Case("buckets.plan_layout", "wrong ndim/shape", lambda: buckets.plan_layout([1, 2], shared_embedding=[True]), ValueError, "shared_embedding"),
    Case("buckets.plan_layout", "NaN/inf", lambda: buckets.plan_layout(np.array([np.nan])), TypeError, "numels"),
    Case("buckets.shard_ranges", "wrong type", lambda: buckets.shard_ranges({"numel": 3}, 2), TypeError, "layout"),
    Case("buckets.shard_ranges", "negative", lambda: buckets.shard_ranges(LAYOUT, 2, rank=-1), ValueError, "rank"),
    Case("buckets.shard_ranges", "indivisible sizes", lambda: buckets.shard_ranges(LAYOUT, 5), ValueError, "data_parallel_world_size must divide"),
    Case("buckets.shard_ranges", "wrong value", lambda: buckets.shard_ranges(LAYOUT, 2, rank=2), ValueError, "rank"),
    Case("buckets.shard_ranges", "zero", lambda: buckets.shard_ranges(LAYOUT, 2, num_threads=0), ValueError, "num_threads"),
    Case("buckets.shard_ranges", "output too large for memory",
         lambda: buckets.shard_ranges(buckets.plan_layout([10**12] * 4, data_parallel_world_size=2**40), 2**40),
         ValueError, r"would need .* GiB"),
    Case("buckets.partition_bucket_indices", "wrong ndim/shape", lambda: buckets.partition_bucket_indices([True], [1, 2]), ValueError, "num_buckets"),
    Case("buckets.partition_bucket_indices", "wrong value", lambda: buckets.partition_bucket_indices([True, True], [1, 2]), ValueError, "is_uint8"),
    Case("buckets.partition_bucket_indices", "negative", lambda: buckets.partition_bucket_indices([False], [-1]), ValueError, "num_buckets"),
    Case("buckets.materialize", "wrong type", lambda: buckets.materialize(LAYOUT, grad_dtype="float32"), TypeError, "grad_dtype"),
    # --- pipeline ---------------------------------------------------------------------------------------
    Case("pipeline.plan_layers", "zero", lambda: pipeline.plan_layers(8, 0, 2), ValueError, "pp"),
    Case("pipeline.plan_layers", "negative", lambda: pipeline.plan_layers(8, 2, -1), ValueError, "vpp"),
    Case("pipeline.plan_layers", "wrong type", lambda: pipeline.plan_layers(8.0, 2, 2), TypeError, "num_layers"),
    Case("pipeline.plan_layers", "indivisible sizes", lambda: pipeline.plan_layers(7, 2, 2), AssertionError, "lost"),
    Case("pipeline.plan_layers", "empty", lambda: pipeline.plan_layers(3, 2, 2, method="uneven"), ValueError, "num_layers"),
    Case("pipeline.plan_layers", "malformed string", lambda: pipeline.plan_layers(8, 2, 2, method="even"), ValueError, "method"),
    Case("pipeline.plan_layers", "wrong ndim/shape", lambda: pipeline.plan_layers(4, 2, 1, method="paddle", stage_ids=[0, 1]), ValueError, "stage_ids"),
    Case("pipeline.balanced_layout", "NaN/inf", lambda: pipeline.balanced_layout([1.0, float("nan"), 1.0], 2), ValueError, "layer_costs"),
    Case("pipeline.balanced_layout", "negative", lambda: pipeline.balanced_layout([1.0, -1.0, 1.0], 2), ValueError, "layer_costs"),
    Case("pipeline.balanced_layout", "empty", lambda: pipeline.balanced_layout([], 2), ValueError, "layer_costs"),
    Case("pipeline.balanced_layout", "wrong ndim/shape", lambda: pipeline.balanced_layout([[1.0, 2.0]], 1), ValueError, "layer_costs"),
    Case("pipeline.balanced_layout", "NaN/inf", lambda: pipeline.balanced_layout([1.0, 1.0], 1, embedding_cost=float("inf")), ValueError, "embedding_cost"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("Et|(tt|L", 2), ValueError, "unbalanced"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("Et|tx|tL", 3), ValueError, "invalid layer character 'x'"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("tE|tt|tL", 3), ValueError, "embedding"),
    # --- eplb --------------------------------------------------------------------------------------------
    Case("eplb.rebalance_experts", "wrong type", lambda: eplb.rebalance_experts("weights", 16, 4, 2, 8), TypeError, "weight"),
    Case("eplb.rebalance_experts", "wrong ndim/shape", lambda: eplb.rebalance_experts(torch.ones(12), 16, 4, 2, 8), AssertionError, "weight"),
    Case("eplb.rebalance_experts", "empty", lambda: eplb.rebalance_experts(torch.ones(0, 12), 16, 4, 2, 8), AssertionError, "weight"),
    Case("eplb.rebalance_experts", "zero", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 0, 8), AssertionError, "num_nodes"),
    Case("eplb.rebalance_experts", "negative", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, -8), AssertionError, "num_gpus"),
    Case("eplb.rebalance_experts", "indivisible sizes", lambda: eplb.rebalance_experts(torch.ones(2, 12), 15, 4, 2, 8), AssertionError, "num_replicas"),
    Case("eplb.rebalance_experts", "indivisible sizes", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 8, 2, 8), AssertionError, "num_groups"),
    Case("eplb.rebalance_experts", "wrong value", lambda: eplb.rebalance_experts(torch.ones(2, 12), 8, 4, 2, 8), AssertionError, "num_replicas"),
    Case("eplb.rebalance_experts", "NaN/inf", lambda: eplb.rebalance_experts(torch.tensor([[1.0, float("nan")]] * 2), 4, 1, 1, 2), ValueError, "layer"),
    Case("eplb.rebalance_experts", "negative", lambda: eplb.rebalance_experts(torch.tensor([[1.0, -2.0]] * 2), 4, 1, 1, 2), ValueError, "layer"),
    Case("eplb.rebalance_experts", "wrong dtype", lambda: eplb.rebalance_experts(torch.ones(2, 4, dtype=torch.complex64), 4, 1, 1, 2), (ValueError, TypeError), "weight"),
    Case("eplb.rebalance_experts", "malformed string", lambda: eplb.rebalance_experts(torch.ones(2, 4), 4, 1, 1, 2, tie_break="random"), ValueError, "tie_break"),
    Case("eplb.rebalance_experts", "output too large for memory", lambda: eplb.rebalance_experts(torch.ones(100_000, 8), 2**30, 1, 1, 8), ValueError, r"would need .* GiB"),
    Case("eplb.balanced_packing", "indivisible sizes", lambda: eplb.balanced_packing(torch.ones(2, 5), 2), AssertionError, "num_packs"),
    Case("eplb.replicate_experts", "wrong value", lambda: eplb.replicate_experts(torch.ones(2, 5), 3), AssertionError, "num_phy"),
    # --- bpe ---------------------------------------------------------------------------------------------
    Case("bpe.pretokenize", "wrong type", lambda: bpe.pretokenize(b"bytes"), TypeError, "text"),
    Case("bpe.pretokenize", "malformed string", lambda: bpe.pretokenize("x", pattern="gpt3"), ValueError, "pattern"),
    Case("bpe.pretokenize", "empty", lambda: bpe.pretokenize("x", special_tokens=[""]), ValueError, "special"),
    Case("bpe.count_pretokens", "missing/unreadable file", lambda: bpe.count_pretokens(["/nonexistent/x.txt"]), OSError, "x.txt"),
    Case("bpe.count_pretokens", "invalid UTF-8", lambda: bpe.count_pretokens(_file("bad.txt", b"ok \xff")), ValueError, "byte offset 3"),
    Case("bpe.count_pretokens", "zero", lambda: bpe.count_pretokens(iter(["x"]), num_threads=0), ValueError, "num_threads"),
    Case("bpe.count_pretokens", "wrong type", lambda: bpe.count_pretokens(iter(["x"]), special_tokens="<|e|>"), TypeError, "special_tokens"),
    Case("bpe.train_bpe", "zero", lambda: bpe.train_bpe(iter(["x"]), 0), ValueError, "vocab_size"),
    Case("bpe.train_bpe", "wrong value", lambda: bpe.train_bpe(iter(["x"]), 256, ["<|e|>"]), ValueError, "vocab_size"),
    Case("bpe.train_bpe", "wrong value", lambda: bpe.train_bpe(iter(["x"]), 300, ["a", "a"]), ValueError, "special"),
    Case("bpe.train_bpe", "missing/unreadable file", lambda: bpe.train_bpe("/nonexistent/corpus.txt", 300), OSError, "corpus.txt"),
    Case("bpe.train_bpe", "invalid UTF-8", lambda: bpe.train_bpe(_file("bad.txt", b"abc\xc3("), 300), ValueError, "byte offset 3"),
    Case("bpe.train_bpe", "malformed string", lambda: bpe.train_bpe(iter(["x"]), 300, errors="loose"), ValueError, "errors"),
    Case("bpe.Tokenizer", "wrong value", lambda: bpe.Tokenizer(_TINY_VOCAB, [(b"a", b"zz")]), ValueError, "merges"),
    Case("bpe.Tokenizer", "wrong type", lambda: bpe.Tokenizer([b"a"], []), TypeError, "vocab"),
    Case("bpe.Tokenizer.decode", "negative", lambda: _TINY_TOKENIZER.decode([-1]), ValueError, "-1"),
    Case("bpe.Tokenizer.decode", "wrong value", lambda: _TINY_TOKENIZER.decode([257]), ValueError, "257"),
    Case("bpe.Tokenizer.decode", "int64 overflow", lambda: _TINY_TOKENIZER.decode([2**70]), (ValueError, OverflowError), "."),
    Case("bpe.Tokenizer.from_files", "missing/unreadable file", lambda: bpe.Tokenizer.from_files("/nonexistent/v.json", "/nonexistent/m.txt"), OSError, "v.json"),
    Case("bpe.Tokenizer.from_files", "malformed string", lambda: bpe.Tokenizer.from_files(_file("v.json", b'{"a": 0,'), _file("m.txt", b"")), ValueError, r"v\.json:1: malformed JSON"),
    Case("bpe.WordCounts.from_bytes", "malformed string", lambda: bpe.WordCounts.from_bytes(b"not a counts file"), ValueError, "."),
    Case("bpe.load", "missing/unreadable file", lambda: bpe.load("/nonexistent/dir"), OSError, "nonexistent"),
    # --- CLI --------------------------------------------------------------------------------------------
    Case("trainfast checkpoint (CLI)", "zero", lambda: _cli("checkpoint", "--bins", "0"), ValueError, "bins"),
    Case("trainfast pipeline (CLI)", "malformed string", lambda: _cli("pipeline", "--method", "layout", "--layout", "E((t|L", "--pp", "2"), ValueError, "unbalanced"),
    Case("trainfast buckets (CLI)", "missing/unreadable file", lambda: _cli("buckets", "--model", "/nonexistent/spec.json"), ValueError, "spec.json"),
    Case("trainfast buckets (CLI)", "zero", lambda: _cli("buckets", "--dp", "0"), ValueError, "dp"),
    Case("trainfast bpe train (CLI)", "missing/unreadable file", lambda: _cli("bpe", "train", "/nonexistent/c.txt", "--vocab-size", "300", "--out", "/tmp/trainfast-never"), ValueError, "c.txt"),
    Case("trainfast eplb (CLI)", "missing/unreadable file", lambda: _cli("eplb", "/nonexistent/loads.npy"), ValueError, "loads.npy"),
]

# Inputs that look unusual but are valid: they must work and equal the plain call.
ACCEPTED: list[tuple[str, str, Callable[[], object], Callable[[], object]]] = [
    ("checkpoint.assign_bins", "non-contiguous/strided tensor",
     lambda: checkpoint.assign_bins(torch.zeros(20, dtype=torch.bool)[::2], torch.arange(20)[::2], 3).order.tolist(),
     lambda: checkpoint.assign_bins([0] * 10, list(range(0, 20, 2)), 3).order.tolist()),
    ("checkpoint.assign_bins", "empty",
     lambda: checkpoint.assign_bins([], [], 3).bin_offsets.tolist(), lambda: [0, 0, 0, 0]),
    ("checkpoint.assign_bins", "numpy unsigned/bool arrays",
     lambda: checkpoint.assign_bins(np.array([True, False]), np.array([5, 6], np.uint32), 2).bin_idx.tolist(),
     lambda: checkpoint.assign_bins([1, 0], [5, 6], 2).bin_idx.tolist()),
    ("buckets.plan_layout", "non-contiguous/strided tensor",
     lambda: buckets.plan_layout(torch.arange(1, 41)[::4], bucket_size=50).param_start.tolist(),
     lambda: buckets.plan_layout(list(range(1, 41, 4)), bucket_size=50).param_start.tolist()),
    ("pipeline.balanced_layout", "requires_grad tensor",
     lambda: pipeline.balanced_layout(torch.ones(8, requires_grad=True), 2, 2)[1],
     lambda: pipeline.balanced_layout([1.0] * 8, 2, 2)[1]),
]
ACCEPTED += [
    ("eplb.rebalance_experts", "non-contiguous/strided tensor",
     lambda: eplb.rebalance_experts(torch.arange(48.0).reshape(4, 12)[::2], 16, 4, 2, 8)[0].tolist(),
     lambda: eplb.rebalance_experts(torch.arange(48.0).reshape(4, 12)[::2].contiguous(), 16, 4, 2, 8)[0].tolist()),
    ("eplb.rebalance_experts", "requires_grad tensor",
     lambda: eplb.rebalance_experts(torch.ones(2, 12, requires_grad=True), 16, 4, 2, 8)[0].tolist(),
     lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8)[0].tolist()),
    ("eplb.rebalance_experts", "integer counts",
     lambda: eplb.rebalance_experts(torch.arange(24).reshape(2, 12), 16, 4, 2, 8)[0].tolist(),
     lambda: eplb.rebalance_experts(torch.arange(24.0).reshape(2, 12), 16, 4, 2, 8)[0].tolist()),
]
if torch.cuda.is_available():  # pragma: no cover - no GPU in CI
    ACCEPTED.append(("pipeline.balanced_layout", "non-CPU tensor",
                     lambda: pipeline.balanced_layout(torch.ones(8, device="cuda"), 2, 2)[1],
                     lambda: pipeline.balanced_layout([1.0] * 8, 2, 2)[1]))


def _case_id(case: Case) -> str:
    return f"{case.function}-{case.bad_class}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_raises_a_clear_error(case: Case):
    with pytest.raises(case.error, match=case.match) as info:
        case.call()
    # A missing file is Python's FileNotFoundError (an OSError); everything else ValueError/TypeError.
    allowed = (ValueError, TypeError, OSError) if case.bad_class == "missing/unreadable file" else (ValueError, TypeError)
    assert isinstance(info.value, allowed), f"{type(info.value).__name__} is not one of {allowed}"
    assert str(info.value).strip(), "the message must say what is wrong"


@pytest.mark.parametrize("function, bad_class, call, plain", ACCEPTED, ids=[f"{a}-{b}" for a, b, _, _ in ACCEPTED])
def test_unusual_but_valid_inputs_work(function, bad_class, call, plain):
    assert call() == plain()


def test_failed_calls_mutate_nothing():
    sizes = torch.tensor([5, -1, 7])
    items = [_tensor_item((2, 2)), object()]
    before = (sizes.clone(), list(items))
    with pytest.raises(ValueError):
        checkpoint.assign_bins([0, 0, 0], sizes, 2)
    with pytest.raises(TypeError):
        checkpoint.split_by_size_and_type(2, items)
    assert torch.equal(sizes, before[0]) and items == before[1]


def matrix_markdown() -> str:
    classes = sorted({c.bad_class for c in CASES} | {b for _, b, _, _ in ACCEPTED})
    functions = list(dict.fromkeys([c.function for c in CASES] + [a for a, _, _, _ in ACCEPTED]))
    rows = []
    for function in functions:
        cells = []
        for bad_class in classes:
            raised = sum(1 for c in CASES if c.function == function and c.bad_class == bad_class)
            accepted = sum(1 for a, b, _, _ in ACCEPTED if a == function and b == bad_class)
            cells.append(f"{raised} err" * bool(raised) + (" + " if raised and accepted else "") + "works" * bool(accepted))
        rows.append(f"| `{function}` | " + " | ".join(cells) + " |")
    header = "| function | " + " | ".join(classes) + " |\n|---|" + "---|" * len(classes)
    return (
        "# Tests\n\n"
        "`make test` runs everything here; `make fuzz` runs the hypothesis tests with the `fuzz` profile\n"
        "(10,000 examples each); `make test-sanitize` runs the suite against an ASan/UBSan build.\n\n"
        "- `reference/`: readable pure-Python oracles; every native path is diffed against them.\n"
        "- `test_<domain>.py`: differential tests, worked examples from the issues, invariants, bad input.\n"
        "- `test_concurrency.py`: many threads at once, fork() after a call, thread-count determinism.\n"
        "- `test_bad_input.py`: the matrix below.\n\n"
        "## Bad-input matrix\n\n"
        "Generated by `python tests/test_bad_input.py > tests/README.md` (a test checks it is current).\n"
        f"{len(CASES)} rejected cases (`N err`: each raises ValueError/TypeError naming the argument, or\n"
        "FileNotFoundError for a missing file) and\n"
        f"{len(ACCEPTED)} unusual-but-valid inputs (`works`), on top of each domain's own bad-input tests.\n\n"
        f"{header}\n" + "\n".join(rows) + "\n"
    )


def test_readme_lists_the_current_matrix():
    readme = Path(__file__).with_name("README.md")
    assert readme.read_text() == matrix_markdown(), "regenerate: python tests/test_bad_input.py > tests/README.md"


if __name__ == "__main__":
    sys.stdout.write(matrix_markdown())
