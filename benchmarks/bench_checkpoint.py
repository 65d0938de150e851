"""Checkpoint write-item binning: upstream Python vs trainfast native, 10^6 items into 8 bins.

Upstream is Megatron's ``_split_by_size_and_type`` (chunk sizing) when megatron-core is installed,
else the readable oracle in tests/reference (labelled); torch DCP's (global sizing) always runs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

from _common import fmt_seconds, markdown_table, parse_args, timeit, write_section  # noqa: E402

from trainfast import checkpoint  # noqa: E402
from trainfast._util import resolve_num_threads  # noqa: E402
from trainfast._examples import gpt_write_items, many_write_items  # noqa: E402


def upstream_chunk_function():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.dist_checkpointing.strategies import filesystem_async
        return "Megatron `_split_by_size_and_type`", filesystem_async._split_by_size_and_type
    except ImportError:
        from reference.checkpoint import split_by_size_and_type

        return "oracle (megatron-core absent)", lambda bins, items: split_by_size_and_type(bins, items, "chunk")


def main() -> None:
    args = parse_args(__doc__)
    num_items = 20_000 if args.quick else 1_000_000
    bins = 8
    repeats = 3
    items = many_write_items(num_items)
    print(f"{len(items):,} WriteItems, {bins} bins")
    label, megatron_fn = upstream_chunk_function()
    from torch.distributed.checkpoint import filesystem

    rows = []
    upstream_times = {}

    def compare(name, upstream, native, single_thread=None):
        expected, upstream_s = timeit(upstream, repeats=repeats)
        upstream_times[name] = upstream_s
        for row_name, fn in [(name, native)] + ([(single_thread[0], single_thread[1])] if single_thread else []):
            got, native_s = timeit(fn, repeats=repeats)
            same = [[id(x) for x in g] for g in got] == [[id(x) for x in g] for g in expected]
            rows.append([row_name, fmt_seconds(upstream_s), fmt_seconds(native_s), f"{upstream_s / native_s:.1f}x", same])
            print(rows[-1])

    writeitem_row = f"{label} vs `split_by_size_and_type` (WriteItems)"
    compare(writeitem_row,
            lambda: megatron_fn(bins, items), lambda: checkpoint.split_by_size_and_type(bins, items),
            single_thread=(f"{label} vs `split_by_size_and_type(num_threads=1)` (WriteItems)",
                           lambda: checkpoint.split_by_size_and_type(bins, items, num_threads=1)))
    compare("torch DCP `_split_by_size_and_type` vs `sizing=\"global\"` (WriteItems)",
            lambda: filesystem._split_by_size_and_type(bins, items),
            lambda: checkpoint.split_by_size_and_type(bins, items, sizing="global"))
    is_bytes, sizes = checkpoint.write_item_sizes(items)

    def native_arrays():
        plan = checkpoint.assign_bins(is_bytes, sizes, bins)
        order, offsets = plan.order.tolist(), plan.bin_offsets.tolist()
        return [[items[i] for i in order[offsets[b]:offsets[b + 1]]] for b in range(bins)]

    expected = megatron_fn(bins, items)
    assert [[id(x) for x in g] for g in native_arrays()] == [[id(x) for x in g] for g in expected]
    upstream_s = upstream_times[writeitem_row]  # the same call as the first row, timed once
    _, array_s = timeit(lambda: checkpoint.assign_bins(is_bytes, sizes, bins), repeats=repeats * 3)
    _, convert_s = timeit(lambda: checkpoint.write_item_sizes(items), repeats=repeats)
    rows.append([f"{label} vs `assign_bins` (arrays already built)", fmt_seconds(upstream_s), fmt_seconds(array_s),
                 f"{upstream_s / array_s:.0f}x", True])
    rows.append([f"{label} vs `write_item_sizes` + `assign_bins` (arrays from the WriteItems)", fmt_seconds(upstream_s),
                 fmt_seconds(convert_s + array_s), f"{upstream_s / (convert_s + array_s):.0f}x", True])
    print(rows[-2:])

    balance_rows = []
    for name, kwargs in [("dense+MoE GPT, tp8 dp8 (1.5k items)", {}),
                         ("48 layers, 64 experts", {"num_experts": 64}),
                         ("16 layers, dp=64", {"num_layers": 16, "dp": 64, "dp_rank": 5})]:
        plan_items = gpt_write_items(**kwargs)
        _, plan_sizes = checkpoint.write_item_sizes(plan_items, count_bytes=True)
        plan_bytes = checkpoint.write_item_sizes(plan_items)[0]
        for plan_bins in (4, 8, 16):
            upstream = checkpoint.assign_bins(plan_bytes, plan_sizes, plan_bins)
            refined, refine_s = timeit(
                lambda: checkpoint.assign_bins(plan_bytes, plan_sizes, plan_bins, balance="refined"), repeats=3)
            balance_rows.append([name, len(plan_items), plan_bins, f"{checkpoint.balance_ratio(upstream.bin_bytes):.4f}",
                                 f"{checkpoint.balance_ratio(refined.bin_bytes):.4f}", fmt_seconds(refine_s)])
            print(balance_rows[-1])

    body = (
        f"{num_items:,} WriteItems (synthetic GPT/MoE plans), {bins} bins, median of {repeats} (garbage "
        "collected before each call); the array rows reuse the first row's upstream time; "
        "identical = same objects in the same bins and order. Upstream is single-threaded; trainfast "
        f"reads the items on {resolve_num_threads(None)} threads (the default: available cores) "
        "unless `num_threads=1`.\n\n"
        + markdown_table(["comparison", "upstream", "trainfast", "speed-up", "identical"], rows)
        + "\n\n`balance=\"refined\"` (max-bin / mean-bin chunk bytes; 1.0 is perfect):\n\n"
        + markdown_table(["plan", "items", "bins", "upstream", "refined", "refine time"], balance_rows)
    )
    if args.write_readme:
        write_section("checkpoint", body)


if __name__ == "__main__":
    main()
