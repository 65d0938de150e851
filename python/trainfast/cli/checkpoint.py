"""``trainfast checkpoint``: bin a synthetic GPT checkpoint plan and compare sizing / balance modes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainfast._util import MAX_NUM_THREADS, check_int
from trainfast.cli._timing import best_of

if TYPE_CHECKING:
    from trainfast.checkpoint import Balance, Sizing

# The demo model is built as Python WriteItem objects (~30 per layer): a bound keeps it in memory.
MAX_DEMO_LAYERS = 10_000

_NAME = "checkpoint"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(_NAME, help="bin a synthetic GPT checkpoint write plan into writer threads")
    parser.add_argument("--layers", type=int, default=48, help="transformer layers (default 48, ~1,500 items)")
    parser.add_argument("--bins", type=int, default=8, help="writer threads (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=lambda args: run(args.layers, args.bins, args.seed))


def demo() -> None:
    run(num_layers=48, bins=8, seed=0)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:7.3f}"


def run(num_layers: int, bins: int, seed: int) -> int:
    from trainfast._examples import gpt_write_items
    from trainfast.checkpoint import balance_ratio, split_by_size_and_type, write_item_sizes

    check_int(num_layers, "--layers", min_value=1, max_value=MAX_DEMO_LAYERS)
    check_int(bins, "--bins", min_value=1, max_value=MAX_NUM_THREADS)  # one printed column per bin
    items = gpt_write_items(num_layers=num_layers, seed=seed)
    print(f"checkpoint: binning a GPT write plan of {len(items):,} items into {bins} writer threads")
    modes: list[tuple[str, Sizing, Balance]] = [
        ("Megatron sizing (chunk)", "chunk", "upstream"), ("torch DCP sizing (global)", "global", "upstream"),
        ("refined (chunk + moves/swaps)", "chunk", "refined")]
    _, chunk_sizes = write_item_sizes(items, sizing="chunk", count_bytes=True)
    size_of = dict(zip(map(id, items), chunk_sizes.tolist()))
    print(f"  {'mode':32s} {'per-bin GiB written':^{8 * bins - 1}s}   max/mean")
    for label, sizing, balance in modes:
        binned = split_by_size_and_type(bins, items, sizing=sizing, balance=balance)
        loads = [sum(size_of[id(item)] for item in group) for group in binned]
        print(f"  {label:32s} {' '.join(_gib(x) for x in loads)}   {balance_ratio(loads):.4f}")

    upstream = _upstream_functions()
    for label, (fn, sizing) in upstream.items():
        expected, python_s = best_of(lambda: fn(bins, items))
        got, native_s = best_of(lambda: split_by_size_and_type(bins, items, sizing=sizing))
        same = [[id(x) for x in group] for group in got] == [[id(x) for x in group] for group in expected]
        print(f"  vs {label:28s} python {python_s * 1e3:8.2f} ms  native {native_s * 1e3:6.2f} ms"
              f"  {python_s / native_s:6.1f}x  identical={same}")
    return 0


def _upstream_functions() -> dict[str, tuple[Callable[[int, list[Any]], list[list[Any]]], Sizing]]:
    """The upstream Python functions importable here: torch DCP's always, Megatron's when installed."""
    from torch.distributed.checkpoint import filesystem

    functions: dict[str, tuple[Callable[[int, list[Any]], list[list[Any]]], Sizing]] = {
        "torch DCP _split_by_size_and_type": (filesystem._split_by_size_and_type, "global")}
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.dist_checkpointing.strategies import filesystem_async
        functions["Megatron _split_by_size_and_type"] = (filesystem_async._split_by_size_and_type, "chunk")
    except ImportError:
        print("  (megatron-core not installed: comparing with torch DCP only)")
    return functions
