"""``trainfast buckets``: plan Megatron's gradient buffers, buckets and per-rank shards for a model.

Models come from a JSON spec or the built-in GPT / DeepSeek-V3-like specs. A JSON spec is a list of
params (or ``{"params": [...]}``), each ``{"name": ..., "shape": [...]}`` or ``{"numel": n}``, with
optional ``"shared_embedding": true`` and ``"expert": true`` (expert-parallel, own buffer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfast._util import INT64_MAX, check_int

# The built-in models are Python lists (up to ~800 params per layer): a bound keeps them in memory.
MAX_DEMO_LAYERS = 10_000

_NAME = "buckets"


@dataclass
class ModelSpec:
    """Params in model order: names, element counts, shared-embedding and expert flags."""

    name: str
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    shared_embedding: list[bool] = field(default_factory=list)
    expert: list[bool] = field(default_factory=list)

    def add(self, name: str, *shape: int, shared: bool = False, expert: bool = False) -> None:
        self.names.append(name)
        self.numels.append(math.prod(shape))
        self.shared_embedding.append(shared)
        self.expert.append(expert)

    def buffers(self) -> dict[str, list[int]]:
        """Model-order param indices of the dense and the expert-parallel buffer (non-empty ones)."""
        dense = [i for i, e in enumerate(self.expert) if not e]
        experts = [i for i, e in enumerate(self.expert) if e]
        return {name: idx for name, idx in (("dense", dense), ("expert", experts)) if idx}


def gpt_spec(num_layers: int = 32, hidden: int = 4096, ffn: int = 16384, vocab: int = 50304,
             shared_embedding: bool = True) -> ModelSpec:
    """A GPT (Megatron naming, TP=1) whose embedding and output layer are tied across pp stages."""
    spec = ModelSpec(f"GPT {num_layers}L h{hidden}")
    spec.add("embedding.word_embeddings.weight", vocab, hidden, shared=shared_embedding)
    for layer in range(num_layers):
        p = f"decoder.layers.{layer}."
        spec.add(p + "self_attention.linear_qkv.layer_norm_weight", hidden)
        spec.add(p + "self_attention.linear_qkv.weight", 3 * hidden, hidden)
        spec.add(p + "self_attention.linear_qkv.bias", 3 * hidden)
        spec.add(p + "self_attention.linear_proj.weight", hidden, hidden)
        spec.add(p + "self_attention.linear_proj.bias", hidden)
        spec.add(p + "mlp.linear_fc1.layer_norm_weight", hidden)
        spec.add(p + "mlp.linear_fc1.weight", ffn, hidden)
        spec.add(p + "mlp.linear_fc1.bias", ffn)
        spec.add(p + "mlp.linear_fc2.weight", hidden, ffn)
        spec.add(p + "mlp.linear_fc2.bias", hidden)
    spec.add("decoder.final_layernorm.weight", hidden)
    spec.add("output_layer.weight", vocab, hidden, shared=shared_embedding)
    return spec


def deepseek_v3_spec(num_layers: int = 61, num_dense_layers: int = 3, num_experts: int = 256) -> ModelSpec:
    """DeepSeek-V3-like (MLA attention, 256 routed experts x 3 matrices in 58 MoE layers, one shared
    expert, tied embedding/output as on pp > 1): ~45k params, ~671B elements."""
    hidden, vocab, dense_ffn, moe_ffn = 7168, 129280, 18432, 2048
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    spec = ModelSpec(f"DeepSeek-V3-like {num_layers}L {num_experts} experts")
    spec.add("embedding.word_embeddings.weight", vocab, hidden, shared=True)
    for layer in range(num_layers):
        p = f"decoder.layers.{layer}."
        spec.add(p + "input_layernorm.weight", hidden)
        spec.add(p + "self_attention.linear_q_down_proj.weight", q_rank, hidden)
        spec.add(p + "self_attention.linear_q_up_proj.layer_norm_weight", q_rank)
        spec.add(p + "self_attention.linear_q_up_proj.weight", heads * (nope + rope), q_rank)
        spec.add(p + "self_attention.linear_kv_down_proj.weight", kv_rank + rope, hidden)
        spec.add(p + "self_attention.linear_kv_up_proj.layer_norm_weight", kv_rank)
        spec.add(p + "self_attention.linear_kv_up_proj.weight", heads * (nope + v_dim), kv_rank)
        spec.add(p + "self_attention.linear_proj.weight", hidden, heads * v_dim)
        spec.add(p + "pre_mlp_layernorm.weight", hidden)
        if layer < num_dense_layers:
            spec.add(p + "mlp.linear_fc1.weight", 2 * dense_ffn, hidden)
            spec.add(p + "mlp.linear_fc2.weight", hidden, dense_ffn)
            continue
        spec.add(p + "mlp.router.weight", num_experts, hidden)
        spec.add(p + "mlp.shared_experts.linear_fc1.weight", 2 * moe_ffn, hidden)
        spec.add(p + "mlp.shared_experts.linear_fc2.weight", hidden, moe_ffn)
        for e in range(num_experts):
            q = f"{p}mlp.experts.local_experts.{e}."
            spec.add(q + "gate_proj.weight", moe_ffn, hidden, expert=True)
            spec.add(q + "up_proj.weight", moe_ffn, hidden, expert=True)
            spec.add(q + "down_proj.weight", hidden, moe_ffn, expert=True)
    spec.add("decoder.final_layernorm.weight", hidden)
    spec.add("output_layer.weight", vocab, hidden, shared=True)
    return spec


def load_spec(path: str | Path) -> ModelSpec:
    """Reads a JSON model spec (see the module docstring)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: malformed JSON ({error})") from None
    items = data.get("params") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of params or {{'params': [...]}}")
    spec = ModelSpec(Path(path).name)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: params[{i}] must be an object (got {item!r})")
        if "shape" in item:
            if not isinstance(item["shape"], list):
                raise ValueError(f"{path}: params[{i}].shape must be a list of ints (got {item['shape']!r})")
            shape = [check_int(d, f"params[{i}].shape", min_value=0) for d in item["shape"]]
        elif "numel" in item:
            shape = [check_int(item["numel"], f"params[{i}].numel", min_value=0)]
        else:
            raise ValueError(f"{path}: params[{i}] needs 'shape' or 'numel'")
        spec.add(str(item.get("name", f"param{i}")), *shape, shared=bool(item.get("shared_embedding", False)),
                 expert=bool(item.get("expert", False)))
    return spec


