"""Gradient-bucket planning on a DeepSeek-V3-like model (~45k params, dp=256): buffer layouts, bucket
groups and every rank's shard ranges. Python oracle and real megatron-core vs trainfast native."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.reference

from _common import fmt_seconds, markdown_table, parse_args, timeit, write_section  # noqa: E402

from tests.reference import buckets as ref  # noqa: E402
from tests.reference.buckets import FakeGroup  # noqa: E402
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


def paired_timeit(upstream, patched, repeats):
    """Fastest seconds of two functions timed alternately, each after a full GC: partition_buckets does
    the same work either way (building megatron's group objects), so the least-disturbed run of each is
    the fair comparison on a loaded machine, and GC passes over whatever else is alive would otherwise
    bias the one timed later."""
    times = ([], [])
    for k in range(repeats * 2):
        order = ((0, upstream), (1, patched)) if k % 2 == 0 else ((1, patched), (0, upstream))
        for slot, fn in order:
            gc.collect()
            start = time.perf_counter()
            fn()
            times[slot].append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


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


# --- the newest megatron-core (0.17+), timed in a child process ------------------------------------------
# Its package cannot share a process with the venv's pinned release: the parent re-runs this file with
# the side install (`make megatron-newest`, $TRAINFAST_MEGATRON_NEWEST) first on PYTHONPATH.
CHILD_ENV = "TRAINFAST_BENCH_BUCKETS_NEWEST_CHILD"


def newest_megatron_dir() -> str:
    default = Path(__file__).resolve().parents[1] / ".venv" / "megatron-newest"
    return os.environ.get("TRAINFAST_MEGATRON_NEWEST") or str(default)


def run_newest_child(quick: bool) -> dict | None:
    env = dict(os.environ)
    env[CHILD_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [newest_megatron_dir(), env.get("PYTHONPATH", "")]))
    env.setdefault("RANK", "0")  # megatron's rank-0 logging warns without torch.distributed
    command = [sys.executable, "-W", "ignore", __file__] + (["--quick"] if quick else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
        print(f"newest megatron-core not measured ({newest_megatron_dir()}): {tail}")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def newest_child_main(quick: bool) -> None:
    """Times the newest megatron-core's layout entry points on the same model; prints one JSON line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from megatron.core import package_info
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.optimizer import param_layout  # noqa: F401  (only in 0.17+)
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from trainfast.integrations import megatron as integration

    torch.cuda.current_device = lambda: "meta"
    pgb.log_on_each_pipeline_stage = lambda *args, **kwargs: None
    dp = 64 if quick else 256
    spec = deepseek_v3_spec(num_layers=8 if quick else 61)
    bucket_size = buckets.default_bucket_size(dp)
    repeats = 3 if quick else 5
    params = []
    for numel, shared, expert in zip(spec.numels, spec.shared_embedding, spec.expert):
        p = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device="meta"))
        if shared:
            p.shared_embedding = True
        if expert:
            p.allreduce = False
        params.append(p)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)

    def full_layout(*args):
        # looked up per call: patch() swaps the class attribute (a bound method kept from before would not see it)
        return DistributedOptimizer.compute_full_param_layout(*args)

    upstream_full, t_full = timeit(lambda: full_layout(params, bucket_size, dp, config, dp), repeats=repeats)
    _, t_group = timeit(lambda: pgb.group_params_for_buffers(params, False), repeats=repeats)
    # the native array API on the same buffers
    buffers = {name: (np.asarray([spec.numels[i] for i in idx], dtype=np.int64),
                      np.asarray([spec.shared_embedding[i] for i in idx], dtype=bool))
               for name, idx in spec.buffers().items()}
    layouts, t_native_layout = timeit(lambda: {n: buckets.plan_layout(a, shared_embedding=s, bucket_size=bucket_size,
                                                                      data_parallel_world_size=dp)
                                               for n, (a, s) in buffers.items()}, repeats=repeats)
    for layout, (key, upstream) in zip(layouts.values(), upstream_full.layouts.items()):
        plist = [p for p in params if (not getattr(p, "allreduce", True)) == key.is_expert_parallel]
        assert [tuple(b) for b in layout.bucket_indices.tolist()] == upstream.bucket_indices
        assert layout.param_start.tolist() == [upstream.param_index_map[p][0] for p in plist]
    _, t_native_groups = timeit(lambda: {n: buckets.partition_bucket_indices([False], [lay.num_buckets])
                                         for n, lay in layouts.items()}, repeats=repeats)
    _, t_native_ranges = timeit(lambda: {n: buckets.shard_ranges(lay, dp) for n, lay in layouts.items()},
                                repeats=repeats)

    # megatron's buffers (meta device) built from that layout, for partition_buckets and the range builder
    grouped = pgb.group_params_for_buffers(params, False)
    built = []
    names = {p: f"p{i}" for i, p in enumerate(params)}
    group = FakeGroup(dp)
    pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=group)
    for key, (plist, indices) in grouped.items():
        built.append(pgb._ParamAndGradBuffer(config, key.param_dtype, key.grad_dtype, [(p, names[p]) for p in plist],
                                             group, bucket_size, names, 1.0, indices, False, pg_collection=pg,
                                             param_layout=upstream_full.layouts[key]))
    upstream_partition = pgb.partition_buckets
    samples = 3 if quick else 9
    calls = [len(b.buckets) * dp for b in built]
    per_call = [time_range_calls(DistributedOptimizer, b, dp, samples) for b in built]
    t_ranges = sum(c * t for c, t in zip(calls, per_call))
    for b in built:
        b.data_parallel_group = group

    integration.patch()
    try:
        patched_full, t_full_patched = timeit(lambda: full_layout(params, bucket_size, dp, config, dp),
                                              repeats=repeats)
        assert type(patched_full) is type(upstream_full)
        for (key_a, a), (key_b, b) in zip(patched_full.layouts.items(), upstream_full.layouts.items()):
            assert key_a == key_b and a.bucket_indices == b.bucket_indices
            assert list(a.param_index_map.items()) == list(b.param_index_map.items())
            assert a.param_indices == b.param_indices and a.num_optimizer_shards == b.num_optimizer_shards
        _, t_group_patched = timeit(lambda: pgb.group_params_for_buffers(params, False), repeats=repeats)
        t_partition, t_partition_patched = paired_timeit(
            lambda: [upstream_partition([b]) for b in built], lambda: [pgb.partition_buckets([b]) for b in built],
            3 * repeats)
        # the first call on a buffer also snapshots its param_index_map (one pass); later calls reuse it
        buckets._SNAPSHOTS.clear()
        first_calls = []
        for b in built:
            start = time.perf_counter()
            DistributedOptimizer._build_model_gbuf_range(b, len(b.buckets) - 1)
            first_calls.append(time.perf_counter() - start)
        per_call_patched = [time_range_calls(DistributedOptimizer, b, dp, samples * 4) for b in built]
    finally:
        integration.unpatch()
    t_ranges_patched = sum(c * t for c, t in zip(calls, per_call_patched))
    print(json.dumps({
        "version": package_info.__version__.split("+")[0], "calls": sum(calls), "samples": samples,
        "full": t_full, "group": t_group, "partition": t_partition, "ranges": t_ranges,
        "native_layout": t_native_layout, "native_groups": t_native_groups, "native_ranges": t_native_ranges,
        "full_patched": t_full_patched, "group_patched": t_group_patched,
        "partition_patched": t_partition_patched, "ranges_patched": t_ranges_patched,
        "range_first_patched": max(first_calls), "load": os.getloadavg()[0],
    }))


