"""Gradient-bucket planning on a DeepSeek-V3-like model (~45k params, dp=256): buffer layouts, bucket
groups and every rank's shard ranges. Python oracle and real megatron-core vs trainfast native."""

from __future__ import annotations

import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.reference

from _common import fmt_seconds, markdown_table, parse_args, timeit, write_section  # noqa: E402

from tests.reference import buckets as ref  # noqa: E402
from trainfast import buckets  # noqa: E402
from trainfast.cli.buckets import deepseek_v3_spec  # noqa: E402


def native_pipeline(buffers, dp, bucket_size):
    layouts = {name: buckets.plan_layout(numels, shared_embedding=shared, bucket_size=bucket_size,
                                         data_parallel_world_size=dp) for name, (numels, shared) in buffers.items()}
    # DDP partitions dense and expert buffers separately.
    groups = {name: buckets.partition_bucket_indices([False], [layout.num_buckets]) for name, layout in layouts.items()}
    ranges = {name: buckets.shard_ranges(layout, dp) for name, layout in layouts.items()}
    return layouts, groups, ranges


def oracle_layouts(buffers, dp, bucket_size):
    return {name: ref.layout(numels, shared, bucket_size, dp) for name, (numels, shared) in buffers.items()}


def oracle_groups(layouts):
    return {name: ref.partition([False], [len(layout[3])]) for name, layout in layouts.items()}


def oracle_ranges(layouts, dp):
    return {name: ref.shard_ranges(*layout[:4], dp) for name, layout in layouts.items()}


class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def megatron_modules():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
            from megatron.core.distributed import DistributedDataParallelConfig
            from megatron.core.distributed import param_and_grad_buffer as pgb
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
            from megatron.core import package_info
    except ImportError:
        return None
    # Megatron allocates on torch.cuda.current_device(): use the meta device (no 2.6 TB of memory).
    torch.cuda.current_device = lambda: "meta"
    pgb.log_on_each_pipeline_stage = lambda *args, **kwargs: None
    return torch, pgb, DistributedDataParallelConfig, DistributedOptimizer, package_info.__version__


def megatron_buffers(mods, buffers, dp, bucket_size):
    """Builds megatron-core's own _ParamAndGradBuffer for each buffer (fresh meta params); timed."""
    torch, pgb, config_type, _, _ = mods
    config = config_type(use_distributed_optimizer=True)
    group = FakeGroup(dp)
    pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=group)
    built, seconds = {}, 0.0
    for name, (numels, shared) in buffers.items():
        params = []
        for numel, is_shared in zip(numels, shared):
            p = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device="meta"))
            if is_shared:
                p.shared_embedding = True
            params.append(p)
        names = {p: f"p{i}" for i, p in enumerate(params)}
        start = time.perf_counter()
        built[name] = pgb._ParamAndGradBuffer(config, torch.bfloat16, torch.float32, params, group, bucket_size, names,
                                              1.0, list(range(len(params))), False, pg_collection=pg)
        seconds += time.perf_counter() - start
    return built, seconds


