"""Gradient-bucket planning against the REAL newest megatron-core (0.17+: param_layout.py and the
separate layout functions). Not collected by the main run (its venv pins an older megatron-core and
two releases cannot share one process): tests/test_buckets.py runs this module in a subprocess with
the newest release first on PYTHONPATH (`make megatron-newest` installs it)."""

from __future__ import annotations

import random
import types
import warnings

import pytest
import torch

with warnings.catch_warnings():
    # megatron-core's import-time notices (no Transformer Engine / Apex on CPU machines).
    warnings.simplefilter("ignore")
    from megatron.core import package_info
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import distributed_data_parallel as mc_ddp
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer import distrib_optimizer as mc_distopt
    from megatron.core.optimizer import param_layout as mc_layout
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from tests.reference import buckets as ref
from tests.reference.buckets import FakeGroup
from trainfast import buckets
from trainfast._util import UpstreamAssertionError
from trainfast.integrations import megatron as integration

DPS = [1, 2, 3, 8, 64, 1000]


def test_this_is_the_newest_megatron_core():
    major, minor = (int(x) for x in package_info.__version__.split(".")[:2])
    assert (major, minor) >= (0, 17), f"expected megatron-core >= 0.17, got {package_info.__version__}"
    assert pgb.__file__.startswith(str(mc_layout.__file__).rsplit("megatron", 1)[0])
    # trainfast hands back megatron's own dataclasses
    assert buckets._dataclasses() == (mc_layout.BufferKey, mc_layout.PerBufferParamLayout, mc_layout.FullParamLayout)


# --- random models -----------------------------------------------------------------------------------


@pytest.fixture
def fake_fp8(monkeypatch):
    """Without Transformer Engine nothing is fp8: params flagged `_tf_fp8` count as fp8 tensors for
    upstream's own `_param_uses_quantized_storage` (which trainfast calls too)."""
    monkeypatch.setattr(pgb, "is_float8tensor", lambda t: bool(getattr(t, "_tf_fp8", False)))


