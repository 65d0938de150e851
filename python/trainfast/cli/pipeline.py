"""``trainfast pipeline``: which layers each pipeline rank / virtual stage holds, and what it costs."""

from __future__ import annotations

import argparse
import time
from typing import Any

from trainfast._util import check_int

_NAME = "pipeline"
_METHODS = ("megatron", "uneven", "paddle", "balanced", "layout")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        _NAME, help="print a pipeline / virtual-pipeline layer split (Megatron, uneven, Paddle, cost-balanced)",
        description="Prints the table pipeline rank x virtual stage -> layers, the per-stage cost and the "
                    "Megatron --pipeline-model-parallel-layout string of the split.",
    )
    parser.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: from --costs/--layout, else 32)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages per rank (default: none / 1)")
    parser.add_argument("--method", choices=_METHODS, default="megatron", help="how to split (default megatron)")
    parser.add_argument("--first", type=int, default=None, help="num_layers_in_first_pipeline_stage (megatron)")
    parser.add_argument("--last", type=int, default=None, help="num_layers_in_last_pipeline_stage (megatron)")
    parser.add_argument("--account-for-embedding", action="store_true", help="account_for_embedding_in_pipeline_split")
    parser.add_argument("--account-for-loss", action="store_true", help="account_for_loss_in_pipeline_split")
    parser.add_argument("--stage-ids", default=None, help="paddle: comma-separated pipeline stage of every layer")
    parser.add_argument("--layout", default=None, help="layout: a Megatron layout string, e.g. 'Et*3|(tt|)*29,m|L'")
    parser.add_argument("--costs", default=None, help="comma-separated cost of every layer (default: 1 each)")
    parser.add_argument("--random-costs", type=int, default=None, metavar="SEED",
                        help="random layer costs in [0.5, 1.5) from this seed")
    parser.add_argument("--embedding-cost", type=float, default=0.0, help="cost of the embedding (on chunk 0)")
    parser.add_argument("--loss-cost", type=float, default=0.0, help="cost of the loss (on the last chunk)")
    parser.set_defaults(handler=_handle)


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints (got {text!r})") from None


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers (got {text!r})") from None


# Options a method does not read, refused rather than ignored (the megatron, uneven and paddle plans
# check theirs in plan_layers).
_UNUSED = {
    "megatron": ("layout",),
    "uneven": ("layout",),
    "paddle": ("layout",),
    "layout": ("first", "last", "account_for_embedding", "account_for_loss", "stage_ids"),
    "balanced": ("first", "last", "account_for_embedding", "account_for_loss", "stage_ids", "layout"),
}


def _check_options(args: argparse.Namespace) -> None:
    for name in _UNUSED[args.method]:
        if getattr(args, name) not in (None, False):
            raise ValueError(f"--{name.replace('_', '-')} is not used by --method {args.method}")


def _handle(args: argparse.Namespace) -> int:
    from trainfast import pipeline as tp

    _check_options(args)
    costs: Any = None
    if args.costs is not None and args.random_costs is not None:
        raise ValueError("give --costs or --random-costs, not both")
    if args.costs is not None:
        costs = _floats(args.costs, "--costs")
    num_layers = args.num_layers
    if args.random_costs is not None:
        import numpy as np

        seed = check_int(args.random_costs, "--random-costs", min_value=0)
        if num_layers is not None:  # drawn as a list of Python floats: 2^27 of them take ~4 GiB
            check_int(num_layers, "--num-layers", min_value=1, max_value=2**27)
        costs = np.random.default_rng(seed).uniform(0.5, 1.5, num_layers or 32).tolist()
    if num_layers is None:
        num_layers = len(costs) if costs is not None else 32
    if args.method == "layout":
        if args.layout is None:
            raise ValueError("--method layout needs --layout")
        layout = tp.PipelineLayout.from_str(args.layout, args.pp, num_layers=args.num_layers)
        plan, vpp = layout.plan(), layout.virtual_pipeline_model_parallel_size
        if args.vpp is not None and args.vpp != vpp:
            raise ValueError(f"--vpp {args.vpp} differs from the layout's {vpp} virtual stages per rank")
        num_layers = sum(len(r) for r in plan.values())
        text = layout.to_str()
    elif args.method == "balanced":
        if costs is None:
            raise ValueError("--method balanced needs --costs or --random-costs")
        vpp = args.vpp or 1
        result = tp.balanced_layout(costs, args.pp, vpp, embedding_cost=args.embedding_cost, loss_cost=args.loss_cost)
        plan, text = result
    else:
        vpp = args.vpp or 1
        plan = tp.plan_layers(
            num_layers, args.pp, args.vpp, method=args.method,
            num_layers_in_first_pipeline_stage=args.first, num_layers_in_last_pipeline_stage=args.last,
            account_for_embedding_in_pipeline_split=args.account_for_embedding,
            account_for_loss_in_pipeline_split=args.account_for_loss,
            stage_ids=None if args.stage_ids is None else _ints(args.stage_ids, "--stage-ids"),
        )
        text = tp.to_layout_str(plan, args.pp, vpp)
    if costs is not None and len(costs) != num_layers:
        raise ValueError(f"--costs has {len(costs)} entries but there are {num_layers} layers")
    # Unit costs print as layer counts only while nothing else adds to a stage's cost.
    unit_costs = costs is None and args.embedding_cost == 0 and args.loss_cost == 0
    print_table(plan, args.pp, vpp, costs if costs is not None else [1.0] * num_layers,
                args.embedding_cost, args.loss_cost, unit_costs=unit_costs)
    print(f"layout: {text}")
    return 0