def time_range_calls(distopt, buffer, dp, samples):
    """Median seconds of _build_model_gbuf_range over sampled (rank, bucket) calls."""
    calls = []
    num_buckets = len(buffer.buckets)
    for k in range(samples):
        rank, bucket = (k * 97) % dp, (k * 31) % num_buckets
        buffer.data_parallel_group = FakeGroup(dp, rank)
        start = time.perf_counter()
        distopt._build_model_gbuf_range(buffer, bucket)
        calls.append(time.perf_counter() - start)
    calls.sort()
    return calls[len(calls) // 2]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    dp = 64 if args.quick else 256
    spec = deepseek_v3_spec(num_layers=8 if args.quick else 61)
    bucket_size = buckets.default_bucket_size(dp)
    buffers = {
        name: ([spec.numels[i] for i in idx], [spec.shared_embedding[i] for i in idx])
        for name, idx in spec.buffers().items()
    }
    repeats = 3 if args.quick else 5
    # Tools hold arrays already; the oracle gets plain lists.
    arrays = {name: (np.asarray(numels, dtype=np.int64), np.asarray(shared, dtype=bool))
              for name, (numels, shared) in buffers.items()}
    native_pipeline(arrays, dp, bucket_size)  # warm-up: first use imports torch
    print(f"{spec.name}: {len(spec.numels):,} params, {sum(spec.numels) / 1e9:.0f}B elements, dp={dp}, "
          f"bucket_size={bucket_size:,}")

    (layouts, groups, ranges), native_total = timeit(lambda: native_pipeline(arrays, dp, bucket_size),
                                                     repeats=repeats)
    _, native_layout = timeit(lambda: {n: buckets.plan_layout(a, shared_embedding=s, bucket_size=bucket_size,
                                                               data_parallel_world_size=dp)
                                       for n, (a, s) in arrays.items()}, repeats=repeats)
    _, native_groups = timeit(lambda: {n: buckets.partition_bucket_indices([False], [lay.num_buckets])
                                       for n, lay in layouts.items()}, repeats=repeats)
    _, native_ranges = timeit(lambda: {n: buckets.shard_ranges(lay, dp) for n, lay in layouts.items()},
                              repeats=repeats)
    num_buckets = sum(layout.num_buckets for layout in layouts.values())
    num_rows = sum(len(table.rank) for table in ranges.values())
    print(f"native: {num_buckets:,} buckets, {num_rows:,} shard-range rows, {fmt_seconds(native_total)}")

    oracle_layout, t_layout = timeit(lambda: oracle_layouts(buffers, dp, bucket_size), repeats=1)
    oracle_group, t_groups = timeit(lambda: oracle_groups(oracle_layout), repeats=3)
    oracle_range, t_ranges = timeit(lambda: oracle_ranges(oracle_layout, dp), repeats=1)
    for name, layout in layouts.items():
        assert (layout.param_start.tolist(), layout.param_end.tolist(), layout.bucket_id.tolist()) == tuple(
            oracle_layout[name][:3])
        assert groups[name].groups() == oracle_group[name]
        assert len(ranges[name].rank) == len(oracle_range[name])
        assert ranges[name].gbuf_world.tolist() == [list(row[3]) for row in oracle_range[name]]
    oracle_total = t_layout + t_groups + t_ranges
    print(f"oracle: {fmt_seconds(oracle_total)} (identical results)")

    rows = [
        ["buffer layouts (dense + expert)", fmt_seconds(t_layout), fmt_seconds(native_layout),
         f"{t_layout / native_layout:,.0f}x"],
        ["bucket groups", fmt_seconds(t_groups), fmt_seconds(native_groups), f"{t_groups / native_groups:,.0f}x"],
        [f"shard ranges, all {dp} ranks ({num_rows:,} rows)", fmt_seconds(t_ranges), fmt_seconds(native_ranges),
         f"{t_ranges / native_ranges:,.0f}x"],
        ["**total (one call each)**", f"**{fmt_seconds(oracle_total)}**", f"**{fmt_seconds(native_total)}**",
         f"**{oracle_total / native_total:,.0f}x**"],
    ]
    body = [
        f"{spec.name}: {len(spec.numels):,} params ({sum(spec.numels) / 1e9:.0f}B elements) in a dense and an "
        f"expert buffer, dp={dp}, bucket_size={bucket_size:,} (Megatron's default): {num_buckets:,} buckets, "
        f"{num_rows:,} (rank, bucket, param) shard-range rows. Results are checked identical. Wall-clock "
        "medians; on a small shared machine they vary between runs by up to ~2x.",
        "",
        "Python oracle (tests/reference/buckets.py) vs trainfast native:",
        "",
        markdown_table(["step", "Python oracle", "trainfast", "speedup"], rows),
    ]

    mods = megatron_modules()
    if mods is None:
        print("megatron-core not installed: no upstream rows")
    else:
        torch, pgb, _, distopt, version = mods
        from trainfast.integrations import megatron as integration

        built, t_mc_layout = megatron_buffers(mods, buffers, dp, bucket_size)
        for name, buffer in built.items():
            assert list(buffer.param_index_map.values()) == list(zip(
                layouts[name].param_start.tolist()[::-1], layouts[name].param_end.tolist()[::-1],
                layouts[name].bucket_id.tolist()[::-1]))
        buffer_list = list(built.values())
        _, t_mc_groups = timeit(lambda: [pgb.partition_buckets([b]) for b in buffer_list], repeats=repeats)
        samples = 3 if args.quick else 9
        calls = {name: len(b.buckets) * dp for name, b in built.items()}
        per_call = {name: time_range_calls(distopt, b, dp, samples) for name, b in built.items()}
        t_mc_ranges = sum(per_call[n] * calls[n] for n in built)
        integration.patch()
        try:
            per_call_patched = {name: time_range_calls(distopt, b, dp, samples * 4) for name, b in built.items()}
            _, t_tf_groups = timeit(lambda: [pgb.partition_buckets([b]) for b in buffer_list], repeats=repeats)
        finally:
            integration.unpatch()
        t_tf_ranges = sum(per_call_patched[n] * calls[n] for n in built)
        mc_total = t_mc_layout + t_mc_groups + t_mc_ranges
        print(f"megatron-core {version}: layout {fmt_seconds(t_mc_layout)}, groups {fmt_seconds(t_mc_groups)}, "
              f"ranges ~{fmt_seconds(t_mc_ranges)} (extrapolated); patched ranges ~{fmt_seconds(t_tf_ranges)}")
        mc_rows = [
            ["buffer layouts: `_ParamAndGradBuffer.__init__` (layout + view mapping, meta device)",
             fmt_seconds(t_mc_layout), fmt_seconds(native_layout), f"{t_mc_layout / native_layout:,.0f}x"],
            ["bucket groups: `partition_buckets` (builds group objects)", fmt_seconds(t_mc_groups),
             fmt_seconds(native_groups), f"{t_mc_groups / native_groups:,.0f}x"],
            [f"shard ranges: `_build_model_gbuf_range` x {sum(calls.values()):,} (rank, bucket) calls*",
             f"~{fmt_seconds(t_mc_ranges)}", fmt_seconds(native_ranges), f"~{t_mc_ranges / native_ranges:,.0f}x"],
            ["**total**", f"**~{fmt_seconds(mc_total)}**", f"**{fmt_seconds(native_total)}**",
             f"**~{mc_total / native_total:,.0f}x**"],
        ]
        patched_rows = [
            ["`_build_model_gbuf_range`, per (rank, bucket) call",
             fmt_seconds(sum(per_call[n] * calls[n] for n in built) / sum(calls.values())),
             fmt_seconds(t_tf_ranges / sum(calls.values())), f"{t_mc_ranges / t_tf_ranges:,.0f}x"],
            ["`partition_buckets` (dense + expert)", fmt_seconds(t_mc_groups), fmt_seconds(t_tf_groups),
             f"{t_mc_groups / t_tf_groups:,.1f}x"],
        ]
        body += [
            "",
            f"Real megatron-core {version} entry points vs trainfast native (array API):",
            "",
            markdown_table(["step", f"megatron-core {version}", "trainfast", "speedup"], mc_rows),
            "",
            f"\\* Megatron rescans the whole `param_index_map` for every (rank, bucket); the time is the median of "
            f"{samples} sampled calls per buffer times the number of calls ({sum(calls.values()):,}), "
            "not a full run. Megatron computes only its own rank's ranges; the native column computes all ranks.",
            "",
            "Inside megatron-core with `trainfast.integrations.megatron.patch()` (same objects, checked identical "
            "in tests/test_buckets.py):",
            "",
            markdown_table(["entry point", "upstream", "patched", "speedup"], patched_rows),
        ]
    text = "\n".join(body)
    print(text)
    if args.write_readme:
        write_section("buckets", text)


if __name__ == "__main__":
    main()
