"""EPLB: the readable torch oracle (tests/reference/eplb.py, upstream's algorithm and torch calls)
vs trainfast's native ``rebalance_experts``, in one run; plus the refine mode's balancedness.

Loads are integer token counts drawn from a lognormal (the shape of real MoE routing statistics).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import fmt_seconds, markdown_table, parse_args, timeit, write_section  # noqa: E402
from reference import eplb as oracle  # noqa: E402

from trainfast import eplb  # noqa: E402

README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])

# (label, layers, experts, replicas, groups, nodes, gpus)
CASES = [
    ("README example 2×12→16 (4 groups, 2 nodes, 8 GPUs)", 2, 12, 16, 4, 2, 8),
    ("58×256→288 hierarchical (8 groups, 4 nodes, 32 GPUs)", 58, 256, 288, 8, 4, 32),
    ("58×256→320 global, 64 GPUs", 58, 256, 320, 1, 1, 64),
    ("61×384→512 global, 64 GPUs", 61, 384, 512, 1, 1, 64),
]


def token_counts(rng: np.random.Generator, layers: int, experts: int, kind: str = "lognormal") -> torch.Tensor:
    if kind == "zipf":
        ranks = np.stack([rng.permutation(experts) + 1 for _ in range(layers)])
        return torch.from_numpy(np.round(1e5 / ranks**1.1).astype(np.int64))
    return torch.from_numpy(np.round(rng.lognormal(6.0, 1.0, size=(layers, experts))).astype(np.int64))


def timed(fn, *, repeats: int, min_time: float = 0.0) -> tuple[object, float, float]:
    """(last result, median wall seconds, median CPU seconds of this process) over the repeats.

    CPU time is reported too because the benchmark machine is shared: wall time then includes time
    spent preempted, which inflates long calls (the oracle) and short ones (native) differently.
    """
    walls, cpus = [], []
    result = None
    start_all = time.perf_counter()
    while len(walls) < repeats or time.perf_counter() - start_all < min_time:
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if len(walls) >= 1000:
            break
    return result, statistics.median(walls), statistics.median(cpus)


def speed_table(quick: bool) -> str:
    rng = np.random.default_rng(0)
    rows = []
    for label, layers, experts, replicas, groups, nodes, gpus in CASES:
        weight = README_WEIGHT if layers == 2 else token_counts(rng, layers, experts)
        args = (weight, replicas, groups, nodes, gpus)
        large = layers > 2
        expected, oracle_s, oracle_cpu = timed(lambda: oracle.rebalance_experts(*args),
                                               repeats=1 if quick else (3 if large else 20))
        got, native_s, native_cpu = timed(lambda: eplb.rebalance_experts(*args), repeats=20 if quick else 200,
                                          min_time=0.5)
        stable, stable_s, stable_cpu = timed(lambda: eplb.rebalance_experts(*args, tie_break="stable"),
                                             repeats=20 if quick else 200, min_time=0.5)
        stable_expected = oracle.rebalance_experts(*args, tie_break="stable")
        identical = all(torch.equal(a, b) for a, b in zip(got, expected))
        stable_identical = all(torch.equal(a, b) for a, b in zip(stable, stable_expected))
        rows.append([label, fmt_seconds(oracle_s), fmt_seconds(native_s), f"**{oracle_s / native_s:,.0f}×**",
                     f"{oracle_cpu / native_cpu:,.0f}×", "yes" if identical else "**NO**", fmt_seconds(stable_s),
                     f"{oracle_s / stable_s:,.0f}×", f"{oracle_cpu / stable_cpu:,.0f}×",
                     "yes" if stable_identical else "**NO**"])
        print(f"{label}: oracle {fmt_seconds(oracle_s)} (cpu {fmt_seconds(oracle_cpu)}), native {fmt_seconds(native_s)} "
              f"(cpu {fmt_seconds(native_cpu)}; {oracle_s / native_s:,.0f}× wall, {oracle_cpu / native_cpu:,.0f}× cpu, "
              f"identical={identical}), stable {fmt_seconds(stable_s)} ({oracle_s / stable_s:,.0f}×, "
              f"identical to stable oracle={stable_identical})", flush=True)
    header = ["case", "oracle (upstream algorithm)", "native default (bit-identical)", "speedup (wall)",
              "speedup (CPU time)", "identical", "native `tie_break=\"stable\"`", "speedup (wall)",
              "speedup (CPU time)", "= stable oracle"]
    return markdown_table(header, rows)


def balance_table(quick: bool) -> str:
    rng = np.random.default_rng(1)
    rows = []
    for label, layers, experts, replicas, groups, nodes, gpus in CASES[1:]:
        for kind in ("lognormal", "zipf"):
            weight = token_counts(rng, layers, experts, kind)
            args = (weight, replicas, groups, nodes, gpus)
            base = eplb.rebalance_experts(*args)
            refined, refine_s = timeit(lambda: eplb.rebalance_experts(*args, refine=True), repeats=5 if quick else 50)
            _, base_s = timeit(lambda: eplb.rebalance_experts(*args), repeats=5 if quick else 50)
            before = eplb.balancedness(weight, base[0], base[2], gpus)
            after = eplb.balancedness(weight, refined[0], refined[2], gpus)
            rows.append([label, kind, f"{before:.4f}", f"{after:.4f}", fmt_seconds(base_s), fmt_seconds(refine_s)])
            print(f"{label} {kind}: balancedness {before:.4f} -> {after:.4f} (refine {fmt_seconds(refine_s)})",
                  flush=True)
    header = ["case", "loads", "greedy max/mean GPU load", "`refine=True`", "greedy time", "refine time"]
    return markdown_table(header, rows)


def migration_table(quick: bool) -> str:
    """`previous_phy2log=`: its cost on top of a plain call, and the slots it saves from moving."""
    rng = np.random.default_rng(2)
    rows = []
    for label, layers, experts, replicas, groups, nodes, gpus in CASES[1:]:
        old = token_counts(rng, layers, experts)
        # Drifted loads: each expert's count scaled by up to +-30%.
        new = torch.from_numpy(np.round(old.numpy() * rng.uniform(0.7, 1.3, old.shape)).astype(np.int64))
        previous = eplb.rebalance_experts(old, replicas, groups, nodes, gpus)[0]
        args = (new, replicas, groups, nodes, gpus)
        plain, plain_s = timeit(lambda: eplb.rebalance_experts(*args), repeats=5 if quick else 50)
        kept, kept_s = timeit(lambda: eplb.rebalance_experts(*args, previous_phy2log=previous),
                              repeats=5 if quick else 50)
        moved_plain = eplb.count_moved(previous, plain[0])
        moved_kept = eplb.count_moved(previous, kept[0])
        same_balance = math.isclose(eplb.balancedness(new, plain[0], plain[2], gpus),
                                    eplb.balancedness(new, kept[0], kept[2], gpus), rel_tol=1e-9)
        rows.append([label, f"{previous.numel():,}", f"{moved_plain:,}", f"{moved_kept:,}", fmt_seconds(plain_s),
                     fmt_seconds(kept_s), "yes" if same_balance else "**NO**"])
        print(f"{label}: moved {moved_plain} -> {moved_kept}; {fmt_seconds(plain_s)} -> {fmt_seconds(kept_s)}",
              flush=True)
    header = ["case", "slots", "slots moved, plain call", "with `previous_phy2log=`", "plain time",
              "with `previous_phy2log=`", "same balancedness"]
    return markdown_table(header, rows)


def main() -> None:
    args = parse_args(__doc__)
    speed = speed_table(args.quick)
    print(speed)
    balance = balance_table(args.quick)
    print(balance)
    migration = migration_table(args.quick)
    print(migration)
    body = (
        "`trainfast.eplb.rebalance_experts` vs the readable oracle in `tests/reference/eplb.py` (upstream's "
        "algorithm with upstream's torch calls; deepseek-ai/EPLB itself is not pip-installable). Median of "
        "repeats in one run; loads are integer lognormal token counts. \"identical\" compares all three "
        "outputs bit for bit. The default path still calls torch's sort on the tensors upstream sorts (for "
        "upstream's tie order; on the hierarchical case that sort is about half of the native time) and "
        "torch's sum where float32 group sums are not exact. "
        "The machine is shared (other jobs running), so wall-clock times include preemption; the CPU-time "
        "ratio (this process's CPU seconds, torch threads included) is the steadier comparison. Default "
        "threads (all cores; these sizes run single-threaded).\n\n"
        + speed
        + "\n\nBalancedness (mean over layers of max/mean GPU load; 1.0 is perfect) of the greedy placement and "
        "of `refine=True` (swaps out of each node's heaviest GPU):\n\n"
        + balance
        + "\n\nMinimal migration: a placement for loads drifted by up to ±30% per expert, planned plainly and "
        "with `previous_phy2log=` (the placement for the old loads). Slots moved = slots whose expert "
        "changes (`count_moved`); the GPUs of each node are matched exactly (Hungarian method), so balance "
        "is the same and fewer experts move:\n\n"
        + migration
    )
    if args.write_readme:
        write_section("eplb", body)


if __name__ == "__main__":
    main()