def newest_rows(r: dict) -> list[str]:
    version = r["version"]
    native_total = r["native_layout"] + r["native_groups"] + r["native_ranges"]
    total = r["full"] + r["partition"] + r["ranges"]
    rows = [
        ["buffer layouts: `DistributedOptimizer.compute_full_param_layout` (grouping + both buffers)",
         fmt_seconds(r["full"]), fmt_seconds(r["native_layout"]), f"{r['full'] / r['native_layout']:,.0f}x"],
        ["bucket groups: `partition_buckets` (builds group objects)", fmt_seconds(r["partition"]),
         fmt_seconds(r["native_groups"]), f"{r['partition'] / r['native_groups']:,.0f}x"],
        [f"shard ranges: `_build_model_gbuf_range` x {r['calls']:,} (rank, bucket) calls*",
         f"~{fmt_seconds(r['ranges'])}", fmt_seconds(r["native_ranges"]), f"~{r['ranges'] / r['native_ranges']:,.0f}x"],
        ["**total**", f"**~{fmt_seconds(total)}**", f"**{fmt_seconds(native_total)}**",
         f"**~{total / native_total:,.0f}x**"],
    ]
    patched = [
        ["`DistributedOptimizer.compute_full_param_layout` (returns megatron's dataclasses)",
         fmt_seconds(r["full"]), fmt_seconds(r["full_patched"]), f"{r['full'] / r['full_patched']:,.1f}x"],
        ["`group_params_for_buffers`", fmt_seconds(r["group"]), fmt_seconds(r["group_patched"]),
         f"{r['group'] / r['group_patched']:,.1f}x"],
        ["`_build_model_gbuf_range`, per (rank, bucket) call", fmt_seconds(r["ranges"] / r["calls"]),
         fmt_seconds(r["ranges_patched"] / r["calls"]), f"{r['ranges'] / r['ranges_patched']:,.0f}x"],
        ["`partition_buckets` (dense + expert)", fmt_seconds(r["partition"]), fmt_seconds(r["partition_patched"]),
         f"{r['partition'] / r['partition_patched']:,.1f}x"],
    ]
    return [
        "",
        f"The newest megatron-core ({version}, separate layout functions; run in a child process from the side "
        "install of `make megatron-newest`) vs trainfast native (array API):",
        "",
        markdown_table(["step", f"megatron-core {version}", "trainfast", "speedup"], rows),
        "",
        f"\\* as above: median of {r['samples']} sampled calls per buffer times {r['calls']:,} calls.",
        "",
        f"Inside megatron-core {version} with `trainfast.integrations.megatron.patch()` (same objects, checked "
        "identical in tests/megatron_newest_buckets.py):",
        "",
        markdown_table(["entry point", "upstream", "patched", "speedup"], patched),
        "",
        f"The range builder's first call on a buffer also snapshots its `param_index_map` "
        f"({fmt_seconds(r['range_first_patched'])} for the larger buffer); every call re-checks the snapshot "
        "against the dict. `partition_buckets` is as fast as upstream at best: building megatron's "
        "`_ParamAndGradBucketGroup` objects (upstream's constructor, one per bucket) is all of its work (its "
        "rows: the fastest of 15 alternating runs each). "
        f"Load average {r['load']:.1f} on {os.cpu_count()} cores during this child run.",
    ]