def numel_choice(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.03:
        return 0  # empty params are legal upstream (they take no space but still join a bucket)
    if kind < 0.1:
        return 1
    if kind < 0.6:
        return rng.randint(1, 5000)
    if kind < 0.9:
        return rng.randint(1, 300_000)
    return rng.randint(1, 10**7)


def random_model(rng: random.Random, n: int, *, fp8=True, experts=True, layer_wise=False, device="meta"):
    """Params as Megatron's DDP sees them (meta tensors: 10**7-element params cost nothing)."""
    dtypes = rng.choice([(torch.bfloat16,), (torch.bfloat16, torch.float32), (torch.float32, torch.float16,
                                                                               torch.bfloat16)])
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.empty(numel_choice(rng), dtype=rng.choice(dtypes), device=device))
        if fp8 and p.dtype == torch.bfloat16 and rng.random() < 0.3:
            p._tf_fp8 = True
        if experts and rng.random() < 0.3:
            p.allreduce = False
        if layer_wise and rng.random() < 0.2:
            p.is_managed_by_layer_wise_optimizer = True
        params.append(p)
    where = rng.choice(["none", "first", "last", "middle", "ends", "random"])
    if n:
        marked = {"none": [], "first": [0], "last": [n - 1], "middle": [n // 2], "ends": [0, n - 1],
                  "random": [i for i in range(n) if rng.random() < 0.1]}[where]
        for i in marked:
            params[i].shared_embedding = True
    return params


def bucket_size_choice(rng: random.Random, dp: int):
    # <= 0 too: Megatron's resolve_ddp_bucket_size gives 0 when there are more buckets than params.
    return rng.choice([None, rng.randint(-3, 0), rng.randint(1, 5000), rng.randint(5000, 2_000_000),
                       buckets.default_bucket_size(dp)])


def ddp_config(rng: random.Random, **overrides):
    kwargs = dict(use_distributed_optimizer=True, grad_reduce_in_fp32=rng.random() < 0.5,
                  pad_buckets_for_high_nccl_busbw=rng.random() < 0.25)
    kwargs.update(overrides)
    return DistributedDataParallelConfig(**kwargs)


def layout_tuple(layout):
    """Everything a PerBufferParamLayout says, params by identity, in the dict's order."""
    return (
        type(layout),
        [(id(p), tuple(v)) for p, v in layout.param_index_map.items()],
        [tuple(b) for b in layout.bucket_indices],
        list(layout.per_bucket_numel_unpadded),
        list(layout.param_indices),
        layout.num_optimizer_shards,
    )


def full_tuple(full):
    return type(full), [(key, layout_tuple(layout)) for key, layout in full.layouts.items()]


def groups_tuple(grouped):
    return [(type(key), key, [id(p) for p in plist], list(indices)) for key, (plist, indices) in grouped.items()]


# --- differential: upstream's functions == trainfast's drop-ins == array API --------------------------


@pytest.mark.parametrize("seed", range(40))
def test_full_layout_and_groups_equal_upstream(seed, fake_fp8):
    rng = random.Random(seed)
    params = random_model(rng, rng.choice([0, 1, 2, rng.randint(3, 40), rng.randint(40, 400)]),
                          layer_wise=seed % 5 == 0)
    dp = rng.choice(DPS)
    expert_dp = rng.choice([None, *DPS])
    bucket_size = bucket_size_choice(rng, dp)
    config = ddp_config(rng)

    for fp32 in (False, True):
        assert groups_tuple(buckets.group_params_for_buffers(params, fp32)) == groups_tuple(
            pgb.group_params_for_buffers(params, fp32))

    want = DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, config, expert_dp)
    got = buckets.compute_full_param_layout(params, bucket_size, dp, config, expert_dp)
    assert full_tuple(got) == full_tuple(want)
    assert type(got) is mc_layout.FullParamLayout
    assert all(type(key) is mc_layout.BufferKey for key in got.layouts)
    if any(getattr(p, "_tf_fp8", False) for p in params):
        assert any(key.param_dtype == torch.uint8 for key in got.layouts)

    for key, (plist, indices) in pgb.group_params_for_buffers(params, config.grad_reduce_in_fp32).items():
        world = (expert_dp or dp) if key.is_expert_parallel else dp
        upstream = DistributedOptimizer._compute_per_buffer_param_layout(plist, bucket_size, world, config, indices)
        ours = buckets.compute_per_buffer_param_layout(plist, bucket_size, world, config, indices)
        assert layout_tuple(ours) == layout_tuple(upstream)
        assert upstream.num_optimizer_shards == world
        # the array API on numels gives the same numbers, in model order
        arrays = buckets.plan_layout([p.numel() for p in plist],
                                     shared_embedding=[getattr(p, "shared_embedding", False) for p in plist],
                                     bucket_size=bucket_size, data_parallel_world_size=world,
                                     pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw)
        assert list(zip(arrays.param_start.tolist(), arrays.param_end.tolist(), arrays.bucket_id.tolist())) == [
            upstream.param_index_map[p] for p in plist]
        assert [tuple(b) for b in arrays.bucket_indices.tolist()] == upstream.bucket_indices
        assert arrays.per_bucket_numel_unpadded.tolist() == upstream.per_bucket_numel_unpadded
        assert arrays.numel == upstream.bucket_indices[-1][1]
        assert arrays.numel_unpadded == sum(upstream.per_bucket_numel_unpadded)

        default_want = pgb._compute_default_per_buffer_param_layout(plist, bucket_size)
        default_got = buckets.compute_default_per_buffer_param_layout(plist, bucket_size)
        assert layout_tuple(default_got) == layout_tuple(default_want)
        default_arrays = buckets.plan_layout([p.numel() for p in plist], bucket_size=bucket_size,
                                             use_distributed_optimizer=False)
        assert [tuple(b) for b in default_arrays.bucket_indices.tolist()] == default_want.bucket_indices
        assert default_arrays.param_start.tolist() == [default_want.param_index_map[p][0] for p in plist]