def resolve_spec(model: str, num_layers: int | None = None) -> ModelSpec:
    if model == "gpt":
        return gpt_spec(num_layers or 32)
    if model in ("deepseek-v3", "dsv3"):
        return deepseek_v3_spec(num_layers or 61)
    if not os.path.exists(model):
        raise FileNotFoundError(f"--model {model!r}: neither 'gpt' nor 'deepseek-v3', and no such JSON spec file")
    return load_spec(model)


def _bucket_size(text: str) -> Any:
    if text == "default":
        return "default"
    if text.lower() == "none":
        return None
    try:
        value = int(text)  # exact, however large; "4e7" goes through float below
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            raise ValueError(f"--bucket-size must be a number, 'none' or 'default' (got {text!r})") from None
        if not as_float.is_integer():
            raise ValueError(f"--bucket-size must be a positive whole number (got {text!r})") from None
        value = int(as_float)
    if value <= 0:
        raise ValueError(f"--bucket-size must be a positive whole number (got {text!r})")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(_NAME, help="plan Megatron gradient buckets and per-rank shards for a model")
    parser.add_argument("--model", default="deepseek-v3",
                        help="'gpt', 'deepseek-v3' or a JSON spec path (default deepseek-v3)")
    parser.add_argument("--layers", type=int, default=None, help="layers of a built-in model")
    parser.add_argument("--dp", type=int, default=256, help="data-parallel world size (default 256)")
    parser.add_argument("--expert-dp", type=int, default=None, help="expert data-parallel size (default --dp)")
    parser.add_argument("--bucket-size", default="default",
                        help="elements per bucket, 'none' for no size limit (with the distributed optimizer, tied "
                             "embeddings still get buckets of their own, as in Megatron; default max(40M, 1M*dp))")
    parser.add_argument("--no-distributed-optimizer", action="store_true", help="DDP's default unpadded layout")
    parser.add_argument("--busbw", action="store_true", help="pad_buckets_for_high_nccl_busbw")
    parser.add_argument("--param-bytes", type=int, default=2, help="param element bytes (default 2, bf16)")
    parser.add_argument("--grad-bytes", type=int, default=4, help="grad element bytes (default 4, fp32)")
    parser.set_defaults(handler=lambda args: run(
        args.model, dp=args.dp, expert_dp=args.expert_dp,
        bucket_size=_bucket_size(args.bucket_size),
        num_layers=args.layers, use_distributed_optimizer=not args.no_distributed_optimizer, busbw=args.busbw,
        param_bytes=args.param_bytes, grad_bytes=args.grad_bytes,
    ))


def plan(spec: ModelSpec, *, dp: int, expert_dp: int | None = None, bucket_size: Any = "default",
         use_distributed_optimizer: bool = True, busbw: bool = False) -> dict[str, Any]:
    """Layouts per buffer, bucket groups and (distributed optimizer) every rank's shard ranges."""
    from trainfast.buckets import (_check_bucket_size, default_bucket_size, partition_bucket_indices, plan_layout,
                                   shard_ranges)

    size = default_bucket_size(dp) if bucket_size == "default" else _check_bucket_size(bucket_size)
    layouts, ranges, groups = {}, {}, {}
    for name, indices in spec.buffers().items():
        world = (expert_dp or dp) if name == "expert" else dp
        layout = plan_layout([spec.numels[i] for i in indices],
                             shared_embedding=[spec.shared_embedding[i] for i in indices], bucket_size=size,
                             data_parallel_world_size=world, use_distributed_optimizer=use_distributed_optimizer,
                             pad_buckets_for_high_nccl_busbw=busbw)
        layouts[name] = layout
        groups[name] = partition_bucket_indices([False], [layout.num_buckets])
        if use_distributed_optimizer:
            ranges[name] = shard_ranges(layout, world)
    return {"layouts": layouts, "groups": groups, "ranges": ranges, "bucket_size": size}