def main() -> None:
    args = parse_args(__doc__)
    load = os.getloadavg()[0]
    if os.environ.get(CHILD_ENV):
        newest_child_main(args.quick)
        return
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
        table, expected = ranges[name], oracle_range[name]
        assert len(table.rank) == len(expected)
        got = list(zip(table.rank.tolist(), table.bucket.tolist(), table.param.tolist(),
                       *(map(tuple, column.tolist()) for column in (table.gbuf_world, table.gbuf_world_in_bucket,
                                                                    table.gbuf_local, table.param_range))))
        assert got == expected, f"{name}: shard ranges differ from the oracle's"
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
        "medians; on a small shared machine they vary between runs by up to ~2x (load average "
        f"{load:.1f} on {os.cpu_count()} cores when this run started).",
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
        upstream_partition = pgb.partition_buckets
        samples = 3 if args.quick else 9
        calls = {name: len(b.buckets) * dp for name, b in built.items()}
        per_call = {name: time_range_calls(distopt, b, dp, samples) for name, b in built.items()}
        t_mc_ranges = sum(per_call[n] * calls[n] for n in built)
        integration.patch()
        try:
            per_call_patched = {name: time_range_calls(distopt, b, dp, samples * 4) for name, b in built.items()}
            t_mc_groups, t_tf_groups = paired_timeit(
                lambda: [upstream_partition([b]) for b in buffer_list],
                lambda: [pgb.partition_buckets([b]) for b in buffer_list], 3 * repeats)
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
    newest = run_newest_child(args.quick)
    if newest is not None:
        print(f"megatron-core {newest['version']}: {json.dumps(newest)}")
        body += newest_rows(newest)
    text = "\n".join(body)
    print(text)
    if args.write_readme:
        write_section("buckets", text)


if __name__ == "__main__":
    main()