def _layers(layers: range) -> str:
    if not len(layers):
        return "-"
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers.stop - 1}"


def print_table(plan: dict, pp: int, vpp: int, costs: Any, embedding_cost: float = 0.0, loss_cost: float = 0.0,
                *, unit_costs: bool = False, indent: str = "") -> tuple[list[float], list[float]]:
    """Prints pp rows x vpp columns of layer ranges and each rank's cost; returns (chunk, stage) costs."""
    from trainfast.pipeline import chunk_costs

    per_chunk, per_stage = chunk_costs(plan, costs, pp, vpp, embedding_cost=embedding_cost, loss_cost=loss_cost)
    cells = [[_layers(plan[(p, v)]) + ("" if unit_costs else f" ({per_chunk[v * pp + p]:.2f})") for v in range(vpp)]
             for p in range(pp)]
    header = ["pp rank"] + [f"vp stage {v}" for v in range(vpp)] + ["layers" if unit_costs else "stage cost"]
    rows = [[str(p)] + cells[p] + [f"{per_stage[p]:g}" if unit_costs else f"{per_stage[p]:.2f}"] for p in range(pp)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(indent + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    if not unit_costs:
        print(f"{indent}max chunk cost {max(per_chunk):.3f}, max stage cost {max(per_stage):.3f} "
              f"(mean stage {sum(per_stage) / pp:.3f})")
    return per_chunk, per_stage


def demo() -> None:
    import numpy as np

    from trainfast import pipeline as tp

    print("pipeline: 7 layers, pp=2, vpp=2 (the 'VPP 去尾' seed: layers not divisible by pp*vpp)")
    try:
        tp.plan_layers(7, 2, 2)
    except ValueError as error:
        print(f"  Megatron even split rejects it: {error}")
    plan = tp.plan_layers(7, 2, 2, method="uneven")
    print_table(plan, 2, 2, [1.0] * 7, unit_costs=True, indent="  ")
    print(f"  uneven split -> --pipeline-model-parallel-layout '{tp.to_layout_str(plan, 2, 2)}'")

    pp, vpp, num_layers, embedding_cost, loss_cost = 16, 4, 1000, 3.0, 5.0
    costs = np.random.default_rng(0).uniform(0.5, 1.5, num_layers)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        result = tp.balanced_layout(costs, pp, vpp, embedding_cost=embedding_cost, loss_cost=loss_cost)
        best = min(best, time.perf_counter() - start)
    even = tp.plan_layers(num_layers, pp, vpp, method="uneven")
    even_chunks, even_stages = tp.chunk_costs(even, costs, pp, vpp, embedding_cost=embedding_cost, loss_cost=loss_cost)
    print(f"balanced_layout: {num_layers} layers with random costs, pp={pp}, vpp={vpp}, embedding {embedding_cost:g}, "
          f"loss {loss_cost:g}: {best * 1e3:.2f} ms")
    print(f"  max chunk cost {result.max_chunk_cost:.3f} (exact optimum; even split {max(even_chunks):.3f}), "
          f"max stage cost {result.max_stage_cost:.3f} (even split {max(even_stages):.3f}, "
          f"ideal {sum(even_stages) / pp:.3f})")
    print(f"  layout: {result.layout_str[:72]}...")
    _demo_against_megatron()


def _demo_against_megatron() -> None:
    """Checks the drop-ins against megatron-core on a few configs when it is installed."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from megatron.core.transformer.transformer_block import get_num_layers_to_build
            from megatron.core.transformer.transformer_config import TransformerConfig
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    except ImportError:
        print("  (megatron-core not installed: skipping the comparison with upstream)")
        return
    from trainfast import pipeline as tp

    configs = [
        dict(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             account_for_embedding_in_pipeline_split=True),
        dict(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             account_for_loss_in_pipeline_split=True),
        dict(num_layers=12, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
             num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
        dict(num_layers=62, pipeline_model_parallel_size=8, virtual_pipeline_model_parallel_size=4,
             account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    ]
    same = total = 0
    for fields in configs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32, **fields)
        for pp_rank in range(config.pipeline_model_parallel_size):
            for vp_stage in range(config.virtual_pipeline_model_parallel_size):
                upstream = (get_num_layers_to_build(config, vp_stage, pp_rank),
                            get_transformer_layer_offset(config, vp_stage, pp_rank))
                ours = (tp.get_num_layers_to_build(config, vp_stage, pp_rank),
                        tp.get_transformer_layer_offset(config, vp_stage, pp_rank))
                same += upstream == ours
                total += 1
    print(f"  drop-ins vs megatron-core get_num_layers_to_build / get_transformer_layer_offset: "
          f"{same}/{total} (rank, virtual stage) pairs identical")
