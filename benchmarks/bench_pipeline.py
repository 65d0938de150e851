"""Pipeline layer split: balanced_layout (time and achieved cost) vs even and Megatron splits, and the
Megatron drop-ins / layout parser vs megatron-core, in one run."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import fmt_seconds, markdown_table, parse_args, timeit, write_section  # noqa: E402
from reference import pipeline as ref  # noqa: E402

from trainfast import pipeline as tp  # noqa: E402

PP, VPP, NUM_LAYERS = 16, 4, 1000
EMBEDDING_COST, LOSS_COST = 3.0, 5.0


def costs_for(num_layers: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 1.5, num_layers)


def figures(plan, costs) -> tuple[float, float]:
    chunks, stages = tp.chunk_costs(plan, costs, PP, VPP, embedding_cost=EMBEDDING_COST, loss_cost=LOSS_COST)
    return max(chunks), max(stages)


def quality_rows(quick: bool) -> list[list[str]]:
    rows = []
    costs = costs_for(NUM_LAYERS)
    mean_stage = (costs.sum() + EMBEDDING_COST + LOSS_COST) / PP
    balanced = tp.balanced_layout(costs, PP, VPP, embedding_cost=EMBEDDING_COST, loss_cost=LOSS_COST)
    even = tp.plan_layers(NUM_LAYERS, PP, VPP, method="uneven")
    for label, plan in [("even split (first L mod C chunks +1)", even), ("**balanced_layout**", balanced.plan)]:
        chunk, stage = figures(plan, costs)
        rows.append([f"{NUM_LAYERS}", label, f"{chunk:.3f}", f"{stage:.3f}", f"{stage / mean_stage:.4f}"])
    # Megatron's options need num_layers (+1 per account_for_*) divisible by pp * vpp = 64
    for num_layers, emb, loss in [(960, False, False), (959, True, False), (959, False, True), (958, True, True)]:
        costs = costs_for(num_layers)
        mean_stage = (costs.sum() + EMBEDDING_COST + LOSS_COST) / PP
        plan = tp.plan_layers(num_layers, PP, VPP, account_for_embedding_in_pipeline_split=emb,
                              account_for_loss_in_pipeline_split=loss)
        flags = " + ".join(name for name, on in [("account_for_embedding", emb), ("account_for_loss", loss)] if on)
        chunk, stage = figures(plan, costs)
        rows.append([f"{num_layers}", f"Megatron {flags or 'even'}", f"{chunk:.3f}", f"{stage:.3f}", f"{stage / mean_stage:.4f}"])
        result = tp.balanced_layout(costs, PP, VPP, embedding_cost=EMBEDDING_COST, loss_cost=LOSS_COST)
        rows.append([f"{num_layers}", "**balanced_layout**", f"{result.max_chunk_cost:.3f}",
                     f"{result.max_stage_cost:.3f}", f"{result.max_stage_cost / mean_stage:.4f}"])
    return rows


def timing_rows(quick: bool) -> list[list[str]]:
    rows = []
    costs = costs_for(NUM_LAYERS)
    cost_list = costs.tolist()
    native, native_s = timeit(lambda: tp.balanced_layout(costs, PP, VPP, embedding_cost=EMBEDDING_COST,
                                                         loss_cost=LOSS_COST), repeats=20 if quick else 200)
    python, python_s = timeit(lambda: ref.balanced_layout(cost_list, PP, VPP, EMBEDDING_COST, LOSS_COST),
                              repeats=1 if quick else 3)
    same = native.boundaries.tolist() == python[0]
    rows.append([f"balanced_layout, {NUM_LAYERS} layers, pp={PP}, vpp={VPP}", "Python oracle (same algorithm)",
                 fmt_seconds(python_s), fmt_seconds(native_s), f"{python_s / native_s:,.0f}x", str(same)])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
            from megatron.core.transformer.transformer_block import get_num_layers_to_build
            from megatron.core.transformer.transformer_config import TransformerConfig
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    except ImportError:
        print("megatron-core not installed: skipping the upstream rows")
        return rows

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32, num_layers=958,
                                   pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP,
                                   account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    chunks = [(p, v) for v in range(VPP) for p in range(PP)]

    def upstream_all():
        return [(get_num_layers_to_build(config, v, p), get_transformer_layer_offset(config, v, p)) for p, v in chunks]

    def drop_in_all():
        return [(tp.get_num_layers_to_build(config, v, p), tp.get_transformer_layer_offset(config, v, p)) for p, v in chunks]

    def plan_all():
        return tp.plan_layers(958, PP, VPP, account_for_embedding_in_pipeline_split=True,
                              account_for_loss_in_pipeline_split=True)

    expected, upstream_s = timeit(upstream_all, repeats=20 if quick else 200)
    got, drop_in_s = timeit(drop_in_all, repeats=20 if quick else 200)
    plan, plan_s = timeit(plan_all, repeats=20 if quick else 200)
    same_plan = [(len(plan[key]), plan[key].start) for key in chunks] == expected
    rows.append([f"all {PP * VPP} (rank, vp stage) values, account_for_*", "megatron-core, 2 calls per chunk",
                 fmt_seconds(upstream_s), fmt_seconds(drop_in_s), f"{upstream_s / drop_in_s:.2f}x", str(got == expected)])
    rows.append([f"all {PP * VPP} (rank, vp stage) values, account_for_*", "megatron-core vs one plan_layers call",
                 fmt_seconds(upstream_s), fmt_seconds(plan_s), f"{upstream_s / plan_s:.1f}x", str(same_plan)])

    layout_str = tp.to_layout_str(tp.plan_layers(4094, 64, 16, method="uneven"), 64, 16)
    upstream_layout, upstream_s = timeit(lambda: PipelineParallelLayerLayout(layout_str, 64), repeats=5 if quick else 30)
    ours_layout, ours_s = timeit(lambda: tp.PipelineLayout(tp._core.pipeline_parse_layout(layout_str, 64), 64),
                                 repeats=5 if quick else 30)
    same = ours_layout.layout == [["".join({"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}[t.name] for t in s)
                                   for s in row] for row in upstream_layout.layout]
    rows.append(["parse a 1024-stage layout string (4094 layers)", "megatron-core PipelineParallelLayerLayout",
                 fmt_seconds(upstream_s), fmt_seconds(ours_s), f"{upstream_s / ours_s:.1f}x", str(same)])
    return rows


def main() -> None:
    args = parse_args(__doc__)
    timing = timing_rows(args.quick)
    quality = quality_rows(args.quick)
    timing_table = markdown_table(["task", "baseline", "baseline time", "trainfast", "speed-up", "identical"], timing)
    quality_table = markdown_table(["layers", "split", "max chunk cost", "max stage cost", "max stage / mean"], quality)
    body = (
        f"Random layer costs uniform in [0.5, 1.5), embedding cost {EMBEDDING_COST:g}, loss cost {LOSS_COST:g}, "
        f"pp={PP}, vpp={VPP} (64 chunks).\n\n{timing_table}\n\n"
        "Achieved costs (max chunk cost of balanced_layout is the exact optimum; Megatron's options need "
        "num_layers (+1 per account_for_*) divisible by 64, hence the layer counts):\n\n"
        f"{quality_table}"
    )
    print(body)
    if args.write_readme:
        write_section("pipeline", body)


if __name__ == "__main__":
    main()
