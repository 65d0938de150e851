"""The bad-input matrix (issue: hardening): every public function x every class of bad input that
applies. Each row must raise ValueError/TypeError (AssertionError-compatible where upstream asserts)
whose message names the argument; rows in ACCEPTED must work. tests/README.md lists the matrix; it is
generated from these tables (`python tests/test_bad_input.py > tests/README.md`) and a test keeps it
current.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainfast import bpe, buckets, checkpoint, eplb, pipeline
from trainfast.bpe import distributed as bpe_distributed
from trainfast.bpe import export as bpe_export
from trainfast.bpe import tokenizer as bpe_tokenizer

with warnings.catch_warnings():
    # The buckets drop-ins import megatron-core lazily; on CPU machines it warns on import.
    warnings.simplefilter("ignore")
    try:
        import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
        import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    except ImportError:
        pass


@dataclass(frozen=True)
class Case:
    function: str
    bad_class: str
    call: Callable[[], object]
    error: type | tuple = (ValueError, TypeError)
    match: str = "."


def _nested_tensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "nested tensors are in prototype stage"
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


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


def _cli_subprocess(*argv: str) -> None:
    """Runs `python -m trainfast.cli`; a non-zero exit becomes ValueError carrying its output."""
    out = subprocess.run([sys.executable, "-m", "trainfast.cli", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(out.stderr + out.stdout)


def _cli(*argv: str) -> None:
    """Runs the CLI's main() in-process; a non-zero exit becomes ValueError carrying what it logged
    and printed (argparse errors included)."""
    import contextlib
    import io
    import logging

    from trainfast.cli import main

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = _Keep(level=logging.ERROR)
    logger = logging.getLogger("trainfast")
    logger.addHandler(handler)
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(list(argv))
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code
    finally:
        logger.removeHandler(handler)
    if code != 0:
        raise ValueError("\n".join(records) + err.getvalue())


INT64_MAX = np.iinfo(np.int64).max
_TINY_VOCAB = {i: bytes([i]) for i in range(256)} | {256: b"ab"}


def _beyond_memory(num_bytes: int) -> None:
    """Skips a case whose output (`num_bytes`) fits in this machine's memory: there it is no error."""
    if os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >= num_bytes:
        pytest.skip(f"this machine has {num_bytes / 2**30:.0f} GiB or more of memory")
_TINY_TOKENIZER = bpe.Tokenizer(_TINY_VOCAB, [(b"a", b"b")])


# The cases are built at import, outside any fixture; one directory removed at exit holds their files.
_TMP_ROOT = tempfile.TemporaryDirectory(prefix="trainfast-bad-input-")


def _file(name: str, data: bytes) -> str:
    path = _dir() / name
    path.write_bytes(data)
    return str(path)


LAYOUT = buckets.plan_layout([100, 200, 300], bucket_size=256, data_parallel_world_size=2)
_BUFFER_WITHOUT_BUCKETS = SimpleNamespace(
    data_parallel_group=SimpleNamespace(rank=lambda: 0, size=lambda: 1), buckets=[], param_index_map={})


def _param(numel: int, requires_grad: bool = True) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(numel), requires_grad=requires_grad)


def _expert_param(numel: int) -> torch.nn.Parameter:
    param = _param(numel)
    param.allreduce = False  # Megatron's mark of an expert-parallel param
    return param


_DDP = SimpleNamespace(pad_buckets_for_high_nccl_busbw=False, grad_reduce_in_fp32=False)
_W = torch.ones(2, 12)
_NAN_ROW = torch.tensor([[1.0, float("nan")] * 6] * 2)
_INF_ROW = torch.tensor([[1.0, float("inf")] * 6] * 2)
_P2L = torch.arange(12).repeat(2, 1)  # a valid [2, 12] placement of _W, one replica each
_CNT = torch.ones(2, 12, dtype=torch.long)


def _config(**fields) -> SimpleNamespace:
    """A TransformerConfig stand-in with only the pipeline fields."""
    return SimpleNamespace(**{"num_layers": 8, "pipeline_model_parallel_size": 2, **fields})


def _plan(num_layers: int = 4, pp: int = 2) -> dict:
    return pipeline.plan_layers(num_layers, pp)


def _dir() -> Path:
    return Path(tempfile.mkdtemp(dir=_TMP_ROOT.name))

def _dir_holding(subdir: str) -> Path:
    """A new temp directory with an empty directory `subdir` in it."""
    path = _dir()
    (path / subdir).mkdir()
    return path


CASES: list[Case] = [
    # --- checkpoint.split_by_size_and_type -----------------------------------------------------
    Case("checkpoint.split_by_size_and_type", "wrong type", lambda: checkpoint.split_by_size_and_type("2", []), TypeError, "bins"),
    Case("checkpoint.split_by_size_and_type", "wrong type", lambda: checkpoint.split_by_size_and_type(2, 5), TypeError, "items"),
    Case("checkpoint.split_by_size_and_type", "zero", lambda: checkpoint.split_by_size_and_type(0, [_tensor_item((2, 2))]), ValueError, "bins"),
    Case("checkpoint.split_by_size_and_type", "negative", lambda: checkpoint.split_by_size_and_type(-3, [_tensor_item((2, 2))]), ValueError, "bins"),
    Case("checkpoint.split_by_size_and_type", "malformed object", lambda: checkpoint.split_by_size_and_type(2, [object()]), TypeError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "negative", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((3, -1))]), ValueError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "int64 overflow", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((2**40, 2**40))]), ValueError, r"items\[0\]"),
    Case("checkpoint.split_by_size_and_type", "wrong dtype", lambda: checkpoint.split_by_size_and_type(2, [_tensor_item((2,), "f32")]), TypeError, "dtype"),
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
    Case("checkpoint.write_item_sizes", "wrong type", lambda: checkpoint.write_item_sizes([], count_bytes="no"), TypeError, "count_bytes must be a bool"),
    Case("checkpoint.write_item_sizes", "wrong type", lambda: checkpoint.write_item_sizes(3), TypeError, "items"),
    # --- buckets --------------------------------------------------------------------------------------
    Case("buckets.plan_layout", "wrong type", lambda: buckets.plan_layout("100"), TypeError, "numels"),
    Case("buckets.plan_layout", "wrong dtype", lambda: buckets.plan_layout([1.5, 2.0]), TypeError, "numels"),
    Case("buckets.plan_layout", "wrong ndim/shape", lambda: buckets.plan_layout([[1, 2]]), ValueError, "numels"),
    Case("buckets.plan_layout", "negative", lambda: buckets.plan_layout([10, -1]), ValueError, "numels"),
    Case("buckets.plan_layout", "zero", lambda: buckets.plan_layout([10], data_parallel_world_size=0), ValueError, "data_parallel_world_size"),
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
    Case("buckets.materialize", "wrong dtype", lambda: buckets.materialize(LAYOUT, grad_dtype=torch.quint8), ValueError, "cannot make a grad_dtype=torch.quint8 buffer"),
    Case("buckets.materialize", "wrong value", lambda: buckets.materialize(LAYOUT, device="xpu"), ValueError, "buffer on device 'xpu'"),
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
    Case("pipeline.balanced_layout", "NaN/inf", lambda: pipeline.balanced_layout([1.0, 1.0], 1, loss_cost=-10**400), ValueError, r"loss_cost must be a finite non-negative number \(got an int of 1329 bits\)"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("Et|(tt|L", 2), ValueError, "unbalanced"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("Et|tx|tL", 3), ValueError, "invalid layer character 'x'"),
    Case("pipeline.PipelineLayout.from_str", "malformed string", lambda: pipeline.PipelineLayout.from_str("tE|tt|tL", 3), ValueError, "embedding"),
    # --- eplb --------------------------------------------------------------------------------------------
    Case("eplb.rebalance_experts", "wrong type", lambda: eplb.rebalance_experts("weights", 16, 4, 2, 8), TypeError, "weight"),
    Case("eplb.rebalance_experts", "wrong dtype", lambda: eplb.rebalance_experts(np.ones((2, 12), dtype=np.longdouble), 16, 4, 2, 8), TypeError, "weight must have a real numeric dtype of at most 64 bits"),
    Case("eplb.rebalance_experts", "wrong type", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8, refine="no"), TypeError, "refine must be a bool"),
    Case("eplb.rebalance_experts", "wrong type", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8, avoid_gpu_duplicates=1), TypeError, "avoid_gpu_duplicates must be a bool"),
    Case("eplb.rebalance_experts", "wrong type", lambda: eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, torch.tensor(8.0)), TypeError, "num_gpus must be an int"),
    Case("pipeline.balanced_layout", "wrong layout", lambda: pipeline.balanced_layout(_nested_tensor(), 2), TypeError, "layer_costs must be a dense tensor of one shape"),
    Case("buckets.plan_layout", "wrong type", lambda: buckets.plan_layout([5], bucket_size=torch.tensor(8.0)), TypeError, "bucket_size must be an int"),
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
    Case("eplb.rebalance_experts", "sparse tensor", lambda: eplb.rebalance_experts(torch.ones(2, 4).to_sparse(), 4, 1, 1, 2), TypeError, "weight must be a dense tensor"),
    Case("eplb.rebalance_experts", "sparse tensor", lambda: eplb.rebalance_experts(torch.ones(2, 4).to_sparse(), 4, None, None, 2, False), TypeError, "weight must be a dense tensor"),
    Case("eplb.rebalance_experts", "wrong dtype", lambda: eplb.rebalance_experts(np.array([[1, "a"]], dtype=object), 4, 1, 1, 2), TypeError, "weight"),
    Case("eplb.rebalance_experts", "ragged", lambda: eplb.rebalance_experts([[1.0, 2.0], [3.0]], 4, 1, 1, 2), ValueError, "weight must be a rectangular"),
    Case("eplb.balanced_packing", "sparse tensor", lambda: eplb.balanced_packing(torch.ones(2, 4).to_sparse(), 2), TypeError, "weight must be a dense tensor"),
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
    Case("bpe.WordCounts.from_bytes", "wrong type", lambda: bpe.WordCounts.from_bytes("abc"), TypeError, "data"),
    Case("bpe.WordCounts.from_bytes", "wrong type", lambda: bpe.WordCounts.from_bytes(None), TypeError, "data"),
    Case("bpe.load", "missing/unreadable file", lambda: bpe.load("/nonexistent/dir"), OSError, "nonexistent"),
    # --- CLI --------------------------------------------------------------------------------------------
    Case("trainfast checkpoint (CLI)", "zero", lambda: _cli("checkpoint", "--bins", "0"), ValueError, "bins"),
    Case("trainfast pipeline (CLI)", "malformed string", lambda: _cli("pipeline", "--method", "layout", "--layout", "E((t|L", "--pp", "2"), ValueError, "unbalanced"),
    Case("trainfast buckets (CLI)", "missing/unreadable file", lambda: _cli("buckets", "--model", "/nonexistent/spec.json"), ValueError, "spec.json"),
    Case("trainfast buckets (CLI)", "zero", lambda: _cli("buckets", "--dp", "0"), ValueError, "dp"),
    Case("trainfast bpe train (CLI)", "missing/unreadable file", lambda: _cli("bpe", "train", "/nonexistent/c.txt", "--vocab-size", "300", "--out", "/tmp/trainfast-never"), ValueError, "c.txt"),
    Case("trainfast eplb (CLI)", "missing/unreadable file", lambda: _cli("eplb", "/nonexistent/loads.npy"), ValueError, "loads.npy"),
]