def fake_buffer(layout, rank, dp):
    """The attributes DistributedOptimizer._build_model_gbuf_range reads from a _ParamAndGradBuffer."""
    bucket_list = [types.SimpleNamespace(offset=start, grad_data=torch.empty(end - start, device="meta"))
                   for start, end in layout.bucket_indices]
    return types.SimpleNamespace(param_index_map=layout.param_index_map, buckets=bucket_list,
                                 data_parallel_group=FakeGroup(dp, rank),
                                 num_optimizer_shards=layout.num_optimizer_shards)


def range_map_rows(param_map, index_of):
    return [(index_of[id(p)],) + tuple((r[name].start, r[name].end, r[name].size) for name in
                                       ("gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param"))
            for p, r in param_map.items()]


@pytest.mark.parametrize("seed", range(24))
def test_shard_ranges_equal_upstream(seed):
    rng = random.Random(1000 + seed)
    params = random_model(rng, rng.randint(1, 120), fp8=False, experts=False)
    dp = DPS[seed % len(DPS)]
    bucket_size = bucket_size_choice(rng, dp)
    config = ddp_config(rng)
    layout = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp, config)
    index_of = {id(p): i for i, p in enumerate(params)}
    arrays = buckets.plan_layout([p.numel() for p in params],
                                 shared_embedding=[getattr(p, "shared_embedding", False) for p in params],
                                 bucket_size=bucket_size, data_parallel_world_size=dp,
                                 pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw)
    table = buckets.shard_ranges(arrays, dp)
    all_rows = list(zip(table.rank.tolist(), table.bucket.tolist(), table.param.tolist(),
                        map(tuple, table.gbuf_world.tolist()), map(tuple, table.gbuf_world_in_bucket.tolist()),
                        map(tuple, table.gbuf_local.tolist()), map(tuple, table.param_range.tolist())))
    ranks = range(dp) if dp <= 64 else sorted({0, 1, dp // 2, dp - 1, rng.randrange(dp)})
    want_rows = []
    for rank in ranks:
        for b in range(len(layout.bucket_indices)):
            upstream = DistributedOptimizer._build_model_gbuf_range(fake_buffer(layout, rank, dp), b)
            ours = buckets.build_model_gbuf_range(fake_buffer(layout, rank, dp), b)
            assert range_map_rows(ours["param_map"], index_of) == range_map_rows(upstream["param_map"], index_of)
            assert all(type(r) is mc_distopt.Range for v in ours["param_map"].values() for r in v.values())
            want_rows += [(rank, b, row[0], *(pair[:2] for pair in row[1:]))
                          for row in range_map_rows(upstream["param_map"], index_of)]
    assert [row for row in all_rows if row[0] in set(ranks)] == want_rows
    if dp <= 64:
        assert len(all_rows) == len(want_rows)
    # the range-map builder on its own, with world ranges that ignore shard and bucket edges
    numel = layout.bucket_indices[-1][1]
    for _ in range(20):
        start = rng.randrange(numel + 1)
        end = rng.choice([start, min(numel, start + rng.randint(1, 5000)), rng.randint(start, numel)])
        offset = rng.randint(0, start)
        want = DistributedOptimizer._build_model_gbuf_param_range_map(layout.param_index_map,
                                                                      mc_distopt.Range(start, end), offset)
        got = buckets.build_model_gbuf_param_range_map(layout.param_index_map, mc_distopt.Range(start, end), offset)
        assert range_map_rows(got, index_of) == range_map_rows(want, index_of)
    # a layout built for another shard count is refused, as upstream asserts
    if dp > 1:
        wrong = fake_buffer(layout, 0, 1)
        with pytest.raises(AssertionError):
            DistributedOptimizer._build_model_gbuf_range(wrong, 0)
        with pytest.raises(UpstreamAssertionError, match="optimizer shards"):
            buckets.build_model_gbuf_range(wrong, 0)


# --- the issue's test vectors hold on upstream too -----------------------------------------------------


def named_params(*numels, shared=()):
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in numels]
    for i in shared:
        params[i].shared_embedding = True
    return params


@pytest.mark.parametrize("implementation", ["upstream", "trainfast"])
def test_issue_vectors(implementation):
    per_buffer = (DistributedOptimizer._compute_per_buffer_param_layout if implementation == "upstream"
                  else buckets.compute_per_buffer_param_layout)
    default = (pgb._compute_default_per_buffer_param_layout if implementation == "upstream"
               else buckets.compute_default_per_buffer_param_layout)
    build_range = (DistributedOptimizer._build_model_gbuf_range if implementation == "upstream"
                   else buckets.build_model_gbuf_range)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    busbw = DistributedDataParallelConfig(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True)

    w0, w1 = named_params(97, 103)
    layout = per_buffer([w0, w1], None, 2, config)
    assert (layout.param_index_map[w1], layout.param_index_map[w0]) == ((0, 103, 0), (128, 225, 0))
    assert layout.bucket_indices == [(0, 256)] and layout.per_bucket_numel_unpadded == [225]

    p0, p1, p2 = named_params(5000, 5000, 5000)
    layout = per_buffer([p0, p1, p2], 8000, 2, config)
    assert [layout.param_index_map[p] for p in (p2, p1, p0)] == [(0, 5000, 0), (5056, 10056, 0), (10112, 15112, 1)]
    assert layout.bucket_indices == [(0, 10112), (10112, 15232)]
    assert layout.per_bucket_numel_unpadded == [10056, 5000]
    plain = default([p0, p1, p2], 8000)
    assert [plain.param_index_map[p] for p in (p2, p1, p0)] == [(0, 5000, 0), (5000, 10000, 0), (10000, 15000, 1)]
    rank1 = build_range(fake_buffer(layout, 1, 2), 1)["param_map"]
    assert list(rank1) == [p0]
    got = {name: (r.start, r.end) for name, r in rank1[p0].items()}
    assert got == {"gbuf_world": (12672, 15112), "gbuf_world_in_bucket": (2560, 5000), "gbuf_local": (0, 2440),
                   "param": (2560, 5000)}

    emb, a, b, head = named_params(1000, 100, 1000, 1000, shared=(0, 3))
    layout = per_buffer([emb, a, b, head], None, 4, config)
    assert [layout.param_index_map[p] for p in (head, b, a, emb)] == [
        (0, 1000, 0), (1024, 2024, 1), (2048, 2148, 1), (2176, 3176, 2)]
    assert layout.bucket_indices == [(0, 1024), (1024, 2176), (2176, 3200)]
    assert layout.per_bucket_numel_unpadded == [1000, 1152, 1000]

    (x,) = named_params(1000)
    assert per_buffer([x], None, 3, config).bucket_indices == [(0, 1152)]
    assert per_buffer([x], None, 3, busbw).bucket_indices == [(0, 196608)]


# --- megatron's own entry points: real buffers, with and without the patch -----------------------------


@pytest.fixture
def megatron_meta(monkeypatch, fake_fp8):
    """Lets _ParamAndGradBuffer build without a GPU or torch.distributed: buffers on the meta device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    monkeypatch.setenv("RANK", "0")  # megatron's rank-0 logging warns without torch.distributed
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None, raising=False)
    yield
    integration.unpatch()


def build_buffers(params, bucket_size, dp, expert_dp, config):
    """What DistributedDataParallel.__init__ does with its layout: group, lay out (the distributed
    optimizer's compute_full_param_layout), build one _ParamAndGradBuffer per key, partition."""
    grouped = mc_ddp.group_params_for_buffers(params, config.grad_reduce_in_fp32)
    full = DistributedOptimizer.compute_full_param_layout(params, bucket_size, dp, config, expert_dp)
    names = {p: f"p{i}" for i, p in enumerate(params)}
    dense, expert = [], []
    groups = {False: FakeGroup(dp), True: FakeGroup(expert_dp)}  # one process group per kind, as DDP
    for key, (plist, indices) in grouped.items():
        group = groups[key.is_expert_parallel]
        pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=group)
        buffer = pgb._ParamAndGradBuffer(config, key.param_dtype, key.grad_dtype, [(p, names[p]) for p in plist],
                                         group, bucket_size, names, 1.0, indices, False, pg_collection=pg,
                                         param_layout=full.layouts[key])
        (expert if key.is_expert_parallel else dense).append(buffer)
    return full, dense, expert


def describe_buffers(buffers):
    return [(b.param_dtype, b.grad_dtype, list(map(id, b.param_index_map)), list(b.param_index_map.values()),
             list(b.bucket_indices), b.numel, b.numel_unpadded, b.num_optimizer_shards,
             [[id(p) for p in bucket.params_list] for bucket in b.buckets]) for b in buffers]


def describe_ranges(buffers):
    out = []
    for buffer in buffers:
        world = buffer.data_parallel_world_size
        index_of = {id(p): i for i, p in enumerate(buffer.params)}
        group = buffer.data_parallel_group
        for rank in sorted({0, world // 2, world - 1}):
            buffer.data_parallel_group = FakeGroup(world, rank)
            for key, per_bucket in DistributedOptimizer._build_gbuf_range_map(buffer).items():
                out.append((rank, key, [range_map_rows(m["param_map"], index_of) for m in per_bucket]))
        buffer.data_parallel_group = group
    return out


def partition_membership(partition, buffers):
    """Each group as (buffer, bucket) positions and its collective group size."""
    where = {id(bucket): (i, j) for i, b in enumerate(buffers) for j, bucket in enumerate(b.buckets)}
    out = []
    for force in (False, True):
        for rs_fp32 in (False, True):
            groups = partition(buffers, force_single_bucket_group=force,
                               reduce_scatter_with_fp32_accumulation=rs_fp32)
            out.append([([where[id(b)] for b in g.buckets], g.intra_distributed_optimizer_instance_size) for g in groups])
    return out


@pytest.mark.parametrize("seed", range(8))
def test_megatron_entry_points_with_and_without_patch(seed, megatron_meta):
    rng = random.Random(2000 + seed)
    # bf16 / fp32 params (fp8 needs Transformer Engine to build a buffer) in dense and expert buffers
    params = random_model(rng, rng.randint(1, 60), fp8=False)
    dp, expert_dp = rng.choice([1, 2, 3, 8, 64]), rng.choice([1, 2, 8])
    bucket_size = bucket_size_choice(rng, dp)
    config = ddp_config(rng)

    def run():
        full, dense, expert = build_buffers(params, bucket_size, dp, expert_dp, config)
        return (full_tuple(full), describe_buffers(dense + expert), describe_ranges(dense + expert),
                partition_membership(mc_ddp.partition_buckets, dense),
                partition_membership(mc_distopt.partition_buckets, expert))

    expected = run()
    patched = integration.patch()
    try:
        for target in (
            "megatron.core.distributed.param_and_grad_buffer.group_params_for_buffers",
            "megatron.core.distributed.distributed_data_parallel.group_params_for_buffers",
            "megatron.core.optimizer.distrib_optimizer.group_params_for_buffers",
            "megatron.core.distributed.param_and_grad_buffer._compute_default_per_buffer_param_layout",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._compute_per_buffer_param_layout",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.compute_full_param_layout",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_gbuf_range",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_gbuf_param_range_map",
            "megatron.core.distributed.param_and_grad_buffer.partition_buckets",
            "megatron.core.distributed.distributed_data_parallel.partition_buckets",
            "megatron.core.optimizer.distrib_optimizer.partition_buckets",
        ):
            assert target in patched
        assert mc_ddp.partition_buckets.__trainfast_original__ is not None
        got = run()
    finally:
        integration.unpatch()
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert got[2] == expected[2]
    assert got[3:] == expected[3:]


def build_ddp(params, *, dp, expert_dp, config, disable_bucketing=False):
    """megatron's own DistributedDataParallel around a module holding `params`, process groups faked."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(params)
    pg = ProcessGroupCollection()
    pg.dp, pg.expt_dp = FakeGroup(dp), FakeGroup(expert_dp)
    pg.dp_cp, pg.tp, pg.pp, pg.ep = pg.dp, FakeGroup(1), FakeGroup(1), FakeGroup(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of TransformerConfig's defaults
        transformer = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    return DistributedDataParallel(transformer, config, module, disable_bucketing=disable_bucketing, pg_collection=pg)


def describe_ddp(ddp):
    where = {id(bucket): (kind, i, j) for kind, buffers in (("dense", ddp.buffers), ("expert", ddp.expert_parallel_buffers))
             for i, b in enumerate(buffers) for j, bucket in enumerate(b.buckets)}
    return (
        full_tuple(ddp.full_param_layout) if ddp.full_param_layout is not None else None,
        describe_buffers(ddp.buffers), describe_buffers(ddp.expert_parallel_buffers),
        [[where[id(b)] for b in g.buckets] for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups],
        describe_ranges(ddp.buffers + ddp.expert_parallel_buffers) if ddp.ddp_config.use_distributed_optimizer else None,
    )


@pytest.mark.parametrize("seed", range(6))
def test_megatron_ddp_with_and_without_patch(seed, megatron_meta):
    """DistributedDataParallel.__init__ itself (grouping, compute_full_param_layout or the default
    layout, buffers, partition_buckets), then the optimizer's range builders, patched and not."""
    rng = random.Random(4000 + seed)
    dp, expert_dp = rng.choice([1, 2, 3, 8, 64]), rng.choice([1, 2, 8])
    distopt = seed % 3 != 2
    config_kwargs = dict(use_distributed_optimizer=distopt, overlap_grad_reduce=True,
                         bucket_size=rng.choice([None, rng.randint(1000, 50_000), 10**6]),
                         grad_reduce_in_fp32=rng.random() < 0.5,
                         pad_buckets_for_high_nccl_busbw=distopt and rng.random() < 0.3,
                         reduce_scatter_with_fp32_accumulation=distopt and seed % 2 == 1)
    model_seed = rng.random()
    disable_bucketing = seed == 4

    def run():
        # fresh params and config each time: DDP re-points param.data and edits its config
        params = random_model(random.Random(model_seed), 40, fp8=False)
        ddp = build_ddp(params, dp=dp, expert_dp=expert_dp, config=DistributedDataParallelConfig(**config_kwargs),
                        disable_bucketing=disable_bucketing)
        index_of = {id(p): i for i, p in enumerate(params)}

        def by_index(value):  # params appear by id(): name them by model position instead
            if isinstance(value, (list, tuple)):
                return type(value)(by_index(v) for v in value)
            return ("param", index_of[value]) if isinstance(value, int) and value in index_of else value

        return by_index(describe_ddp(ddp))

    calls = []
    expected = run()
    assert not calls
    integration.patch()
    try:
        with pytest.MonkeyPatch.context() as spy:
            plan_layout = buckets.plan_layout
            spy.setattr(buckets, "plan_layout", lambda *a, **k: calls.append(1) or plan_layout(*a, **k))
            got = run()
    finally:
        integration.unpatch()
    assert calls, "the patched DDP did not reach trainfast"
    assert got == expected
    assert "('param', 0)" in repr(got[1] + got[2])


def test_megatron_default_layout_buffer_with_and_without_patch(megatron_meta):
    """DDP without the distributed optimizer: _ParamAndGradBuffer computes the default layout itself."""
    rng = random.Random(7)
    params = random_model(rng, 50, fp8=False, experts=False)
    params = [p for p in params if p.dtype == params[0].dtype]
    config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    names = {p: f"p{i}" for i, p in enumerate(params)}
    pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=FakeGroup(8))

    def build():
        buffer = pgb._ParamAndGradBuffer(config, params[0].dtype, torch.float32, [(p, names[p]) for p in params],
                                         FakeGroup(8), 100_000, names, 1.0, list(range(len(params))), False,
                                         pg_collection=pg)
        return describe_buffers([buffer])

    expected = build()
    integration.patch()
    try:
        got = build()
    finally:
        integration.unpatch()
    assert got == expected


@pytest.mark.parametrize("seed", range(6))
def test_partition_buckets_with_fp8_buffer_equal_upstream(seed, megatron_meta):
    """One uint8 (fp8-storage) buffer among bf16/fp32 ones, in any position; all four flag mixes."""
    rng = random.Random(3000 + seed)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    group = FakeGroup(2)
    pg = types.SimpleNamespace(tp=FakeGroup(1), dp_cp=group)
    buffers = []
    for dtype in rng.sample([torch.bfloat16, torch.float32, torch.uint8, torch.float16], rng.randint(1, 4)):
        plist = [torch.nn.Parameter(torch.empty(rng.randint(1, 4000), dtype=dtype, device="meta"),
                                    requires_grad=dtype != torch.uint8) for _ in range(rng.randint(1, 25))]
        names = {p: f"p{i}" for i, p in enumerate(plist)}
        layout = DistributedOptimizer._compute_per_buffer_param_layout(plist, rng.choice([None, 3000, 9000]), 2,
                                                                      config)
        buffers.append(pgb._ParamAndGradBuffer(config, dtype, torch.float32, [(p, names[p]) for p in plist], group,
                                               None, names, 1.0, list(range(len(plist))), False, pg_collection=pg,
                                               param_layout=layout))
    expected = partition_membership(pgb.partition_buckets, buffers)
    assert partition_membership(buckets.partition_buckets, buffers) == expected
    # and the array API, as (buffer, bucket) pairs
    is_uint8 = [b.param_dtype == torch.uint8 for b in buffers]
    k = 0
    for force in (False, True):
        for rs_fp32 in (False, True):
            arrays = buckets.partition_bucket_indices(is_uint8, [len(b.buckets) for b in buffers],
                                                      force_single_bucket_group=force,
                                                      reduce_scatter_with_fp32_accumulation=rs_fp32)
            assert arrays.groups() == [pairs for pairs, _ in expected[k]]
            assert arrays.groups() == ref.partition(is_uint8, [len(b.buckets) for b in buffers], force, rs_fp32)
            k += 1
    integration.patch()
    try:
        assert partition_membership(pgb.partition_buckets, buffers) == expected
    finally:
        integration.unpatch()
    # two uint8 buffers: refused by both
    if any(is_uint8):
        twice = buffers + [buffers[is_uint8.index(True)]]
        with pytest.raises(AssertionError):
            pgb.partition_buckets(twice)
        with pytest.raises(UpstreamAssertionError, match="uint8"):
            buckets.partition_buckets(twice)


def patched_module_functions():
    return {
        "pgb.group_params_for_buffers": pgb.group_params_for_buffers,
        "pgb._compute_default_per_buffer_param_layout": pgb._compute_default_per_buffer_param_layout,
        "pgb.partition_buckets": pgb.partition_buckets,
        "ddp.partition_buckets": mc_ddp.partition_buckets,
        "ddp.group_params_for_buffers": mc_ddp.group_params_for_buffers,
        "distopt.partition_buckets": mc_distopt.partition_buckets,
    }


def test_unpatch_restores_the_originals():
    originals = patched_module_functions()
    class_members = {name: DistributedOptimizer.__dict__[name] for name in (
        "_compute_per_buffer_param_layout", "compute_full_param_layout", "_build_model_gbuf_range",
        "_build_model_gbuf_param_range_map")}
    integration.patch()
    try:
        assert pgb.partition_buckets is not originals["pgb.partition_buckets"]
        assert pgb.group_params_for_buffers is not originals["pgb.group_params_for_buffers"]
        assert isinstance(DistributedOptimizer.__dict__["_compute_per_buffer_param_layout"], staticmethod)
        assert isinstance(DistributedOptimizer.__dict__["_build_model_gbuf_range"], classmethod)
        for name, member in class_members.items():
            assert DistributedOptimizer.__dict__[name] is not member
    finally:
        integration.unpatch()
    current = patched_module_functions()
    assert all(current[name] is originals[name] for name in originals)
    assert all(DistributedOptimizer.__dict__[name] is member for name, member in class_members.items())