def run(model: str, *, dp: int = 256, expert_dp: int | None = None, bucket_size: Any = "default",
        num_layers: int | None = None, use_distributed_optimizer: bool = True, busbw: bool = False,
        param_bytes: int = 2, grad_bytes: int = 4) -> int:
    check_int(dp, "--dp", min_value=1, max_value=INT64_MAX)
    if expert_dp is not None:
        check_int(expert_dp, "--expert-dp", min_value=1, max_value=INT64_MAX)
    if num_layers is not None:
        check_int(num_layers, "--layers", min_value=1, max_value=MAX_DEMO_LAYERS)
    check_int(param_bytes, "--param-bytes", min_value=0)  # before anything is printed
    check_int(grad_bytes, "--grad-bytes", min_value=0)
    spec = resolve_spec(model, num_layers)
    import torch  # imported before timing: results are torch tensors

    start = time.perf_counter()
    result = plan(spec, dp=dp, expert_dp=expert_dp, bucket_size=bucket_size,
                  use_distributed_optimizer=use_distributed_optimizer, busbw=busbw)
    elapsed = time.perf_counter() - start
    total = sum(spec.numels)
    print(f"buckets: {spec.name}: {len(spec.numels):,} params, {total / 1e9:.2f}B elements, dp={dp}, "
          f"bucket_size={result['bucket_size']}")
    for name, layout in result["layouts"].items():
        print(f"[{name} buffer]")
        for line in layout.summary(param_bytes=param_bytes, grad_bytes=grad_bytes, max_buckets=4).splitlines():
            print("  " + line)
        print(f"  bucket groups: {len(result['groups'][name].group_offsets) - 1:,}")
        if name in result["ranges"]:
            table = result["ranges"][name]
            world = layout.data_parallel_world_size
            per_rank = torch.bincount(table.rank, minlength=world)
            owned = torch.zeros(world, dtype=torch.int64).index_add_(
                0, table.rank, table.gbuf_world[:, 1] - table.gbuf_world[:, 0])
            print(f"  shard ranges: {len(table.rank):,} (rank, bucket, param) rows; params per rank "
                  f"{int(per_rank.min()):,}..{int(per_rank.max()):,}; param elements owned per rank "
                  f"{int(owned.min()):,}..{int(owned.max()):,} of {layout.numel // world:,}")
    print(f"planned in {elapsed * 1e3:.1f} ms (layout + groups + every rank's shard ranges)")
    return 0


def demo() -> None:
    """DeepSeek-V3-like model at dp=256, and how long megatron-core's range builder would take."""
    import warnings

    import torch  # noqa: F401

    spec = deepseek_v3_spec()
    dp = 256
    start = time.perf_counter()
    result = plan(spec, dp=dp)
    native = time.perf_counter() - start
    num_buckets = sum(layout.num_buckets for layout in result["layouts"].values())
    rows = sum(len(t.rank) for t in result["ranges"].values())
    print(f"buckets: {spec.name} ({len(spec.numels):,} params, {sum(spec.numels) / 1e9:.0f}B elements), dp={dp}: "
          f"{num_buckets:,} buckets, {rows:,} shard-range rows for all ranks in {native * 1e3:.1f} ms")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
    except ImportError:
        print("  (megatron-core not installed: no upstream comparison)")
        return
    from trainfast.buckets import build_model_gbuf_param_range_map

    # Megatron scans the whole param_index_map once per (rank, bucket): time one such call.
    layout = result["layouts"]["expert"]
    names = [i for i in spec.buffers()["expert"]]
    keys = [object() for _ in names]
    index_map = {keys[i]: (s, e, b) for i, s, e, b in reversed(list(zip(
        range(len(keys)), layout.param_start.tolist(), layout.param_end.tolist(), layout.bucket_id.tolist())))}
    b0, b1 = (int(x) for x in layout.bucket_indices[0])
    shard = (b1 - b0) // dp
    world_range = Range(b0, b0 + shard)
    t0 = time.perf_counter()
    upstream = DistributedOptimizer._build_model_gbuf_param_range_map.__func__(DistributedOptimizer, index_map,
                                                                             world_range, b0)
    per_call = time.perf_counter() - t0
    ours = build_model_gbuf_param_range_map(index_map, world_range, b0)
    same = [(id(k), {n: (r.start, r.end) for n, r in v.items()}) for k, v in upstream.items()] == [
        (id(k), {n: (r.start, r.end) for n, r in v.items()}) for k, v in ours.items()]
    calls = sum(layout.num_buckets for layout in result["layouts"].values()) * dp
    print(f"  megatron-core _build_model_gbuf_param_range_map: {per_call * 1e3:.1f} ms per (rank, bucket) call "
          f"(identical={same}); all {calls:,} calls ~ {per_call * calls:.0f} s, "
          f"~{per_call * calls / native:,.0f}x the native plan")