CASES += [
    # --- checkpoint (more) --------------------------------------------------------------------------
    Case("checkpoint.split_by_size_and_type", "output too large for memory", lambda: checkpoint.split_by_size_and_type(2**60, []), ValueError, r"list of bins would need .* bytes"),
    Case("checkpoint.split_by_size_and_type", "empty", lambda: checkpoint.split_by_size_and_type(2, [_Item(_tensor_item((2,)).type, None)]), ValueError, r"items\[0\]"),
    Case("checkpoint.assign_bins", "output too large for memory", lambda: checkpoint.assign_bins([0], [1], 2**60), ValueError, r"per-bin tables would need"),
    Case("checkpoint.assign_bins", "wrong type", lambda: checkpoint.assign_bins([0], [1], True), TypeError, "bins"),
    Case("checkpoint.assign_bins", "int64 overflow", lambda: checkpoint.assign_bins([0], np.array([2**64 - 1], np.uint64), 2), ValueError, "sizes"),
    Case("checkpoint.write_item_sizes", "malformed object", lambda: checkpoint.write_item_sizes([object()]), TypeError, r"items\[0\]"),
    Case("checkpoint.write_item_sizes", "negative", lambda: checkpoint.write_item_sizes([_tensor_item((-2,))]), ValueError, r"items\[0\]"),
    Case("checkpoint.balance_ratio", "empty", lambda: checkpoint.balance_ratio([]), ValueError, "bin_bytes"),
    Case("checkpoint.balance_ratio", "negative", lambda: checkpoint.balance_ratio([-1, 2]), ValueError, "bin_bytes"),
    Case("checkpoint.balance_ratio", "wrong type", lambda: checkpoint.balance_ratio("12"), TypeError, "bin_bytes"),
    Case("checkpoint.balance_ratio", "NaN/inf", lambda: checkpoint.balance_ratio([1.0, float("nan")]), TypeError, "bin_bytes"),
    # --- buckets: Megatron drop-ins ------------------------------------------------------------------
    Case("buckets.compute_full_param_layout", "wrong type", lambda: buckets.compute_full_param_layout(5, 100, 2, _DDP), TypeError, "params"),
    Case("buckets.compute_full_param_layout", "zero", lambda: buckets.compute_full_param_layout([_param(4)], 100, 0, _DDP), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "negative", lambda: buckets.compute_full_param_layout([_param(4)], 100, -2, _DDP), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "wrong type", lambda: buckets.compute_full_param_layout([_param(4)], 100, 2.0, _DDP), TypeError, "data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "NaN/inf", lambda: buckets.compute_full_param_layout([_param(4)], float("nan"), 2, _DDP), ValueError, "bucket_size"),
    Case("buckets.compute_full_param_layout", "malformed string", lambda: buckets.compute_full_param_layout([_param(4)], "100", 2, _DDP), TypeError, "bucket_size"),
    Case("buckets.compute_full_param_layout", "zero", lambda: buckets.compute_full_param_layout([_param(4), _expert_param(4)], 100, 2, _DDP, 0), ValueError, "expert_data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "wrong value", lambda: buckets.compute_full_param_layout([_param(4, requires_grad=False)], 100, 2, _DDP), AssertionError, r"params\[0\]"),
    Case("buckets.compute_per_buffer_param_layout", "zero", lambda: buckets.compute_per_buffer_param_layout([_param(4)], 10, 0, _DDP), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_per_buffer_param_layout", "negative", lambda: buckets.compute_per_buffer_param_layout([_param(4)], 10, -1, _DDP), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_per_buffer_param_layout", "wrong type", lambda: buckets.compute_per_buffer_param_layout(None, 10, 2, _DDP), TypeError, "params"),
    Case("buckets.compute_default_per_buffer_param_layout", "wrong type", lambda: buckets.compute_default_per_buffer_param_layout(None, 10), TypeError, "params"),
    Case("buckets.group_params_for_buffers", "wrong value", lambda: buckets.group_params_for_buffers([_param(3, requires_grad=False)], False), AssertionError, r"params\[0\]"),
    Case("buckets.group_params_for_buffers", "wrong type", lambda: buckets.group_params_for_buffers(5, False), TypeError, "params"),
    Case("buckets.partition_buckets", "wrong type", lambda: buckets.partition_buckets(5), TypeError, "buffers must be a list"),
    # Upstream fails on the missing attribute: the error is an AttributeError as well as a TypeError.
    Case("buckets.partition_buckets", "malformed object", lambda: buckets.partition_buckets([object()]), AttributeError, r"buffers\[0\] .*\.param_dtype"),
    Case("buckets.build_model_gbuf_range", "wrong type", lambda: buckets.build_model_gbuf_range(None, 0), AttributeError, "param_and_grad_buffer"),
    Case("buckets.build_model_gbuf_range", "wrong value", lambda: buckets.build_model_gbuf_range(_BUFFER_WITHOUT_BUCKETS, 3), IndexError, "bucket_index"),
    Case("buckets.build_model_gbuf_param_range_map", "wrong type", lambda: buckets.build_model_gbuf_param_range_map({}, None, 0), AttributeError, "gbuf_world_range"),
    Case("buckets.shard_ranges", "malformed object", lambda: buckets.shard_ranges(dataclasses.replace(LAYOUT, param_end=LAYOUT.param_end + 10**6), 2), ValueError, "param_end"),
    Case("buckets.partition_bucket_indices", "output too large for memory", lambda: buckets.partition_bucket_indices([False, False], [2**40, 2**40]), ValueError, r"would need .* GiB"),
    Case("buckets.partition_bucket_indices", "int64 overflow", lambda: buckets.partition_bucket_indices([False, False], [2**62, 2**62]), ValueError, "num_buckets"),
    Case("buckets.partition_bucket_indices", "NaN/inf", lambda: buckets.partition_bucket_indices([False], [float("nan")]), TypeError, "num_buckets"),
    Case("buckets.partition_bucket_indices", "wrong type", lambda: buckets.partition_bucket_indices("x", [1]), TypeError, "is_uint8"),
    Case("buckets.default_bucket_size", "zero", lambda: buckets.default_bucket_size(0), ValueError, "data_parallel_world_size"),
    Case("buckets.default_bucket_size", "wrong type", lambda: buckets.default_bucket_size("8"), TypeError, "data_parallel_world_size"),
    Case("buckets.shard_ranges", "wrong type", lambda: buckets.shard_ranges(LAYOUT, 1.5), TypeError, "data_parallel_world_size"),
    Case("buckets.build_model_gbuf_param_range_map", "wrong type", lambda: buckets.build_model_gbuf_param_range_map([], SimpleNamespace(start=0, end=4), 0), TypeError, "param_world_index_map"),
    Case("buckets.build_model_gbuf_param_range_map", "malformed object", lambda: buckets.build_model_gbuf_param_range_map({"p": 3}, SimpleNamespace(start=0, end=4), 0), ValueError, "param_world_index_map"),
    Case("buckets.materialize", "wrong ndim/shape", lambda: buckets.materialize(LAYOUT, shapes=[(3,)]), ValueError, "shapes"),
    Case("buckets.materialize", "negative", lambda: buckets.materialize(LAYOUT, shapes=[(-100,), (200,), (300,)]), ValueError, r"shapes\[0\]"),
    Case("buckets.materialize", "wrong type", lambda: buckets.materialize("layout"), TypeError, "layout"),
    # --- pipeline (more) -----------------------------------------------------------------------------
    Case("pipeline.plan_layers", "output too large for memory", lambda: pipeline.plan_layers(2**40, 2**12, 2**12, method="uneven"), ValueError, r"2\^22 \(got 4096 x 4096\)"),
    Case("pipeline.plan_layers", "int64 overflow", lambda: pipeline.plan_layers(2**41, 2, 2, method="uneven"), ValueError, "num_layers"),
    Case("pipeline.plan_layers", "NaN/inf", lambda: pipeline.plan_layers(float("nan"), 2, 2), TypeError, "num_layers"),
    Case("pipeline.plan_layers", "wrong value", lambda: pipeline.plan_layers(4, 2, 1, method="paddle", stage_ids=[0, -1, 1, 1]), ValueError, r"stage_ids\[1\]"),
    Case("pipeline.plan_layers", "wrong dtype", lambda: pipeline.plan_layers(4, 2, 1, method="paddle", stage_ids=[0.0, 0.5, 1.0, 1.0]), TypeError, "stage_ids"),
    Case("pipeline.balanced_layout", "int64 overflow", lambda: pipeline.balanced_layout([1e308] * 8, 2), ValueError, "layer_costs"),
    Case("pipeline.balanced_layout", "zero", lambda: pipeline.balanced_layout([1.0] * 8, 0), ValueError, "pp"),
    Case("pipeline.balanced_layout", "wrong type", lambda: pipeline.balanced_layout("1,2", 1), TypeError, "layer_costs"),
    Case("pipeline.balanced_layout", "output too large for memory", lambda: pipeline.balanced_layout([1.0] * 8, 2**23), ValueError, "pp"),
    Case("pipeline.chunk_costs", "NaN/inf", lambda: pipeline.chunk_costs(_plan(), [1.0, float("nan"), 1.0, 1.0], 2), ValueError, r"layer_costs\[1\]"),
    Case("pipeline.chunk_costs", "int64 overflow", lambda: pipeline.chunk_costs(_plan(), [1e308] * 4, 2), ValueError, "layer_costs"),
    Case("pipeline.chunk_costs", "wrong ndim/shape", lambda: pipeline.chunk_costs(_plan(), [1.0] * 3, 2), ValueError, "layer_costs"),
    Case("pipeline.chunk_costs", "wrong type", lambda: pipeline.chunk_costs("plan", [1.0] * 4, 2), TypeError, "plan"),
    Case("pipeline.chunk_costs", "malformed object", lambda: pipeline.chunk_costs({(0, 0): range(0, 3)}, [1.0] * 4, 2), ValueError, "plan"),
    Case("pipeline.to_layout_str", "zero", lambda: pipeline.to_layout_str({}, 0), ValueError, "pp"),
    Case("pipeline.to_layout_str", "malformed object", lambda: pipeline.to_layout_str({(0, 0): range(0, 2), (1, 0): range(3, 4)}, 2), ValueError, r"plan\[\(1, 0\)\]"),
    Case("pipeline.get_num_layers_to_build", "malformed object", lambda: pipeline.get_num_layers_to_build(object(), pp_rank=0), TypeError, "config"),
    Case("pipeline.get_num_layers_to_build", "negative", lambda: pipeline.get_num_layers_to_build(_config(num_layers=-4), pp_rank=0), ValueError, "num_layers"),
    Case("pipeline.get_num_layers_to_build", "zero", lambda: pipeline.get_num_layers_to_build(_config(pipeline_model_parallel_size=0), pp_rank=0), ValueError, "pipeline_model_parallel_size"),
    Case("pipeline.get_num_layers_to_build", "wrong value", lambda: pipeline.get_num_layers_to_build(_config(), pp_rank=2), AssertionError, "pp_rank"),
    Case("pipeline.get_num_layers_to_build", "indivisible sizes", lambda: pipeline.get_num_layers_to_build(_config(num_layers=5), pp_rank=0), AssertionError, "layer 4 would be lost"),
    Case("pipeline.get_num_layers_to_build", "wrong type", lambda: pipeline.get_num_layers_to_build(_config(num_layers=4.0), pp_rank=0), TypeError, "num_layers"),
    Case("pipeline.get_num_layers_to_build", "malformed string", lambda: pipeline.get_num_layers_to_build(_config(num_layers=4, pipeline_model_parallel_layout="E(tt|L"), pp_rank=0), ValueError, "layout"),
    Case("pipeline.get_transformer_layer_offset", "wrong value", lambda: pipeline.get_transformer_layer_offset(_config(virtual_pipeline_model_parallel_size=2), vp_stage=5, pp_rank=0), AssertionError, "vp_stage"),
    Case("pipeline.get_transformer_layer_offset", "negative", lambda: pipeline.get_transformer_layer_offset(_config(), pp_rank=-1), AssertionError, "pp_rank"),
    Case("pipeline.get_transformer_layer_offset", "wrong type", lambda: pipeline.get_transformer_layer_offset(_config(), pp_rank="0"), TypeError, "pp_rank"),
    Case("pipeline.PipelineLayout.from_list", "wrong value", lambda: pipeline.PipelineLayout.from_list([["embedding", "foo"]], 1), ValueError, "foo"),
    Case("pipeline.PipelineLayout.from_list", "zero", lambda: pipeline.PipelineLayout.from_list([["embedding"], ["loss"]], 0), ValueError, "pipeline_model_parallel_size"),
    Case("pipeline.PipelineLayout.from_list", "indivisible sizes", lambda: pipeline.PipelineLayout.from_list([["embedding"], ["decoder"], ["loss"]], 2), ValueError, "multiple of pipeline_model_parallel_size"),
    Case("pipeline.PipelineLayout.from_megatron", "malformed object", lambda: pipeline.PipelineLayout.from_megatron(object()), TypeError, "layout"),
    Case("pipeline.PipelineLayout.from_str", "output too large for memory", lambda: pipeline.PipelineLayout.from_str("E|(t|)*99999999999|L", 2), ValueError, "repeat count larger than"),
    Case("pipeline.PipelineLayout.from_str", "empty", lambda: pipeline.PipelineLayout.from_str("", 1), ValueError, "no layers"),
    Case("pipeline.PipelineLayout.from_str", "wrong type", lambda: pipeline.PipelineLayout.from_str(b"Et|tL", 2), TypeError, "layout"),
    Case("pipeline.PipelineLayout.from_str", "invalid UTF-8", lambda: pipeline.PipelineLayout.from_str("Et|t\u00e9L", 2), ValueError, "invalid layer character"),
    # --- eplb (more) ----------------------------------------------------------------------------------
    Case("eplb.rebalance_experts", "wrong value", lambda: eplb.rebalance_experts(_W, 16, 4, 2, 8, previous_phy2log=torch.zeros(2, 5, dtype=torch.long)), ValueError, "previous_phy2log"),
    Case("eplb.rebalance_experts", "wrong dtype", lambda: eplb.rebalance_experts(_W, 16, 4, 2, 8, previous_phy2log=torch.zeros(2, 16)), TypeError, "previous_phy2log"),
    Case("eplb.rebalance_experts", "zero", lambda: eplb.rebalance_experts(_W, 16, 4, 2, 8, num_threads=0), ValueError, "num_threads"),
    Case("eplb.rebalance_experts", "NaN/inf", lambda: eplb.rebalance_experts(torch.tensor([[1.0, float("inf")]] * 2), 4, 1, 1, 2), ValueError, "layer"),
    Case("eplb.rebalance_experts_hierarchical", "wrong dtype", lambda: eplb.rebalance_experts_hierarchical(_W.double(), 16, 4, 2, 8), TypeError, "weight"),
    Case("eplb.rebalance_experts_hierarchical", "wrong type", lambda: eplb.rebalance_experts_hierarchical("w", 16, 4, 2, 8), TypeError, "weight"),
    Case("eplb.rebalance_experts_hierarchical", "wrong ndim/shape", lambda: eplb.rebalance_experts_hierarchical(torch.ones(12), 16, 4, 2, 8), AssertionError, "weight"),
    Case("eplb.rebalance_experts_hierarchical", "too large", lambda: eplb.rebalance_experts_hierarchical(_W, 2**40, 4, 2, 8), ValueError, "num_physical_experts must be < 2\\^31"),
    Case("eplb.rebalance_experts_hierarchical", "empty", lambda: eplb.rebalance_experts_hierarchical(torch.ones(0, 12), 16, 4, 2, 8), AssertionError, "weight"),
    Case("eplb.rebalance_experts_hierarchical", "zero", lambda: eplb.rebalance_experts_hierarchical(_W, 16, 0, 2, 8), AssertionError, "num_groups"),
    Case("eplb.rebalance_experts_hierarchical", "negative", lambda: eplb.rebalance_experts_hierarchical(_W, -16, 4, 2, 8), AssertionError, "num_physical_experts"),
    Case("eplb.rebalance_experts_hierarchical", "indivisible sizes", lambda: eplb.rebalance_experts_hierarchical(_W, 16, 5, 1, 8), AssertionError, "num_groups"),
    Case("eplb.rebalance_experts_hierarchical", "NaN/inf", lambda: eplb.rebalance_experts_hierarchical(_NAN_ROW, 16, 4, 2, 8), ValueError, r"weight\[0, 1\]"),
    Case("eplb.rebalance_experts_hierarchical", "NaN/inf", lambda: eplb.rebalance_experts_hierarchical(_INF_ROW, 16, 4, 2, 8), ValueError, r"weight\[0, 1\]"),
    Case("eplb.rebalance_experts_hierarchical", "negative", lambda: eplb.rebalance_experts_hierarchical(-_W, 16, 4, 2, 8), ValueError, r"weight\[0, 0\]"),
    Case("eplb.rebalance_experts_hierarchical", "malformed string", lambda: eplb.rebalance_experts_hierarchical(_W, 16, 4, 2, 8, tie_break="x"), ValueError, "tie_break"),
    Case("eplb.rebalance_experts_hierarchical", "wrong type", lambda: eplb.rebalance_experts_hierarchical(_W, 16.0, 4, 2, 8), TypeError, "num_physical_experts"),
    Case("eplb.rebalance_experts_hierarchical", "output too large for memory", lambda: eplb.rebalance_experts_hierarchical(torch.ones(100_000, 8), 2**30, 1, 1, 8), ValueError, r"would need .* GiB"),
    Case("eplb.balanced_packing", "wrong type", lambda: eplb.balanced_packing("w", 2), TypeError, "weight"),
    Case("eplb.balanced_packing", "wrong ndim/shape", lambda: eplb.balanced_packing(torch.ones(4), 2), AssertionError, "weight"),
    Case("eplb.balanced_packing", "zero", lambda: eplb.balanced_packing(torch.ones(2, 4), 0), AssertionError, "num_packs"),
    Case("eplb.balanced_packing", "negative", lambda: eplb.balanced_packing(torch.ones(2, 4), -2), AssertionError, "num_packs"),
    Case("eplb.balanced_packing", "NaN/inf", lambda: eplb.balanced_packing(torch.tensor([[1.0, float("nan"), 1.0, 1.0]]), 2), ValueError, r"weight\[0, 1\]"),
    Case("eplb.balanced_packing", "wrong dtype", lambda: eplb.balanced_packing(torch.ones(2, 4, dtype=torch.bool), 2), TypeError, "weight"),
    Case("eplb.balanced_packing", "wrong dtype", lambda: eplb.balanced_packing(torch.ones(2, 4, dtype=torch.complex64), 2), TypeError, "weight"),
    Case("eplb.replicate_experts", "zero", lambda: eplb.replicate_experts(torch.ones(2, 4), 0), AssertionError, "num_phy"),
    Case("eplb.replicate_experts", "wrong type", lambda: eplb.replicate_experts("w", 4), TypeError, "weight"),
    Case("eplb.replicate_experts", "NaN/inf", lambda: eplb.replicate_experts(torch.tensor([[1.0, float("nan")]]), 4), ValueError, r"weight\[0, 1\]"),
    Case("eplb.replicate_experts", "empty", lambda: eplb.replicate_experts(torch.ones(2, 0), 4), AssertionError, "weight"),
    Case("eplb.replicate_experts", "wrong ndim/shape", lambda: eplb.replicate_experts(torch.ones(1, 2, 4), 4), AssertionError, "weight"),
    Case("eplb.replicate_experts", "wrong type", lambda: eplb.replicate_experts(torch.ones(2, 4), 4.5), TypeError, "num_phy"),
    Case("eplb.replicate_experts", "output too large for memory", lambda: eplb.replicate_experts(torch.ones(100_000, 8), 2**30), ValueError, r"would need .* GiB"),
    Case("eplb.gpu_loads", "wrong type", lambda: eplb.gpu_loads(_W, "p2l", _CNT, 2), TypeError, "phy2log"),
    Case("eplb.gpu_loads", "wrong type", lambda: eplb.gpu_loads(_W, _P2L, _CNT, 2.0), TypeError, "num_gpus"),
    Case("eplb.gpu_loads", "wrong dtype", lambda: eplb.gpu_loads(_W, _P2L.float(), _CNT, 2), TypeError, "phy2log"),
    Case("eplb.gpu_loads", "wrong dtype", lambda: eplb.gpu_loads(_W, _P2L, _CNT.float(), 2), TypeError, "logcnt"),
    Case("eplb.gpu_loads", "wrong ndim/shape", lambda: eplb.gpu_loads(_W, _P2L[0], _CNT, 2), ValueError, "phy2log"),
    Case("eplb.gpu_loads", "wrong ndim/shape", lambda: eplb.gpu_loads(_W, _P2L[:1], _CNT, 2), ValueError, "phy2log"),
    Case("eplb.gpu_loads", "wrong ndim/shape", lambda: eplb.gpu_loads(_W, _P2L, _CNT[:, :5], 2), ValueError, "logcnt"),
    Case("eplb.gpu_loads", "wrong ndim/shape", lambda: eplb.gpu_loads(torch.ones(12), _P2L, _CNT, 2), AssertionError, "weight"),
    Case("eplb.gpu_loads", "empty", lambda: eplb.gpu_loads(_W, torch.zeros(2, 0, dtype=torch.long), _CNT, 2), ValueError, "phy2log"),
    Case("eplb.gpu_loads", "zero", lambda: eplb.gpu_loads(_W, _P2L, _CNT, 0), AssertionError, "num_gpus"),
    Case("eplb.gpu_loads", "zero", lambda: eplb.gpu_loads(_W, _P2L, _CNT * 0, 2), ValueError, r"logcnt\[0, 0\]"),
    Case("eplb.gpu_loads", "negative", lambda: eplb.gpu_loads(_W, -_P2L - 1, _CNT, 2), ValueError, r"phy2log\[0, 0\]"),
    Case("eplb.gpu_loads", "wrong value", lambda: eplb.gpu_loads(_W, _P2L + 12, _CNT, 2), ValueError, r"phy2log\[0, 0\]"),
    Case("eplb.gpu_loads", "indivisible sizes", lambda: eplb.gpu_loads(_W, _P2L, _CNT, 5), ValueError, "num_gpus"),
    Case("eplb.gpu_loads", "NaN/inf", lambda: eplb.gpu_loads(_NAN_ROW, _P2L, _CNT, 2), ValueError, r"weight\[0, 1\]"),
    Case("eplb.gpu_loads", "NaN/inf", lambda: eplb.gpu_loads(_W.index_put((torch.tensor(1), torch.tensor(3)), torch.tensor(float("inf"))), _P2L, _CNT, 2), ValueError, r"weight\[1, 3\] must be a finite, non-negative load \(got inf\)"),
    Case("eplb.balancedness", "negative", lambda: eplb.balancedness(_W.index_put((torch.tensor(0), torch.tensor(2)), torch.tensor(-1e6)), _P2L, _CNT, 2), ValueError, r"weight\[0, 2\] must be a finite, non-negative load"),
    Case("eplb.balancedness", "wrong type", lambda: eplb.balancedness(_W, _P2L, "cnt", 2), TypeError, "logcnt"),
    Case("eplb.balancedness", "wrong ndim/shape", lambda: eplb.balancedness(_W, _P2L[:, None], _CNT, 2), ValueError, "phy2log"),
    Case("eplb.balancedness", "negative", lambda: eplb.balancedness(_W, _P2L, _CNT, -2), AssertionError, "num_gpus"),
    Case("eplb.balancedness", "wrong value", lambda: eplb.balancedness(_W, _P2L, -_CNT, 2), ValueError, "logcnt"),
    Case("eplb.count_moved", "wrong type", lambda: eplb.count_moved(5, _P2L), TypeError, "previous_phy2log"),
    Case("eplb.count_moved", "wrong dtype", lambda: eplb.count_moved(_P2L, _P2L.double()), TypeError, "phy2log"),
    Case("eplb.count_moved", "wrong ndim/shape", lambda: eplb.count_moved(_P2L, _P2L[:, :4]), ValueError, "previous_phy2log"),
    Case("eplb.count_moved", "wrong ndim/shape", lambda: eplb.count_moved(_P2L[0], _P2L[0]), ValueError, "phy2log"),
    Case("eplb.count_moved", "malformed object", lambda: eplb.count_moved([[1, 2], [3]], _P2L), ValueError, "previous_phy2log"),
    # --- bpe (more) -----------------------------------------------------------------------------------
    Case("bpe.save", "wrong type", lambda: bpe.save([b"a"], [], _dir() / "tok"), TypeError, "vocab"),
    Case("bpe.save", "wrong dtype", lambda: bpe.save({0: "a"}, [], _dir() / "tok"), TypeError, "vocab"),
    Case("bpe.save", "negative", lambda: bpe.save({-1: b"a"}, [], _dir() / "tok"), ValueError, "vocab ids"),
    Case("bpe.save", "int64 overflow", lambda: bpe.save({2**70: b"a"}, [], _dir() / "tok"), ValueError, "vocab ids"),
    Case("bpe.save", "malformed object", lambda: bpe.save(_TINY_VOCAB, [(b"a",)], _dir() / "tok"), TypeError, r"merges\[0\]"),
    Case("bpe.save", "wrong value", lambda: bpe.save({0: b"a", 1: b"a"}, [], _dir() / "tok"), ValueError, "cannot hold"),
    Case("bpe.save", "missing/unreadable file", lambda: bpe.save(_TINY_VOCAB, [], _dir_holding("merges.txt")), IsADirectoryError, r"merges\.txt'?: it is a directory"),
    Case("buckets.plan_layout", "wrong type", lambda: buckets.plan_layout([5, 7], use_distributed_optimizer="no"), TypeError, "use_distributed_optimizer must be a bool"),
    Case("buckets.plan_layout", "wrong type", lambda: buckets.plan_layout([5, 7], pad_buckets_for_high_nccl_busbw=1), TypeError, "pad_buckets_for_high_nccl_busbw must be a bool"),
    Case("buckets.partition_bucket_indices", "wrong type", lambda: buckets.partition_bucket_indices([False], [2], force_single_bucket_group="no"), TypeError, "force_single_bucket_group must be a bool"),
    Case("buckets.partition_bucket_indices", "wrong type", lambda: buckets.partition_bucket_indices([False], [2], reduce_scatter_with_fp32_accumulation=None), TypeError, "reduce_scatter_with_fp32_accumulation must be a bool"),
    Case("buckets.materialize", "wrong type", lambda: buckets.materialize(LAYOUT, bind_main_grad="no"), TypeError, "bind_main_grad must be a bool"),
    Case("pipeline.plan_layers", "wrong type", lambda: pipeline.plan_layers(7, 2, 2, account_for_loss_in_pipeline_split="no"), TypeError, "account_for_loss_in_pipeline_split must be a bool"),
    Case("pipeline.plan_layers", "wrong type", lambda: pipeline.plan_layers(7, 2, 2, account_for_embedding_in_pipeline_split=1), TypeError, "account_for_embedding_in_pipeline_split must be a bool"),
    Case("pipeline.PipelineLayout.from_str", "wrong type", lambda: pipeline.PipelineLayout.from_str("Ett|ttL", 2, validate="no"), TypeError, "validate must be a bool"),
    Case("eplb.count_moved", "int64 overflow", lambda: eplb.count_moved([[1, 2**64]], [[1, 2]]), ValueError, r"previous_phy2log\[0, 1\] does not fit in int64"),
    Case("eplb.gpu_loads", "int64 overflow", lambda: eplb.gpu_loads(torch.ones(1, 2), [[0, 2**70]], [[1, 1]], 1), ValueError, r"phy2log\[0, 1\] does not fit in int64"),
    Case("bpe.WordCounts.__add__", "int64 overflow", lambda: bpe.WordCounts({b"ab": 2**62}) + bpe.WordCounts({b"ab": 2**62}), ValueError, "exceeds 2\\^63-1"),
    Case("bpe.save", "wrong dtype", lambda: bpe.save(_TINY_VOCAB, [("a", "b")], _dir() / "tok"), TypeError, r"merges\[0\]"),
    Case("bpe.save", "wrong value", lambda: bpe.save(_TINY_VOCAB, [(b"ab", b"c")], _dir() / "tok"), ValueError, r"merges\[0\].*merged token b'abc' is not in vocab"),
    Case("bpe.save", "wrong value", lambda: bpe.save({0: b"a", 1: b"ab"}, [(b"a", b"b")], _dir() / "tok"), ValueError, r"merges\[0\].*right token b'b' is not in vocab"),
    Case("bpe.save", "wrong type", lambda: bpe.save(_TINY_VOCAB, 5, _dir() / "tok"), TypeError, "merges"),
    Case("bpe.save", "missing/unreadable file", lambda: bpe.save(_TINY_VOCAB, [], _file("not-a-dir", b"x")), OSError, "not-a-dir"),
    Case("bpe.load", "malformed string", lambda: bpe.load(Path(_file("vocab.json", b"")).parent), ValueError, r"vocab\.json:1: malformed JSON"),
    Case("bpe.load", "invalid UTF-8", lambda: bpe.load(Path(_file("vocab.json", b'{"\xff": 0}')).parent), ValueError, r"vocab\.json"),
    Case("bpe.tokenizer.load_vocab", "invalid UTF-8", lambda: bpe_tokenizer.load_vocab(_file("v.json", b'{"\xff": 0}')), ValueError, r"v\.json: not valid UTF-8"),
    Case("bpe.tokenizer.load_vocab", "malformed object", lambda: bpe_tokenizer.load_vocab(_file("v.json", b"[1, 2]")), ValueError, r"v\.json:1"),
    Case("bpe.tokenizer.load_vocab", "negative", lambda: bpe_tokenizer.load_vocab(_file("v.json", b'{"a": -1}')), ValueError, "id of 'a'"),
    Case("bpe.tokenizer.load_vocab", "wrong dtype", lambda: bpe_tokenizer.load_vocab(_file("v.json", b'{"a": 1.5}')), ValueError, "id of 'a'"),
    Case("bpe.tokenizer.load_vocab", "wrong value", lambda: bpe_tokenizer.load_vocab(_file("v.json", b'{"a": 1, "b": 1}')), ValueError, "already used"),
    Case("bpe.tokenizer.load_vocab", "int64 overflow", lambda: bpe_tokenizer.load_vocab(_file("v.json", b'{"a": 99999999999999999999999}')), ValueError, "id of 'a'"),
    Case("bpe.tokenizer.load_vocab", "malformed string", lambda: bpe_tokenizer.load_vocab(_file("v.json", "{\"\u4e00\": 1}".encode())), ValueError, "byte map"),
    Case("bpe.tokenizer.load_vocab", "missing/unreadable file", lambda: bpe_tokenizer.load_vocab("/nonexistent/v.json"), OSError, "v.json"),
    Case("bpe.tokenizer.load_merges", "malformed string", lambda: bpe_tokenizer.load_merges(_file("m.txt", b"a b c\n")), ValueError, r"m\.txt:1"),
    Case("bpe.tokenizer.load_merges", "invalid UTF-8", lambda: bpe_tokenizer.load_merges(_file("m.txt", b"a \xff\n")), ValueError, r"m\.txt: not valid UTF-8"),
    Case("bpe.tokenizer.load_merges", "missing/unreadable file", lambda: bpe_tokenizer.load_merges("/nonexistent/m.txt"), OSError, "m.txt"),
    Case("bpe.Tokenizer", "wrong type", lambda: bpe.Tokenizer(_TINY_VOCAB, 5), TypeError, "merges"),
    Case("bpe.Tokenizer", "wrong type", lambda: bpe.Tokenizer(_TINY_VOCAB, [], {"<a>", "<b>"}), TypeError, "special_tokens must be an ordered sequence"),
    Case("bpe.Tokenizer", "wrong type", lambda: bpe.Tokenizer(_TINY_VOCAB, [], pattern=re.compile(rb"\w+")), TypeError, "pattern must be compiled from a str, not bytes"),
    Case("bpe.Tokenizer.decode", "wrong type", lambda: _TINY_TOKENIZER.decode(bytearray(b"ab")), TypeError, "ids must be a sequence of int .got bytearray"),
    Case("bpe.Tokenizer.from_files", "int64 overflow", lambda: bpe.Tokenizer.from_files(_file("v.json", b'{"a": ' + b"9" * 5000 + b"}"), _file("m.txt", b"")), ValueError, r"v\.json:1: id of 'a' must be an int in \[0, 2\^31\) \(got '9999999999999999\.\.\. \(5000 digits\)'\)"),
    Case("bpe.Tokenizer", "wrong dtype", lambda: bpe.Tokenizer(_TINY_VOCAB, [], [5]), TypeError, r"special_tokens\[0\]"),
    Case("bpe.Tokenizer", "empty", lambda: bpe.Tokenizer(_TINY_VOCAB, [], [""]), ValueError, r"special_tokens\[0\]"),
    Case("bpe.Tokenizer", "malformed string", lambda: bpe.Tokenizer(_TINY_VOCAB, [], pattern="gpt9"), ValueError, "pattern"),
    Case("bpe.Tokenizer", "int64 overflow", lambda: bpe.Tokenizer(_TINY_VOCAB | {2**31: b"abab"}, []), ValueError, "vocab ids"),
    Case("bpe.Tokenizer", "int64 overflow", lambda: bpe.Tokenizer(_TINY_VOCAB | {2**31 - 1: b"abab"}, [], ["<s>"]), ValueError, r"special token '<s>' .* would get id 2147483648"),
    Case("bpe.Tokenizer", "negative", lambda: bpe.Tokenizer(_TINY_VOCAB | {-5: b"abab"}, []), ValueError, "vocab ids"),
    Case("bpe.Tokenizer", "empty", lambda: bpe.Tokenizer({}, []), ValueError, "vocab"),
    Case("bpe.Tokenizer", "empty", lambda: bpe.Tokenizer(_TINY_VOCAB | {300: b""}, []), ValueError, r"vocab\[300\]"),
    Case("bpe.Tokenizer.encode", "wrong type", lambda: _TINY_TOKENIZER.encode(b"ab"), TypeError, "text"),
    Case("bpe.Tokenizer.encode", "wrong type", lambda: _TINY_TOKENIZER.encode(None), TypeError, "text"),
    Case("bpe.Tokenizer.encode_batch", "wrong type", lambda: _TINY_TOKENIZER.encode_batch("abc"), TypeError, "texts"),
    Case("bpe.Tokenizer.encode_batch", "wrong dtype", lambda: _TINY_TOKENIZER.encode_batch(["a", 5]), TypeError, r"texts\[1\]"),
    Case("bpe.Tokenizer.encode_batch", "zero", lambda: _TINY_TOKENIZER.encode_batch(["a"], num_threads=0), ValueError, "num_threads"),
    Case("bpe.Tokenizer.encode_iterable", "wrong type", lambda: list(_TINY_TOKENIZER.encode_iterable(5)), TypeError, "iterable"),
    Case("bpe.Tokenizer.encode_iterable", "wrong dtype", lambda: list(_TINY_TOKENIZER.encode_iterable(["a", 5])), TypeError, "item 1"),
    Case("bpe.Tokenizer.decode", "wrong type", lambda: _TINY_TOKENIZER.decode("abc"), TypeError, "ids"),
    Case("bpe.Tokenizer.decode", "wrong dtype", lambda: _TINY_TOKENIZER.decode([1.5]), TypeError, r"ids\[0\]"),
    Case("bpe.Tokenizer.decode_bytes", "negative", lambda: _TINY_TOKENIZER.decode_bytes([-1]), ValueError, r"ids\[0\]"),
    Case("bpe.pretokenize", "wrong type", lambda: bpe.pretokenize(None), TypeError, "text"),
    Case("bpe.pretokenize", "wrong dtype", lambda: bpe.pretokenize("x", special_tokens=[5]), TypeError, r"special_tokens\[0\]"),
    Case("bpe.pretokenize", "wrong type", lambda: bpe.pretokenize("x", special_tokens="abc"), TypeError, "special_tokens"),
    Case("bpe.pretokenize", "malformed string", lambda: bpe.pretokenize("x", pattern="("), ValueError, "pattern"),
    Case("bpe.count_pretokens", "negative", lambda: bpe.count_pretokens(iter(["x"]), num_threads=-1), ValueError, "num_threads"),
    Case("bpe.count_pretokens", "malformed string", lambda: bpe.count_pretokens(iter(["x"]), errors="x"), ValueError, "errors"),
    Case("bpe.count_pretokens", "wrong type", lambda: bpe.count_pretokens(5), TypeError, "inputs"),
    Case("bpe.count_pretokens", "wrong dtype", lambda: bpe.count_pretokens(iter([5])), TypeError, r"inputs\[0\]"),
    Case("bpe.count_pretokens", "invalid UTF-8", lambda: bpe.count_pretokens(iter(["a\ud800"])), ValueError, r"inputs\[0\]"),
    Case("bpe.count_pretokens", "missing/unreadable file", lambda: bpe.count_pretokens(str(_dir())), OSError, "trainfast-bad-input"),
    Case("bpe.count_words", "zero", lambda: bpe.count_words(iter(["x"]), num_threads=0), ValueError, "num_threads"),
    Case("bpe.count_words", "missing/unreadable file", lambda: bpe.count_words("/nonexistent/x.txt"), OSError, "x.txt"),
    Case("bpe.count_words", "invalid UTF-8", lambda: bpe.count_words(_file("bad.txt", b"ok \xff")), ValueError, "byte offset 3"),
    Case("bpe.train_bpe", "negative", lambda: bpe.train_bpe(iter(["x"]), -5), ValueError, "vocab_size"),
    Case("bpe.train_bpe", "wrong type", lambda: bpe.train_bpe(iter(["x"]), 300.0), TypeError, "vocab_size"),
    Case("bpe.train_bpe", "empty", lambda: bpe.train_bpe(iter(["x"]), 300, [""]), ValueError, "special_tokens"),
    Case("bpe.train_bpe", "wrong dtype", lambda: bpe.train_bpe(iter(["x"]), 300, [5]), TypeError, "special_tokens"),
    Case("bpe.train_bpe", "malformed string", lambda: bpe.train_bpe(iter(["x"]), 300, pattern="("), ValueError, "pattern"),
    Case("bpe.train_bpe", "zero", lambda: bpe.train_bpe(iter(["x"]), 300, num_threads=0), ValueError, "num_threads"),
    Case("bpe.train_from_counts", "negative", lambda: bpe.train_from_counts({b"ab": -1}, 300), ValueError, "word_counts"),
    Case("bpe.train_from_counts", "zero", lambda: bpe.train_from_counts({b"ab": 0}, 300), ValueError, "word_counts"),
    Case("bpe.train_from_counts", "wrong dtype", lambda: bpe.train_from_counts({"ab": 1}, 300), TypeError, "word_counts"),
    Case("bpe.train_from_counts", "wrong dtype", lambda: bpe.train_from_counts({b"ab": 1.5}, 300), TypeError, "word_counts"),
    Case("bpe.train_from_counts", "int64 overflow", lambda: bpe.train_from_counts({b"ab": 2**62, b"abc": 2**62}, 300), ValueError, "word_counts"),
    Case("bpe.train_from_counts", "int64 overflow", lambda: bpe.train_from_counts({b"ab": 2**64}, 300), ValueError, "word_counts"),
    Case("bpe.train_from_counts", "wrong type", lambda: bpe.train_from_counts([b"ab"], 300), TypeError, "word_counts"),
    Case("bpe.train_from_counts", "wrong value", lambda: bpe.train_from_counts({b"ab": 1}, 100), ValueError, "vocab_size"),
    Case("bpe.train_from_counts", "NaN/inf", lambda: bpe.train_from_counts({b"ab": float("nan")}, 300), TypeError, "word_counts"),
    Case("bpe.WordCounts.load", "missing/unreadable file", lambda: bpe.WordCounts.load("/nonexistent/c.tfwc"), OSError, "c.tfwc"),
    Case("bpe.WordCounts.load", "malformed string", lambda: bpe.WordCounts.load(_file("g.tfwc", b"\x00" * 100)), ValueError, r"g\.tfwc"),
    Case("bpe.WordCounts.from_bytes", "wrong value", lambda: bpe.WordCounts.from_bytes(bpe.count_words(iter(["hello world"]), show_progress=False).to_bytes()[:-3]), ValueError, "truncated"),
    Case("bpe.export.to_hf_tokenizer_json", "wrong value", lambda: bpe_export.to_hf_tokenizer_json(_TINY_VOCAB, [(b"a", b"zz")], None, _dir() / "t.json"), ValueError, r"merges\[0\]"),
    Case("bpe.export.to_hf_tokenizer_json", "malformed string", lambda: bpe_export.to_hf_tokenizer_json(_TINY_VOCAB, [], None, _dir() / "t.json", pattern="("), ValueError, "pattern"),
    Case("bpe.export.to_tiktoken", "wrong dtype", lambda: bpe_export.to_tiktoken({0: "a"}, [], None), TypeError, r"vocab\[0\]"),
    Case("bpe.export.to_tiktoken", "wrong dtype", lambda: bpe_export.to_tiktoken(_TINY_VOCAB, [], [5]), TypeError, r"special_tokens\[0\]"),
    Case("bpe.distributed.shard_files", "zero", lambda: bpe_distributed.shard_files([_file("a.txt", b"x")], 0), ValueError, "world_size"),
    Case("bpe.distributed.shard_files", "missing/unreadable file", lambda: bpe_distributed.shard_files("/nonexistent/abc.txt", 2), OSError, "abc.txt"),
    Case("bpe.distributed.shard_files", "wrong type", lambda: bpe_distributed.shard_files(5, 2), TypeError, "paths"),
    # --- CLI (more) -----------------------------------------------------------------------------------
    Case("trainfast (CLI, subprocess)", "malformed string", lambda: _cli_subprocess("checkpoint", "--bins", "many"), ValueError, "--bins"),
    Case("trainfast checkpoint (CLI)", "negative", lambda: _cli("checkpoint", "--bins", "-2"), ValueError, "bins"),
    Case("trainfast checkpoint (CLI)", "malformed string", lambda: _cli("checkpoint", "--layers", "4x"), ValueError, "--layers"),
    Case("trainfast checkpoint (CLI)", "negative", lambda: _cli("checkpoint", "--layers", "-1"), ValueError, "layers"),
    Case("trainfast pipeline (CLI)", "zero", lambda: _cli("pipeline", "--pp", "0"), ValueError, "pp"),
    Case("trainfast checkpoint (CLI)", "output too large for memory", lambda: _cli("checkpoint", "--layers", "1", "--bins", "99999999999999"), ValueError, "--bins"),
    Case("trainfast pipeline (CLI)", "negative", lambda: _cli("pipeline", "--method", "balanced", "--random-costs", "-1"), ValueError, "--random-costs"),
    Case("trainfast pipeline (CLI)", "negative", lambda: _cli("pipeline", "--method", "balanced", "--random-costs", "1", "--num-layers", "-3"), ValueError, "--num-layers"),
    Case("trainfast pipeline (CLI)", "output too large for memory", lambda: _cli("pipeline", "--method", "balanced", "--random-costs", "1", "--num-layers", str(2**62)), ValueError, "--num-layers"),
    Case("trainfast pipeline (CLI)", "NaN/inf", lambda: _cli("pipeline", "--method", "balanced", "--costs", "1,nan,1,1", "--pp", "2"), ValueError, "cost"),
    Case("trainfast pipeline (CLI)", "malformed string", lambda: _cli("pipeline", "--method", "paddle", "--stage-ids", "0,x", "--pp", "2"), ValueError, "stage"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--method", "bogus"), ValueError, "--method"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--method", "layout", "--layout", "Ett|tt|tt|tL", "--pp", "2", "--vpp", "3"), ValueError, "--vpp 3 differs"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--method", "layout", "--layout", "Ett|tt|tt|tL", "--pp", "2", "--first", "5"), ValueError, "--first is not used"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--method", "balanced", "--random-costs", "1", "--account-for-loss"), ValueError, "--account-for-loss is not used"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--layout", "Et|tL"), ValueError, "--layout is not used by --method megatron"),
    Case("trainfast pipeline (CLI)", "wrong value", lambda: _cli("pipeline", "--method", "balanced", "--num-layers", "2", "--pp", "2", "--costs", "1,1", "--random-costs", "3"), ValueError, "--costs or --random-costs, not both"),
    Case("trainfast pipeline (CLI)", "indivisible sizes", lambda: _cli("pipeline", "--num-layers", "7", "--pp", "2"), ValueError, "lost"),
    Case("trainfast buckets (CLI)", "negative", lambda: _cli("buckets", "--bucket-size", "-5"), ValueError, "bucket"),
    Case("trainfast buckets (CLI)", "zero", lambda: _cli("buckets", "--expert-dp", "0"), ValueError, "dp"),
    Case("trainfast buckets (CLI)", "malformed string", lambda: _cli("buckets", "--model", _file("spec.json", b"{not json")), ValueError, "spec.json"),
    Case("trainfast buckets (CLI)", "negative", lambda: _cli("buckets", "--layers", "-1"), ValueError, "layers"),
    Case("trainfast bpe train (CLI)", "wrong value", lambda: _cli("bpe", "train", _file("c.txt", b"hello"), "--vocab-size", "10", "--out", str(_dir() / "o")), ValueError, "vocab_size"),
    Case("trainfast bpe train (CLI)", "wrong value", lambda: _cli("bpe", "train", _file("c.txt", b"hello"), "--vocab-size", "300", "--special-token", "a", "--out", str(_dir() / "o")), ValueError, "--special-token 'a' is one byte"),
    Case("trainfast bpe train (CLI)", "invalid UTF-8", lambda: _cli("bpe", "train", _file("c.txt", b"ok \xff"), "--vocab-size", "300", "--out", str(_dir() / "o"), "--no-progress"), ValueError, "byte offset 3"),
    Case("trainfast bpe train (CLI)", "malformed string", lambda: _cli("bpe", "train", _file("c.txt", b"hello"), "--vocab-size", "300", "--pattern", "(", "--out", str(_dir() / "o")), ValueError, "pattern"),
    Case("trainfast bpe train (CLI)", "zero", lambda: _cli("bpe", "train", _file("c.txt", b"hello"), "--vocab-size", "300", "--threads", "0", "--out", str(_dir() / "o")), ValueError, "threads"),
    Case("trainfast bpe count (CLI)", "missing/unreadable file", lambda: _cli("bpe", "count", "/nonexistent/c.txt", "--out", str(_dir() / "c.tfwc")), ValueError, "c.txt"),
    Case("trainfast bpe encode (CLI)", "missing/unreadable file", lambda: _cli("bpe", "encode", _file("t.txt", b"hi"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir() / "ids.npy")), ValueError, "nonexistent"),
    Case("trainfast bpe encode (CLI)", "wrong value", lambda: _cli("bpe", "encode", _file("t.txt", b"hi"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir()) + "/"), ValueError, "--out .* is a directory"),
    Case("trainfast bpe encode (CLI)", "wrong value", lambda: _cli("bpe", "encode", _file("t.txt", b"hi"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir_holding("ids.npy") / "ids")), ValueError, "--out .* is a directory"),
    Case("pipeline.balanced_layout", "NaN/inf", lambda: pipeline.balanced_layout([1, 10**400, 3], 2), ValueError, "layer_costs holds an int too large for a float"),
    Case("trainfast bpe encode (CLI)", "wrong value", lambda: _cli("bpe", "encode", _file("t.txt", b"hi"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir() / "ids.npy"), "--errors", "bogus"), ValueError, "--errors"),
    Case("trainfast bpe decode (CLI)", "missing/unreadable file", lambda: _cli("bpe", "decode", "/nonexistent/ids.npy", "--tokenizer", "/nonexistent/tok", "--out", str(_dir() / "t.txt")), ValueError, "nonexistent/ids.npy"),
    Case("trainfast bpe decode (CLI)", "wrong type", lambda: _cli("bpe", "decode", _file("ids.npy", b"1 2 3"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir() / "t.txt")), ValueError, "ids.npy: not a .npy file"),
    Case("trainfast bpe decode (CLI)", "wrong value", lambda: _cli("bpe", "decode", _file("ids.npy", b"1 2 3"), "--tokenizer", "/nonexistent/tok", "--out", str(_dir()) + "/"), ValueError, "--out .* is a directory"),
    Case("trainfast bpe train (CLI)", "wrong value", lambda: _cli("bpe", "train", _file("c.txt", b"hello"), "--vocab-size", "300", "--out", _file("o", b"")), ValueError, "--out .* is not a directory"),
    Case("trainfast bpe export (CLI)", "missing/unreadable file", lambda: _cli("bpe", "export", "--tokenizer", "/nonexistent/tok", "--hf", str(_dir() / "t.json")), ValueError, "nonexistent"),
    Case("trainfast pretokenize (CLI)", "invalid UTF-8", lambda: _cli("pretokenize", _file("c.txt", b"ok \xff")), ValueError, "byte offset 3"),
    Case("trainfast pretokenize (CLI)", "missing/unreadable file", lambda: _cli("pretokenize", "/nonexistent/c.txt"), ValueError, "c.txt"),
    Case("trainfast eplb (CLI)", "zero", lambda: _cli("eplb", "--gpus", "0"), ValueError, "gpus"),
    Case("trainfast eplb (CLI)", "indivisible sizes", lambda: _cli("eplb", "--replicas", "300", "--gpus", "32"), ValueError, "replicas"),
    Case("trainfast eplb (CLI)", "malformed string", lambda: _cli("eplb", _file("bad_loads.csv", b"1,2\n3,x\n")), ValueError, "bad_loads.csv"),
    Case("trainfast eplb (CLI)", "malformed object", lambda: _cli("eplb", _file("bad_loads.npy", b"not an npy file")), ValueError, "bad_loads.npy"),
    Case("trainfast eplb (CLI)", "malformed object", lambda: _cli("eplb", _file("bad_loads.pt", b"not a torch file")), ValueError, "bad_loads.pt"),
]

CASES += [
    Case("buckets.compute_full_param_layout", "NaN/inf", lambda: buckets.compute_full_param_layout([_param(4)], 100, float("inf"), _DDP), TypeError, "data_parallel_world_size"),
    Case("buckets.compute_per_buffer_param_layout", "NaN/inf", lambda: buckets.compute_per_buffer_param_layout([_param(4)], float("nan"), 2, _DDP), ValueError, "bucket_size"),
    Case("buckets.compute_per_buffer_param_layout", "malformed string", lambda: buckets.compute_per_buffer_param_layout([_param(4)], 10, "2", _DDP), TypeError, "data_parallel_world_size"),
    Case("buckets.compute_default_per_buffer_param_layout", "wrong dtype", lambda: buckets.compute_default_per_buffer_param_layout([_param(4)], "2.5"), TypeError, "bucket_size"),
    Case("buckets.default_bucket_size", "negative", lambda: buckets.default_bucket_size(-1), ValueError, "data_parallel_world_size"),
    Case("buckets.default_bucket_size", "NaN/inf", lambda: buckets.default_bucket_size(float("nan")), TypeError, "data_parallel_world_size"),
    Case("pipeline.to_layout_str", "wrong type", lambda: pipeline.to_layout_str("x", 2), TypeError, "plan"),
    Case("pipeline.to_layout_str", "negative", lambda: pipeline.to_layout_str(_plan(), -2), ValueError, "pp"),
    Case("pipeline.to_layout_str", "NaN/inf", lambda: pipeline.to_layout_str(_plan(), 2, float("inf")), TypeError, "vpp"),
    Case("pipeline.get_transformer_layer_offset", "NaN/inf", lambda: pipeline.get_transformer_layer_offset(_config(num_layers=float("nan")), pp_rank=0), TypeError, "num_layers"),
    Case("pipeline.get_num_layers_to_build", "zero", lambda: pipeline.get_num_layers_to_build(_config(virtual_pipeline_model_parallel_size=0), pp_rank=0), ValueError, "virtual_pipeline_model_parallel_size"),
    Case("pipeline.PipelineLayout.from_list", "empty", lambda: pipeline.PipelineLayout.from_list([], 1), ValueError, "0 stages"),
    Case("pipeline.PipelineLayout.from_list", "wrong ndim/shape", lambda: pipeline.PipelineLayout.from_list([["embedding", ["decoder"]]], 1), ValueError, "stage 0"),
    Case("bpe.Tokenizer.from_files", "invalid UTF-8", lambda: bpe.Tokenizer.from_files(_file("v.json", b'{"\xff": 0}'), _file("m.txt", b"")), ValueError, r"v\.json: not valid UTF-8"),
]

def _saved_dir(vocab_json: str, merges_txt: str) -> Path:
    """A directory holding vocab.json and merges.txt with these texts (as `bpe.save` names them)."""
    directory = Path(_file("vocab.json", vocab_json.encode())).parent
    (directory / "merges.txt").write_text(merges_txt, encoding="utf-8")
    return directory


def _tiktoken_refused_specials() -> dict[str, object]:
    """to_tiktoken's arguments with two special tokens, one a prefix of the other, listed in an order for
    which tiktoken matches the shorter inside the longer, so to_tiktoken must refuse them. tiktoken tries
    specials in its hash map's order, which a release may change, so such an order is looked for."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {bytes([i]): i for i in range(256)}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        short, long = f"<|{letter}", f"<|{letter}|>"
        ids = {short: 256, long: 257}
        for specials in ([short, long], [long, short]):
            encoding = tiktoken.Encoding("probe", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                         special_tokens={token: ids[token] for token in specials})
            if encoding.encode(long, allowed_special="all") != [257]:
                vocab = {i: bytes([i]) for i in range(256)} | {256: short.encode(), 257: long.encode()}
                return {"vocab": vocab, "merges": [], "special_tokens": specials}
    pytest.skip("this tiktoken matched the longer special token first in every order tried")


# Found in review: counts past int64, meta tensors (a shape, no data), bad shapes, demo sizes.
_META = torch.device("meta")
CASES += [
    Case("buckets.plan_layout", "int64 overflow", lambda: buckets.plan_layout([5], data_parallel_world_size=2**63), ValueError, "data_parallel_world_size"),
    Case("buckets.shard_ranges", "int64 overflow", lambda: buckets.shard_ranges(LAYOUT, 2**63), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "int64 overflow", lambda: buckets.compute_full_param_layout([_param(4)], 100, 2**63, _DDP), ValueError, "data_parallel_world_size"),
    Case("buckets.compute_full_param_layout", "int64 overflow", lambda: buckets.compute_full_param_layout([_expert_param(4)], 100, 2, _DDP, 2**64), ValueError, "expert_data_parallel_world_size"),
    Case("checkpoint.assign_bins", "int64 overflow", lambda: checkpoint.assign_bins([0], [1], 2**63), ValueError, "bins"),
    Case("checkpoint.split_by_size_and_type", "int64 overflow", lambda: checkpoint.split_by_size_and_type(2**63, [_Item(0)]), ValueError, "bins"),
    Case("trainfast buckets (CLI)", "int64 overflow", lambda: _cli("buckets", "--dp", str(2**63)), ValueError, "--dp"),
    Case("buckets.plan_layout", "meta tensor (no data)", lambda: buckets.plan_layout(torch.tensor([5, 6], device=_META)), ValueError, "numels is on the meta device"),
    Case("checkpoint.assign_bins", "meta tensor (no data)", lambda: checkpoint.assign_bins([0, 1], torch.ones(2, dtype=torch.int64, device=_META), 2), ValueError, "sizes is on the meta device"),
    Case("pipeline.balanced_layout", "meta tensor (no data)", lambda: pipeline.balanced_layout(torch.ones(8, device=_META), 2, 2), ValueError, "layer_costs is on the meta device"),
    Case("pipeline.plan_layers", "meta tensor (no data)", lambda: pipeline.plan_layers(3, 2, 1, method="paddle", stage_ids=torch.tensor([0, 0, 1], device=_META)), ValueError, "stage_ids is on the meta device"),
    Case("eplb.rebalance_experts", "meta tensor (no data)", lambda: eplb.rebalance_experts(_W.to(_META), 16, 4, 2, 8), ValueError, "weight is on the meta device"),
    Case("eplb.rebalance_experts", "meta tensor (no data)", lambda: eplb.rebalance_experts(_W, 16, 4, 2, 8, previous_phy2log=torch.zeros(2, 16, dtype=torch.int64, device=_META)), ValueError, "previous_phy2log is on the meta device"),
    Case("eplb.balanced_packing", "meta tensor (no data)", lambda: eplb.balanced_packing(_W.to(_META), 2), ValueError, "weight is on the meta device"),
    Case("buckets.materialize", "wrong type", lambda: buckets.materialize(buckets.plan_layout([4]), shapes=[(2.9, 2)]), TypeError, r"shapes\[0\]\[0\]"),
    Case("buckets.materialize", "negative", lambda: buckets.materialize(buckets.plan_layout([1]), shapes=[(-1, -1)]), ValueError, r"shapes\[0\]\[0\]"),
    Case("buckets.materialize", "malformed object", lambda: buckets.materialize(buckets.plan_layout([4, 4]), shapes=[torch.zeros(4), (4,)]), TypeError, "shapes"),
    Case("trainfast checkpoint (CLI)", "output too large for memory", lambda: _cli("checkpoint", "--layers", "100000000000"), ValueError, "--layers"),
    Case("trainfast buckets (CLI)", "output too large for memory", lambda: _cli("buckets", "--layers", "100000000000"), ValueError, "--layers"),
    Case("eplb.gpu_loads", "meta tensor (no data)", lambda: eplb.gpu_loads(_W, _P2L.to(_META), _CNT, 2), ValueError, "phy2log is on the meta device"),
    Case("bpe.Tokenizer.decode", "meta tensor (no data)", lambda: _TINY_TOKENIZER.decode(torch.zeros(3, dtype=torch.int64, device=_META)), ValueError, "ids is on the meta device"),
    Case("buckets.build_model_gbuf_param_range_map", "int64 overflow", lambda: buckets.build_model_gbuf_param_range_map({}, SimpleNamespace(start=0, end=2**63), 0), ValueError, r"gbuf_world_range\.end"),
    Case("buckets.build_model_gbuf_param_range_map", "wrong type", lambda: buckets.build_model_gbuf_param_range_map({}, SimpleNamespace(start=0, end=4), 1.5), TypeError, "bucket_offset"),
    Case("buckets.materialize", "int64 overflow", lambda: buckets.materialize(buckets.plan_layout([0]), shapes=[(2**70, 0)]), ValueError, r"shapes\[0\]\[0\]"),
    Case("buckets.materialize", "int64 overflow", lambda: buckets.materialize(buckets.plan_layout([2**62])), ValueError, r"layout.numel=4611686018427387904 would need .* bytes .* over 2\^63"),
    Case("buckets.plan_layout", "int64 overflow", lambda: buckets.plan_layout([5, 2**60 + 1]), ValueError, r"numels sum too large: an offset past 2\^53 rounds below itself"),
    Case("checkpoint.assign_bins", "int64 overflow", lambda: checkpoint.assign_bins([False, False], [1, 2**70], bins=2), ValueError, r"sizes\[1\] does not fit in int64 \(got 1180591620717411303424\)"),
    Case("eplb.rebalance_experts", "int64 overflow", lambda: eplb.rebalance_experts([[1, 2], [3, -2**7000]], 4, 1, 1, 2), ValueError, r"weight\[1, 1\] does not fit in int64 \(got an int of 7001 bits\)"),
    Case("buckets.materialize", "output too large for memory", lambda: buckets.materialize(buckets.plan_layout([2**50]), param_dtype=torch.bfloat16), ValueError, r"layout.numel=1125899906842624 would need .* GiB .* more than the cpu device's"),
    Case("trainfast eplb (CLI)", "int64 overflow", lambda: _cli("eplb", "--gpus", str(2**63)), ValueError, "--gpus"),
    Case("trainfast eplb (CLI)", "zero", lambda: _cli("eplb", "--replicas", "0"), ValueError, "--replicas"),
    Case("bpe.load", "malformed object", lambda: bpe.load(_saved_dir('{"a": 0, "b": 0}', "")), ValueError, r"vocab\.json:1: id 0 of 'b' is already used"),
    Case("bpe.load", "malformed string", lambda: bpe.load(_saved_dir('{"a": 0, "b": 1}', "a \n")), ValueError, r"merges\.txt:1: expected 'left right'"),
    Case("bpe.load", "wrong value", lambda: bpe.load(_saved_dir('{"a": 0, "b": 1}', "a b\n")), ValueError, r"merges\.txt:1: .*unknown token"),
    Case("bpe.export.to_tiktoken", "wrong value", lambda: bpe_export.to_tiktoken(**_tiktoken_refused_specials()), ValueError, "starts with special token"),
    Case("bpe.WordCounts.from_bytes", "malformed object", lambda: bpe.WordCounts.from_bytes(bpe.WordCounts._trusted({b"ab": 1}, "gpt2", ["x", "x"]).to_bytes()), ValueError, r"special_tokens\[1\]"),
]

# Inputs that look unusual but are valid: they must work and equal the plain call.
ACCEPTED: list[tuple[str, str, Callable[[], object], Callable[[], object]]] = [
    ("buckets.materialize", "NumPy shapes",
     lambda: [v.shape for v in buckets.materialize(buckets.plan_layout([4, 6]), shapes=[np.array([2, 2]), np.array([6])]).grad_views],
     lambda: [v.shape for v in buckets.materialize(buckets.plan_layout([4, 6]), shapes=[(2, 2), (6,)]).grad_views]),
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
    # Upstream: no bins for an empty plan is an empty list (a rank with nothing to save).
    ("checkpoint.split_by_size_and_type", "zero", lambda: checkpoint.split_by_size_and_type(0, []), lambda: []),
    # Megatron closes a bucket after every param for any size <= 0 (resolve_ddp_bucket_size can give 0).
    ("buckets.compute_default_per_buffer_param_layout", "negative",
     lambda: buckets.compute_default_per_buffer_param_layout([_param(4), _param(3)], -1).bucket_indices,
     lambda: buckets.compute_default_per_buffer_param_layout([_param(4), _param(3)], 1).bucket_indices),
    # Megatron compares an int element count with bucket_size: a float acts as its ceiling, inf as None.
    ("buckets.compute_default_per_buffer_param_layout", "wrong dtype",
     lambda: buckets.compute_default_per_buffer_param_layout([_param(4), _param(3), _param(5)], 6.5).bucket_indices,
     lambda: buckets.compute_default_per_buffer_param_layout([_param(4), _param(3), _param(5)], 7).bucket_indices),
    ("buckets.plan_layout", "NaN/inf",
     lambda: buckets.plan_layout([3, 5, 7], bucket_size=float("inf"), data_parallel_world_size=2).bucket_indices.tolist(),
     lambda: buckets.plan_layout([3, 5, 7], bucket_size=None, data_parallel_world_size=2).bucket_indices.tolist()),
    ("buckets.plan_layout", "zero",
     lambda: buckets.plan_layout([3, 5, 0, 7], bucket_size=0, data_parallel_world_size=2).bucket_indices.tolist(),
     lambda: [[0, 128], [128, 128], [128, 256], [256, 384]]),  # params go in reverse; the empty one too
    ("pipeline.balanced_layout", "requires_grad tensor",
     lambda: pipeline.balanced_layout(torch.ones(8, requires_grad=True), 2, 2)[1],
     lambda: pipeline.balanced_layout([1.0] * 8, 2, 2)[1]),
]
ACCEPTED += [
    ("eplb.rebalance_experts", "list of tensors (one per layer)",
     lambda: [t.tolist() for t in eplb.rebalance_experts(list(_W * torch.arange(1.0, 13.0)), 16, 4, 2, 8)],
     lambda: [t.tolist() for t in eplb.rebalance_experts(_W * torch.arange(1.0, 13.0), 16, 4, 2, 8)]),
    ("pipeline.balanced_layout", "vpp=None (as plan_layers takes it)",
     lambda: pipeline.balanced_layout([1.0, 2.0, 3.0, 4.0], 2, None).layout_str,
     lambda: pipeline.balanced_layout([1.0, 2.0, 3.0, 4.0], 2, 1).layout_str),
    ("eplb.gpu_loads", "non-contiguous/strided tensor",
     lambda: eplb.gpu_loads(torch.arange(48.0).reshape(4, 12)[::2], torch.arange(24).reshape(2, 12).flip(1) % 12, _CNT, 2).tolist(),
     lambda: eplb.gpu_loads(torch.arange(48.0).reshape(4, 12)[::2].contiguous(), (torch.arange(24).reshape(2, 12).flip(1) % 12).contiguous(), _CNT, 2).tolist()),
    ("eplb.gpu_loads", "requires_grad tensor, NumPy int32 tables",
     lambda: eplb.gpu_loads(torch.ones(2, 12, requires_grad=True), _P2L.numpy().astype(np.int32), _CNT.tolist(), 3).tolist(),
     lambda: eplb.gpu_loads(torch.ones(2, 12), _P2L, _CNT, 3).tolist()),
    ("eplb.count_moved", "non-contiguous/strided tensor",
     lambda: eplb.count_moved(_P2L.t().contiguous().t(), _P2L.flip(1)), lambda: eplb.count_moved(_P2L, _P2L.flip(1).contiguous())),
    ("bpe.WordCounts.from_bytes", "non-contiguous/strided buffer",
     lambda: bpe.WordCounts.from_bytes(memoryview(bytes(b for x in bpe.WordCounts({b"hi": 2}).to_bytes() for b in (x, 0)))[::2]).to_bytes(),
     lambda: bpe.WordCounts({b"hi": 2}).to_bytes()),
]
ACCEPTED += [
    ("buckets.compute_full_param_layout", "empty",
     lambda: buckets.compute_full_param_layout([], 100, 2, _DDP).layouts, lambda: {}),
    # Upstream reads the expert dp only for expert-parallel buffers.
    ("buckets.compute_full_param_layout", "zero",
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([_param(300)], 100, 2, _DDP, 0).layouts.values()],
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([_param(300)], 100, 2, _DDP).layouts.values()]),
    ("buckets.compute_full_param_layout", "non-contiguous/strided tensor",
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([torch.nn.Parameter(torch.zeros(8, 8)[:, ::2])], 16, 2, _DDP).layouts.values()],
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([torch.nn.Parameter(torch.zeros(8, 4))], 16, 2, _DDP).layouts.values()]),
    ("eplb.rebalance_experts_hierarchical", "non-contiguous/strided tensor",
     lambda: eplb.rebalance_experts_hierarchical(torch.arange(48.0).reshape(4, 12)[::2], 16, 4, 2, 8)[0].tolist(),
     lambda: eplb.rebalance_experts_hierarchical(torch.arange(48.0).reshape(4, 12)[::2].contiguous(), 16, 4, 2, 8)[0].tolist()),
    ("eplb.rebalance_experts_hierarchical", "requires_grad tensor",
     lambda: eplb.rebalance_experts_hierarchical(torch.ones(2, 12, requires_grad=True), 16, 4, 2, 8)[0].tolist(),
     lambda: eplb.rebalance_experts_hierarchical(torch.ones(2, 12), 16, 4, 2, 8)[0].tolist()),
    # Upstream's helpers answer an empty weight with empty tables.
    ("eplb.balanced_packing", "empty",
     lambda: [t.shape for t in eplb.balanced_packing(torch.ones(0, 4), 2)], lambda: [torch.Size([0, 4])] * 2),
    ("eplb.replicate_experts", "empty",
     lambda: [t.shape for t in eplb.replicate_experts(torch.ones(0, 4), 6)],
     lambda: [torch.Size([0, 6]), torch.Size([0, 6]), torch.Size([0, 4])]),
    ("eplb.gpu_loads", "bool loads (as rebalance_experts takes them)",
     lambda: eplb.gpu_loads(torch.ones(2, 12, dtype=torch.bool), _P2L, _CNT, 3).tolist(),
     lambda: eplb.gpu_loads(torch.ones(2, 12), _P2L, _CNT, 3).tolist()),
    ("eplb.balanced_packing", "non-contiguous/strided tensor",
     lambda: eplb.balanced_packing(torch.arange(16.0).reshape(4, 4)[::2], 2)[0].tolist(),
     lambda: eplb.balanced_packing(torch.arange(16.0).reshape(4, 4)[::2].contiguous(), 2)[0].tolist()),
    ("pipeline.chunk_costs", "requires_grad tensor",
     lambda: pipeline.chunk_costs(_plan(), torch.ones(4, requires_grad=True), 2),
     lambda: pipeline.chunk_costs(_plan(), [1.0] * 4, 2)),
    ("buckets.compute_full_param_layout", "non-CPU tensor",
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([torch.nn.Parameter(torch.zeros(8, 4, device="meta"))], 16, 2, _DDP).layouts.values()],
     lambda: [layout.bucket_indices for layout in buckets.compute_full_param_layout([torch.nn.Parameter(torch.zeros(8, 4))], 16, 2, _DDP).layouts.values()]),
    ("buckets.compute_per_buffer_param_layout", "empty",
     lambda: buckets.compute_per_buffer_param_layout([], 10, 2, _DDP).bucket_indices, lambda: []),
    ("buckets.group_params_for_buffers", "empty", lambda: buckets.group_params_for_buffers([], False), lambda: {}),
    ("buckets.partition_buckets", "empty", lambda: buckets.partition_buckets([]), lambda: []),
    ("bpe.Tokenizer.encode", "invalid UTF-8",  # a lone surrogate encodes as U+FFFD, as tiktoken does
     lambda: _TINY_TOKENIZER.encode("a\ud800b"), lambda: _TINY_TOKENIZER.encode("a\ufffdb")),
    ("bpe.Tokenizer.encode_batch", "invalid UTF-8",
     lambda: _TINY_TOKENIZER.encode_batch(["a\ud800b"]), lambda: _TINY_TOKENIZER.encode_batch(["a\ufffdb"])),
    ("bpe.Tokenizer.decode", "numpy/torch integer ids",
     lambda: (_TINY_TOKENIZER.decode(np.array([97, 256])), _TINY_TOKENIZER.decode(torch.tensor([97, 256]))),
     lambda: (_TINY_TOKENIZER.decode([97, 256]),) * 2),
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


def _on_gpu(values: list[float]):
    """`values` as a CUDA tensor; skips where there is no GPU (CI), so the matrix is the same everywhere."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    return torch.tensor(values, device="cuda")


ACCEPTED.append(("pipeline.balanced_layout", "non-CPU tensor",
                 lambda: pipeline.balanced_layout(_on_gpu([1.0] * 8), 2, 2)[1],
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


def test_failed_calls_write_nothing(tmp_path):
    out = tmp_path / "tok"
    with pytest.raises(TypeError):
        bpe.save(_TINY_VOCAB, [(b"a",)], out)
    with pytest.raises(ValueError):
        bpe.save({-1: b"a"}, [], out)
    with pytest.raises(ValueError, match="not in vocab"):
        bpe.save(_TINY_VOCAB, [(b"a", b"b"), (b"ab", b"c")], out)  # the second merge's token is missing
    with pytest.raises(ValueError):
        bpe_export.to_hf_tokenizer_json(_TINY_VOCAB, [], None, tmp_path / "t.json", pattern="(")
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"ok \xff")
    with pytest.raises(ValueError):
        _cli("bpe", "train", str(corpus), "--vocab-size", "300", "--out", str(out), "--no-progress")
    with pytest.raises(ValueError):
        _cli("bpe", "count", str(corpus), "--out", str(tmp_path / "c.tfwc"), "--no-progress")
    with pytest.raises(ValueError):
        _cli("eplb", "--gpus", "0", "--save", str(tmp_path / "plan.pt"))
    loads = tmp_path / "loads.csv"
    loads.write_bytes(b"1,2\n3,x\n")
    with pytest.raises(ValueError, match="loads.csv"):
        _cli("eplb", str(loads), "--save", str(tmp_path / "plan.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "loads.csv"]


def test_a_failed_save_writes_neither_file(tmp_path):
    # merges.txt cannot be written (it is a directory): vocab.json must not be written alone.
    (tmp_path / "merges.txt").mkdir()
    with pytest.raises(IsADirectoryError, match="merges.txt"):
        bpe.save(_TINY_VOCAB, [(b"a", b"b")], tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"low lower")
    with pytest.raises(ValueError, match="merges.txt in it is a directory"):  # the CLI: before training
        _cli("bpe", "train", str(corpus), "--vocab-size", "260", "--out", str(tmp_path), "--no-progress")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "merges.txt"]


def test_failed_calls_leave_inputs_unchanged():
    weight = torch.tensor([[1.0, float("nan")] * 6] * 2)
    costs = np.array([1.0, 2.0, float("nan"), 1.0])
    vocab = dict(_TINY_VOCAB) | {-5: b"abab"}
    before = (weight.clone(), costs.copy(), dict(vocab))
    with pytest.raises(ValueError):
        eplb.rebalance_experts(weight, 16, 4, 2, 8)
    with pytest.raises(ValueError):
        pipeline.balanced_layout(costs, 2)
    with pytest.raises(ValueError):
        bpe.Tokenizer(vocab, [])
    assert torch.equal(weight.isnan(), before[0].isnan()) and torch.equal(weight.nan_to_num(), before[0].nan_to_num())
    assert np.array_equal(costs, before[1], equal_nan=True) and vocab == before[2]


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
        "- `test_interrupts.py`: Ctrl-C stops every large plan within 1 s, leaving no thread behind.\n"
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


def test_cli_eplb_checks_before_printing_or_working(tmp_path):
    import contextlib
    import io

    from trainfast.cli import main

    empty = tmp_path / "empty.csv"
    empty.write_text("")
    for argv, match in [(["--nodes", "0"], "--nodes must be >= 1"), (["--groups", "0"], "--groups must be >= 1"),
                        (["--save", str(tmp_path / "no_dir" / "plan.pt")], "does not exist"),
                        (["--save", str(tmp_path)], "is a directory"),
                        (["--replicas", "7"], "num_replicas must be a multiple"),
                        ([str(empty)], "empty.csv' is malformed: no numbers")]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["eplb", *argv]) == 2
        assert out.getvalue() == "", argv  # no header that reads like a result
        with pytest.raises(ValueError, match=match):
            _cli("eplb", *argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.csv"]


def test_written_files_get_the_usual_permissions(tmp_path):
    from trainfast._util import write_atomic

    old_mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.txt", "x")
        assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o644  # mkstemp alone gives 0600
        (tmp_path / "kept.txt").write_text("old")
        os.chmod(tmp_path / "kept.txt", 0o640)
        write_atomic(tmp_path / "kept.txt", "new")
        assert (tmp_path / "kept.txt").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old_mask)


def test_bpe_encode_cli_keeps_the_old_output_when_writing_fails(tmp_path, monkeypatch):
    """A disk that fills up while the ids are saved must not leave a truncated .npy in place of the
    old one (np.save into the file directly did)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    bpe.save(*bpe.train_bpe(_file("c.txt", b"low lower lowest " * 50), 270), tok)
    text = tmp_path / "in.txt"
    text.write_text("low lower " * 2000)
    out = tmp_path / "ids.npy"
    out.write_bytes(b"old ids")

    def full_disk(file, array, *args, **kwargs):
        file.write(b"\x93NUMPY partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full_disk)
    with pytest.raises(ValueError, match="No space left"):
        _cli("bpe", "encode", str(text), "--tokenizer", str(tok), "--out", str(out), "--no-progress")
    assert out.read_bytes() == b"old ids" and sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy", "in.txt", "tok"]


def test_cli_output_into_a_closed_pipe_is_quiet():
    import subprocess

    script = f"{sys.executable} -m trainfast.cli pipeline --pp 5000 --num-layers 5000 | head -1"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert result.stdout.startswith("pp rank") and result.stderr == ""


@pytest.mark.parametrize("cls_name", ["BpeEncoder", "BpePretokenCounter", "BpeWordTable", "EplbReplication"])
def test_native_objects_made_without_init_raise(cls_name):
    """`cls.__new__(cls)` skips __init__ (and is the only way to make the classes without a Python
    constructor); pybind11 would run methods on uninitialised memory: crashed before."""
    from trainfast import _core

    cls = getattr(_core, cls_name)
    blank = cls.__new__(cls)
    never_initialised = pytest.raises(TypeError, match="never initialised")
    calls = {
        "BpeEncoder": [
            lambda: blank.encode("abc"),
            lambda: blank.encode_batch(["abc"], 1),
            lambda: blank.encode_prefix("abc"),
            lambda: blank.encode_pieces([b"abc"]),
            lambda: blank.decode([1, 2]),
            lambda: blank.decode_bytes([1, 2]),
        ],
        "BpePretokenCounter": [
            lambda: blank.add_documents(["abc"]),
            lambda: blank.add_file(__file__),
            lambda: blank.finish(),
            lambda: blank.finish_table(),
            lambda: blank.finish_arrays(),
        ],
        "BpeWordTable": [lambda: len(blank), lambda: _core.bpe_train_merges_table(blank, 3)],
        "EplbReplication": [
            lambda: blank.replica_loads,
            lambda: _core.eplb_place(blank, np.zeros(0, np.int64), False, False, 1),
        ],
    }[cls_name]
    for call in calls:
        with never_initialised:
            call()
    # Another object in its place (a method called on the class with a wrong self): no match.
    wrong_object = {
        "BpeEncoder": lambda: cls.encode(0, "abc"),
        "BpePretokenCounter": lambda: cls.finish(0),
        "BpeWordTable": lambda: _core.bpe_train_merges_table(0, 3),
        "EplbReplication": lambda: _core.eplb_place(0, np.zeros(0, np.int64), False, False, 1),
    }[cls_name]
    with pytest.raises(TypeError, match=rf"incompatible function arguments(.|\n)*trainfast\._core\.{cls_name}"):
        wrong_object()


def test_cli_out_of_memory_is_an_error_line_not_a_traceback(monkeypatch):
    from trainfast.cli import checkpoint as cli_checkpoint

    def run(*args):
        raise MemoryError

    monkeypatch.setattr(cli_checkpoint, "run", run)
    with pytest.raises(ValueError, match="trainfast checkpoint: error: out of memory for these arguments"):
        _cli("checkpoint", "--layers", "100000000")
