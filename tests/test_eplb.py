"""EPLB: native == readable torch oracle (tests/reference/eplb.py), bit for bit, plus invariants."""

from __future__ import annotations

import collections
import itertools
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import eplb as ref
from trainfast import eplb
from trainfast._util import UpstreamAssertionError

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == torch.int64 and g.device.type == "cpu" and g.is_contiguous()
        assert torch.equal(g, e), f"\n{g}\n!=\n{e}"


# --- random problems -------------------------------------------------------------------------------

LOAD_KINDS = ("small_ints", "two_values", "all_equal", "all_zero", "uniform", "lognormal", "zipf", "float64")


def random_loads(rng: np.random.Generator, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    if kind == "small_ints":  # token counts with many ties
        return torch.from_numpy(rng.integers(0, 4, size=shape))
    if kind == "two_values":
        return torch.from_numpy(rng.choice([0, 10], size=shape))
    if kind == "all_equal":
        return torch.full(shape, float(rng.integers(1, 100)))
    if kind == "all_zero":
        return torch.zeros(shape, dtype=torch.int64)
    if kind == "uniform":
        return torch.from_numpy(rng.random(shape, dtype=np.float32))
    if kind == "lognormal":
        return torch.from_numpy(np.round(rng.lognormal(0, 1.5, size=shape) * 100))
    if kind == "zipf":
        return torch.from_numpy(np.minimum(rng.zipf(1.5, size=shape), 10**6))
    return torch.from_numpy(rng.random(shape) * 1e3)  # float64: upstream casts to float32


def random_problem(rng: np.random.Generator, max_layers: int = 4) -> tuple:
    num_nodes = int(rng.integers(1, 5))
    num_groups = num_nodes * int(rng.integers(1, 5))
    group_size = int(rng.integers(1, 5))
    num_logical = num_groups * group_size
    gpus_per_node = int(rng.integers(1, 5))
    num_gpus = num_nodes * gpus_per_node
    if rng.random() < 0.3 and num_nodes > 1:  # DeepSeek's global policy: groups not divisible by nodes
        num_groups = next(g for g in range(num_groups + 1, 10 * num_groups) if g % num_nodes != 0)
    num_replicas = num_gpus * (-(-num_logical // num_gpus) + int(rng.integers(0, 3)))
    kind = LOAD_KINDS[int(rng.integers(len(LOAD_KINDS)))]
    weight = random_loads(rng, kind, (int(rng.integers(1, max_layers + 1)), num_logical))
    return weight, num_replicas, num_groups, num_nodes, num_gpus


@pytest.mark.parametrize("seed", range(25))
def test_random_cases_match_oracle(seed):
    rng = np.random.default_rng(seed)
    for _ in range(80):  # 25 x 80 = 2000 cases
        args = random_problem(rng)
        assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


@pytest.mark.parametrize("seed", range(4))
def test_random_cases_stable_mode_match_stable_oracle(seed):
    rng = np.random.default_rng(1000 + seed)
    for _ in range(50):
        args = random_problem(rng)
        assert_same(eplb.rebalance_experts(*args, tie_break="stable"), ref.rebalance_experts(*args, tie_break="stable"))


@pytest.mark.parametrize("seed", range(4))
def test_many_groups_with_tied_loads_match_oracle(seed):
    # torch's unstable sort keeps input order for ties up to 16 elements and may not from 17 on:
    # only layers of 17+ groups with tied group loads test that the group order is torch's.
    rng = np.random.default_rng(2000 + seed)
    for _ in range(25):
        num_nodes = int(rng.choice([1, 2, 4]))
        num_groups = num_nodes * int(rng.integers(max(2, -(-17 // num_nodes)), 65 // num_nodes + 1))
        group_size = int(rng.integers(1, 3))
        num_gpus = num_nodes * int(rng.integers(1, 5))
        num_logical = num_groups * group_size
        num_replicas = num_gpus * (-(-num_logical // num_gpus) + int(rng.integers(0, 3)))
        weight = torch.from_numpy(rng.integers(0, 4, size=(int(rng.integers(1, 4)), num_logical)))
        args = (weight, num_replicas, num_groups, num_nodes, num_gpus)
        assert num_groups >= 17
        assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


@st.composite
def problems(draw):
    num_nodes = draw(st.integers(1, 3))
    num_groups = num_nodes * draw(st.integers(1, 3))
    group_size = draw(st.integers(1, 4))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    num_logical = num_groups * group_size
    num_replicas = num_gpus * (-(-num_logical // num_gpus) + draw(st.integers(0, 2)))
    num_layers = draw(st.integers(1, 3))
    loads = draw(st.lists(st.integers(0, 5), min_size=num_layers * num_logical, max_size=num_layers * num_logical))
    weight = torch.tensor(loads, dtype=torch.int64).reshape(num_layers, num_logical)
    # num_groups + 1 is not a multiple of num_nodes (> 1): DeepSeek's global policy.
    groups = draw(st.sampled_from([num_groups, num_groups + 1] if num_nodes > 1 else [num_groups]))
    return weight, num_replicas, groups, num_nodes, num_gpus


@given(problems())
def test_hypothesis_matches_oracle(args):
    assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, num_replicas, num_groups, num_nodes, num_gpus",
    [
        ((58, 256), 288, 8, 4, 32),  # DeepSeek-V3 prefill: hierarchical
        ((6, 256), 320, 1, 1, 64),  # decode: global over 64 GPUs
        ((3, 384), 512, 1, 1, 64),
        ((4, 256), 256, 8, 4, 32),  # no redundancy
    ],
)
@pytest.mark.parametrize("kind", ["lognormal", "small_ints", "all_equal"])
def test_deepseek_v3_scale_matches_oracle(shape, num_replicas, num_groups, num_nodes, num_gpus, kind):
    if kind != "lognormal" and shape[0] > 10:
        shape = (6, shape[1])
    weight = random_loads(np.random.default_rng(7), kind, shape)
    args = (weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


# --- the worked example ----------------------------------------------------------------------


def test_readme_example():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy.shape == (2, 12, 2)
    assert log2phy[0, 1].tolist() == [15, 13] and log2phy[0, 4].tolist() == [7, 5]
    assert_same((phy2log, log2phy, logcnt), ref.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8))


def test_input_kinds_agree():
    expected = eplb.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    for weight in (README_WEIGHT, np.array(README_WEIGHT), np.array(README_WEIGHT, dtype=np.float32),
                   torch.tensor(README_WEIGHT, dtype=torch.float64), torch.tensor(README_WEIGHT).t().contiguous().t()):
        assert_same(eplb.rebalance_experts(weight, 16, 4, 2, 8), expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("scale", [1, 2**20, 2**22, 2**23 + 1, 2**30])
def test_integer_loads_near_float32_exactness_limit(dtype, scale):
    # Group totals below and above 2^24: the native group sums (exact) and torch's (rounded) must
    # both give upstream's answer; scale 2^30 also rounds the loads themselves.
    rng = np.random.default_rng(scale)
    for _ in range(10):
        weight = torch.from_numpy(rng.integers(0, 8, size=(3, 16)) * (scale // 4) + rng.integers(0, 3, size=(3, 16)))
        weight = weight.to(dtype)
        for args in ((weight, 20, 4, 2, 4), (weight, 24, 8, 2, 8), (weight, 32, 4, 4, 8)):
            assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


def test_native_int_loads_group_sums_equal_torch():
    from trainfast import _core

    rng = np.random.default_rng(5)
    for limit in (4, 1000, 2**21, 2**22):
        loads = rng.integers(0, limit, size=(7, 32))
        weight32, sums = _core.eplb_int_loads(loads, 8)
        expected = torch.from_numpy(loads).float()
        assert torch.equal(torch.from_numpy(weight32), expected)
        if loads.reshape(7, 8, 4).sum(-1).max() <= 2**24:
            assert torch.equal(torch.from_numpy(sums), expected.unflatten(-1, (8, 4)).sum(-1))
        else:
            assert sums is None  # not exact in every order: the caller asks torch
    with pytest.raises(ValueError, match=r"weight\[1, 2\]"):
        _core.eplb_int_loads(np.array([[1, 2, 3, 4], [5, 6, -7, 8]]), 2)


def test_sglang_enable_hierarchical_argument():
    weight = torch.tensor(README_WEIGHT)
    assert_same(eplb.rebalance_experts(weight, 16, 4, 2, 8, True), eplb.rebalance_experts(weight, 16, 4, 2, 8))
    assert_same(eplb.rebalance_experts(weight, 16, 4, 2, 8, False), eplb.rebalance_experts(weight, 16, 3, 2, 8))
    # SGLang passes num_groups=None for models without expert groups; its global policy ignores it.
    for num_groups, num_nodes in [(None, 1), (0, 0), (None, None)]:
        assert_same(eplb.rebalance_experts(weight, 16, num_groups, num_nodes, 8, False),
                    eplb.rebalance_experts(weight, 16, 3, 2, 8))
        assert_same(eplb.rebalance_experts(weight, 16, num_groups, num_nodes, 8, enable_hierarchical=False),
                    ref.rebalance_experts(weight, 16, 1, 1, 8))
    with pytest.raises(TypeError, match="num_groups"):
        eplb.rebalance_experts(weight, 16, None, 1, 8)
    with pytest.raises(TypeError, match="num_groups"):
        eplb.rebalance_experts(weight, 16, None, 1, 8, True)


# --- helpers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_balanced_packing_matches_oracle(dtype):
    rng = np.random.default_rng(3)
    for _ in range(60):
        num_packs = int(rng.integers(1, 6))
        n = num_packs * int(rng.integers(1, 6))
        values = rng.integers(0, 4, size=(int(rng.integers(1, 4)), n)) if rng.random() < 0.5 else rng.random((2, n)) * 9
        weight = torch.from_numpy(values).to(dtype)
        assert_same(eplb.balanced_packing(weight, num_packs), ref.balanced_packing(weight, num_packs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_replicate_experts_matches_oracle(dtype):
    rng = np.random.default_rng(4)
    for _ in range(60):
        num_log = int(rng.integers(1, 9))
        num_phy = num_log + int(rng.integers(0, 12))
        values = rng.integers(0, 5, size=(3, num_log)) if rng.random() < 0.5 else rng.random((3, num_log)) * 7
        weight = torch.from_numpy(values).to(dtype)
        assert_same(eplb.replicate_experts(weight, num_phy), ref.replicate_experts(weight, num_phy))


@pytest.mark.parametrize("shape, num_packs", [((0, 4), 2), ((0, 4), 4), ((3, 0), 2), ((0, 0), 3)])
def test_balanced_packing_of_an_empty_weight_is_empty_as_upstream(shape, num_packs):
    # Upstream's loop has nothing to place and returns its empty tables; a patched module must too.
    weight = torch.zeros(shape)
    assert_same(eplb.balanced_packing(weight, num_packs), ref.balanced_packing(weight, num_packs))


@pytest.mark.parametrize("shape, num_phy", [((0, 4), 4), ((0, 4), 9), ((0, 0), 3)])
def test_replicate_experts_of_no_rows_is_empty_as_upstream(shape, num_phy):
    weight = torch.zeros(shape)
    assert_same(eplb.replicate_experts(weight, num_phy), ref.replicate_experts(weight, num_phy))


def test_replicate_experts_needs_an_expert_to_replicate():
    with pytest.raises(AssertionError, match=r"weight .*\(2, 0\)"):
        eplb.replicate_experts(torch.zeros(2, 0), 3)


def test_replicate_experts_large_int_loads_divide_in_float32():
    weight = torch.tensor([[2**40 + 1, 2**40, 3 * 2**39]])
    assert_same(eplb.replicate_experts(weight, 7), ref.replicate_experts(weight, 7))


def test_rebalance_experts_hierarchical_matches_oracle():
    rng = np.random.default_rng(5)
    for _ in range(100):
        weight, num_replicas, num_groups, num_nodes, num_gpus = random_problem(rng)
        if num_groups % num_nodes:
            continue
        weight = weight.float()
        assert_same(eplb.rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus),
                    ref.rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus))


def test_helpers_reject_half_precision():
    with pytest.raises(TypeError, match="weight"):
        eplb.balanced_packing(torch.ones(2, 4, dtype=torch.float16), 2)
    with pytest.raises(TypeError, match="weight"):
        eplb.rebalance_experts_hierarchical(torch.ones(2, 4, dtype=torch.float64), 4, 2, 1, 2)


# --- invariants ------------------------------------------------------------------------------------------


def check_invariants(weight, outputs, num_replicas, num_groups, num_nodes, num_gpus, hierarchical):
    phy2log, log2phy, logcnt = outputs
    num_layers, num_logical = weight.shape
    assert phy2log.shape == (num_layers, num_replicas) and logcnt.shape == (num_layers, num_logical)
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == num_replicas).all()
    assert log2phy.shape == (num_layers, num_logical, int(logcnt.max()))
    for layer in range(num_layers):
        counts = torch.bincount(phy2log[layer], minlength=num_logical)
        assert torch.equal(counts, logcnt[layer])
        for expert in range(num_logical):
            slots = log2phy[layer, expert]
            live = slots[: int(logcnt[layer, expert])]
            assert (slots[int(logcnt[layer, expert]):] == -1).all()
            assert sorted(live.tolist()) == sorted(torch.nonzero(phy2log[layer] == expert).flatten().tolist())
        if hierarchical:  # every group lives on one node
            slots_per_node = num_replicas // num_nodes
            group_size = num_logical // num_groups
            node_of_slot = torch.arange(num_replicas) // slots_per_node
            for group in range(num_groups):
                members = (phy2log[layer] // group_size) == group
                assert node_of_slot[members].unique().numel() == 1


@pytest.mark.parametrize("mode", ["torch", "stable", "refine", "avoid", "refine+avoid"])
def test_invariants_all_modes(mode):
    rng = np.random.default_rng(11)
    for _ in range(120):
        weight, num_replicas, num_groups, num_nodes, num_gpus = random_problem(rng)
        outputs = eplb.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus, tie_break="stable" if mode == "stable" else "torch",
            refine="refine" in mode, avoid_gpu_duplicates="avoid" in mode)
        hierarchical = num_groups % num_nodes == 0
        check_invariants(weight, outputs, num_replicas, num_groups, num_nodes, num_gpus, hierarchical)


def test_refine_never_worse_and_keeps_replication():
    rng = np.random.default_rng(12)
    for _ in range(150):
        weight, num_replicas, num_groups, num_nodes, num_gpus = random_problem(rng)
        base = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
        refined = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, refine=True)
        assert torch.equal(base[2], refined[2])
        before = eplb.gpu_loads(weight, base[0], base[2], num_gpus).max(-1)
        after = eplb.gpu_loads(weight, refined[0], refined[2], num_gpus).max(-1)
        assert (after <= before + 1e-9 * np.maximum(before, 1)).all()


def test_refine_improves_skewed_loads():
    weight = torch.from_numpy(np.random.default_rng(0).lognormal(0, 1, size=(8, 256)).astype(np.float32))
    base = eplb.rebalance_experts(weight, 320, 1, 1, 64)
    refined = eplb.rebalance_experts(weight, 320, 1, 1, 64, refine=True)
    assert eplb.balancedness(weight, refined[0], refined[2], 64) < eplb.balancedness(weight, base[0], base[2], 64)


def duplicates_per_gpu(phy2log, num_gpus):
    per_gpu = phy2log.reshape(phy2log.shape[0], num_gpus, -1)
    return sum(len(row) - len(set(row)) for layer in per_gpu.tolist() for row in layer)


def test_avoid_gpu_duplicates():
    weight = torch.tensor([[100.0, 100, 1, 1, 1, 1, 1, 1]])  # experts 0 and 1: 5 replicas each, 8 GPUs
    base = eplb.rebalance_experts(weight, 16, 1, 1, 8)
    assert duplicates_per_gpu(base[0], 8) > 0  # upstream stacks replicas of expert 0
    avoided = eplb.rebalance_experts(weight, 16, 1, 1, 8, avoid_gpu_duplicates=True)
    assert duplicates_per_gpu(avoided[0], 8) == 0
    assert torch.equal(base[2], avoided[2])


@pytest.mark.parametrize("refine", [False, True])
def test_avoid_gpu_duplicates_random_feasible_cases(refine):
    rng = np.random.default_rng(21)
    checked = 0
    for _ in range(300):
        weight, num_replicas, num_groups, num_nodes, num_gpus = random_problem(rng, max_layers=3)
        nodes = num_nodes if num_groups % num_nodes == 0 else 1
        placed = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus,
                                        avoid_gpu_duplicates=True, refine=refine)
        if int(placed[2].max()) <= num_gpus // nodes:  # feasible: replicas can sit on distinct GPUs
            assert duplicates_per_gpu(placed[0], num_gpus) == 0
            checked += 1
    assert checked > 100


def test_previous_phy2log_keeps_slots():
    rng = np.random.default_rng(13)
    weight = torch.from_numpy(rng.lognormal(0, 1, size=(4, 64)).astype(np.float32))
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 96, 8, 2, 16)
    # The same answer as previous placement: nothing moves.
    again = eplb.rebalance_experts(weight, 96, 8, 2, 16, previous_phy2log=phy2log)
    assert_same(again, (phy2log, log2phy, logcnt))
    # Previous placement = each GPU's slots reversed: all experts keep their previous slot.
    previous = phy2log.reshape(4, 16, 6).flip(-1).reshape(4, 96)
    kept = eplb.rebalance_experts(weight, 96, 8, 2, 16, previous_phy2log=previous)
    assert torch.equal(kept[0], previous) and eplb.count_moved(previous, kept[0]) == 0
    check_invariants(weight, kept, 96, 8, 2, 16, True)
    # Previous placement = the GPUs of each node in another order (8 GPUs per node): nothing moves.
    gpu_order = torch.tensor([1, 0, 3, 2, 7, 6, 5, 4, 9, 8, 15, 10, 11, 12, 13, 14])
    permuted = phy2log.reshape(4, 16, 6)[:, gpu_order].reshape(4, 96)
    relabeled = eplb.rebalance_experts(weight, 96, 8, 2, 16, previous_phy2log=permuted)
    assert torch.equal(relabeled[0], permuted)
    check_invariants(weight, relabeled, 96, 8, 2, 16, True)
    # Drifted loads: fewer moves than ignoring the previous placement.
    drifted = weight * torch.from_numpy(rng.uniform(0.8, 1.25, size=weight.shape).astype(np.float32))
    fresh = eplb.rebalance_experts(drifted, 96, 8, 2, 16)
    minimal = eplb.rebalance_experts(drifted, 96, 8, 2, 16, previous_phy2log=previous)
    assert eplb.count_moved(previous, minimal[0]) <= eplb.count_moved(previous, fresh[0])
    check_invariants(drifted, minimal, 96, 8, 2, 16, True)
    # ... and the fresh plan for the new loads, only relabelled within each node: the same replica
    # counts, and each node's GPUs hold the same sets of experts (so the same loads).
    assert torch.equal(minimal[2], fresh[2])

    def gpu_contents_per_node(phy2log):
        per_gpu = phy2log.reshape(4, 2, 8, 6).tolist()  # [layer, node, gpu in node, slot]
        return [[sorted(tuple(sorted(gpu)) for gpu in node) for node in layer] for layer in per_gpu]

    assert gpu_contents_per_node(minimal[0]) == gpu_contents_per_node(fresh[0])
    assert gpu_contents_per_node(minimal[0]) != gpu_contents_per_node(previous)  # the loads did move it


def _fewest_moves_by_relabelling(previous, fresh, num_nodes, num_gpus):
    """Brute force: the fewest slots that change expert over every permutation of the GPUs inside
    each node of ``fresh`` (each GPU's slots then ordered to keep the most experts in place)."""
    gpus_per_node = num_gpus // num_nodes
    moved = 0
    for old_layer, new_layer in zip(previous.tolist(), fresh.tolist()):
        slots_per_gpu = len(new_layer) // num_gpus
        old_gpus = [old_layer[g * slots_per_gpu:(g + 1) * slots_per_gpu] for g in range(num_gpus)]
        new_gpus = [new_layer[g * slots_per_gpu:(g + 1) * slots_per_gpu] for g in range(num_gpus)]

        def kept(new_gpu, old_gpu):
            return sum((collections.Counter(new_gpu) & collections.Counter(old_gpu)).values())

        for first in range(0, num_gpus, gpus_per_node):
            node = range(first, first + gpus_per_node)
            best = max(sum(kept(new_gpus[g], old_gpus[h]) for g, h in zip(node, order))
                       for order in itertools.permutations(node))
            moved += gpus_per_node * slots_per_gpu - best
    return moved


def test_previous_phy2log_moves_the_fewest_experts():
    # Found by mutation testing: a greedy GPU matching moved 6 slots here, where 5 suffice.
    weight = torch.tensor([[0.0, 9, 8, 9]])
    previous = torch.tensor([[-1, -1, -1, 0, 3, 3, -1, 2]])
    phy2log, _, _ = eplb.rebalance_experts(weight, 8, 1, 1, 2, tie_break="stable", previous_phy2log=previous)
    assert phy2log.tolist() == [[3, 2, 1, 0, 3, 1, 1, 2]] and eplb.count_moved(previous, phy2log) == 5
    rng = np.random.default_rng(21)
    for _ in range(300):
        num_nodes = int(rng.choice([1, 2]))
        num_gpus = num_nodes * int(rng.integers(1, 5))
        num_logical = int(rng.integers(1, 7)) * num_nodes
        num_replicas = num_gpus * int(rng.integers(1, 4))
        if num_replicas < num_logical:
            num_replicas = num_gpus * -(-num_logical // num_gpus)
        weight = torch.from_numpy(rng.integers(0, 10, size=(2, num_logical)).astype(np.float32))
        # Previous placements near the fresh one (a few slots changed) and random ones, empty slots included.
        fresh = eplb.rebalance_experts(weight, num_replicas, num_nodes, num_nodes, num_gpus, tie_break="stable")
        previous = fresh[0].numpy().copy()
        if rng.random() < 0.5:
            previous = rng.integers(-1, num_logical, size=previous.shape)
        else:
            previous[rng.random(previous.shape) < 0.3] = -1
            previous = previous.reshape(2, num_gpus, -1)[:, rng.permutation(num_gpus)].reshape(2, -1)
        previous = torch.from_numpy(previous)
        minimal = eplb.rebalance_experts(weight, num_replicas, num_nodes, num_nodes, num_gpus, tie_break="stable",
                                         previous_phy2log=previous)
        assert eplb.count_moved(previous, minimal[0]) == _fewest_moves_by_relabelling(
            previous, fresh[0], num_nodes, num_gpus)
        assert torch.equal(minimal[2], fresh[2])
        check_invariants(weight, minimal, num_replicas, num_nodes, num_nodes, num_gpus, True)


def test_slot_order_equals_the_plain_loop():
    # Each GPU's slots ordered as the oracle's loop does it: entries of one expert take that expert's
    # previous slots in order; repeated experts, empty (-1) and out-of-range previous ids included.
    rng = np.random.default_rng(8)
    for _ in range(300):
        num_layers, num_gpus = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        slots_per_gpu, num_logical = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        shape = (num_layers, num_gpus * slots_per_gpu)
        phy2log = rng.integers(0, num_logical, size=shape)
        phyrank = rng.integers(0, 4, size=shape)
        previous = rng.integers(-2, num_logical + 2, size=shape)
        targets = np.stack([rng.permutation(num_gpus) for _ in range(num_layers)])
        got = eplb._order_slots(previous, phy2log, phyrank, targets, slots_per_gpu, num_logical)
        expected = ref.order_slots(previous.tolist(), phy2log.tolist(), phyrank.tolist(), targets.tolist(),
                                   slots_per_gpu)
        assert [got[0].tolist(), got[1].tolist()] == list(expected)


def test_gpu_matching_is_a_best_assignment():
    from trainfast import _core

    rng = np.random.default_rng(5)
    matrices = []
    for _ in range(500):
        size = int(rng.integers(0, 7))
        matrices.append(rng.integers(0, int(rng.choice([1, 2, 5, 100])), size=(size, size)).astype(np.int64))
    for weight in matrices:
        (assignment,) = _core.eplb_max_weight_assignment(weight[None], 1).tolist()
        assert assignment == ref.max_weight_assignment(weight.tolist())  # same ties too
        best = max((sum(weight[i, order[i]] for i in range(len(weight))) for order in
                    itertools.permutations(range(len(weight)))), default=0)
        assert sum(weight[i, assignment[i]] for i in range(len(weight))) == best
    # Many matrices at once, on any number of threads.
    batch = rng.integers(0, 50, size=(64, 12, 12)).astype(np.int64)
    expected = [ref.max_weight_assignment(weight) for weight in batch.tolist()]
    for num_threads in (1, 2, 5):
        assert _core.eplb_max_weight_assignment(batch, num_threads).tolist() == expected


def test_gpu_matching_rejects_bad_weights():
    from trainfast import _core

    with pytest.raises(ValueError, match=r"weight must have shape \[num_matrices, n, n\] \(got shape \(2, 3, 4\)\)"):
        _core.eplb_max_weight_assignment(np.zeros((2, 3, 4), dtype=np.int64), 1)
    with pytest.raises(ValueError, match=r"weight must be in \[0, 2\^40\) \(got -1\)"):
        _core.eplb_max_weight_assignment(np.full((1, 2, 2), -1, dtype=np.int64), 1)
    with pytest.raises(ValueError, match="weight"):
        _core.eplb_max_weight_assignment(np.full((1, 2, 2), 2**40, dtype=np.int64), 1)
    with pytest.raises(TypeError):
        _core.eplb_max_weight_assignment(np.zeros((1, 2, 2), dtype=np.int32), 1)


# Pinned answers of the opt-in modes (no upstream to compare with), each found by mutation testing:
# the rule named in the comment changes it.


def test_avoid_gpu_duplicates_fallback_takes_the_lowest_lightest_gpu():
    # When every non-full GPU already holds the expert, the lightest one wins, ties to the lowest index.
    weight = torch.tensor([[4, 2, 4, 2, 2, 8], [4, 3, 2, 3, 0, 8]], dtype=torch.float32)
    phy2log, _, _ = eplb.rebalance_experts(weight, 10, 1, 1, 2, tie_break="stable", avoid_gpu_duplicates=True)
    assert phy2log.tolist() == [[5, 5, 2, 4, 0, 5, 0, 1, 3, 2], [3, 5, 2, 0, 1, 5, 5, 0, 1, 4]]


def test_avoid_gpu_duplicates_accumulates_gpu_loads_in_float32():
    # Past 2^24 float32 sums round (2^25 + 3 loads as 2^25 + 4): the greedy compares those sums,
    # as upstream's float32 tensors do, not exact double ones.
    weight = torch.tensor([[0, 2, 2**25, 2**25 + 3, 2**25 + 2, 2, 2, 2**25 + 8]], dtype=torch.float32)
    phy2log, _, _ = eplb.rebalance_experts(weight, 10, 1, 1, 2, tie_break="stable", avoid_gpu_duplicates=True)
    assert phy2log.tolist() == [[2, 7, 3, 1, 5, 4, 7, 3, 6, 0]]


def test_refine_swaps_only_for_a_real_gain():
    # Loads near 3e10, where float32 steps are 2048: a swap must lower the pair's maximum by more
    # than a relative 1e-9, or the refinement would trade places for rounding noise.
    weight = torch.tensor([[3e10, 3e10, 3e10, 3e10, 3e10 + 2, 3], [3e10 + 256, 3e10, 3, 5, 5, 3e10 + 192]])
    phy2log, _, _ = eplb.rebalance_experts(weight, 8, 1, 1, 2, tie_break="stable", refine=True)
    assert phy2log.tolist() == [[2, 4, 0, 5, 3, 0, 1, 1], [5, 0, 3, 4, 0, 1, 1, 2]]


def test_stable_tie_break_treats_negative_zero_as_zero():
    weight = torch.tensor([[-0.0, 0.0, 5, 5], [0.0, -0.0, 1, 1]])
    phy2log, _, _ = eplb.rebalance_experts(weight, 4, 1, 1, 2, tie_break="stable")
    assert phy2log.tolist() == [[2, 0, 3, 1], [2, 0, 3, 1]]
    same = eplb.rebalance_experts(weight.abs(), 4, 1, 1, 2, tie_break="stable")[0]
    assert torch.equal(phy2log, same)


def test_thread_count_does_not_change_result():
    weight = random_loads(np.random.default_rng(2), "small_ints", (64, 256))
    for mode in ({}, {"tie_break": "stable"}, {"refine": True}):
        one = eplb.rebalance_experts(weight, 320, 8, 4, 64, num_threads=1, **mode)
        assert_same(eplb.rebalance_experts(weight, 320, 8, 4, 64, num_threads=3, **mode), one)


# --- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight, args, name",
    [
        (torch.ones(12), (16, 4, 2, 8), "weight"),
        (torch.ones(2, 3, 4), (16, 4, 2, 8), "weight"),
        (torch.ones(0, 12), (16, 4, 2, 8), "weight"),
        (torch.ones(2, 0), (16, 4, 2, 8), "weight"),
        (torch.ones(2, 12), (8, 4, 2, 8), "num_replicas"),
        (torch.ones(2, 12), (18, 4, 2, 8), "num_replicas"),
        (torch.ones(2, 12), (20, 4, 1, 8), "num_replicas"),
        (torch.ones(2, 12), (16, 5, 1, 8), "num_groups"),
        (torch.ones(2, 12), (14, 4, 2, 7), "num_gpus"),
        (torch.ones(2, 12), (16, 0, 2, 8), "num_groups"),
        (torch.ones(2, 12), (16, 4, 0, 8), "num_nodes"),
        (torch.ones(2, 12), (16, 4, 2, 0), "num_gpus"),
        (torch.ones(2, 12), (0, 4, 2, 8), "num_replicas"),
        (torch.ones(2, 12), (-16, 4, 2, 8), "num_replicas"),
        (torch.ones(2, 12), (16, -4, 2, 8), "num_groups"),
    ],
)
def test_bad_arguments_raise_upstream_assertion(weight, args, name):
    with pytest.raises(UpstreamAssertionError, match=name) as info:
        eplb.rebalance_experts(weight, *args)
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e39])
def test_bad_loads_name_layer_and_expert(bad):
    weight = torch.ones(3, 12, dtype=torch.float64)
    weight[1, 7] = bad
    with pytest.raises(ValueError, match=r"layer 1, expert 7"):
        eplb.rebalance_experts(weight, 16, 4, 2, 8)
    with pytest.raises(ValueError, match=r"layer 1, expert 7"):
        eplb.rebalance_experts(weight, 16, 4, 2, 8, tie_break="stable")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_negative_integer_loads_name_layer_and_expert(dtype):
    weight = torch.ones(3, 12, dtype=dtype)
    weight[2, 5] = -3
    for tie_break in ("torch", "stable"):
        with pytest.raises(ValueError, match=r"layer 2, expert 5"):
            eplb.rebalance_experts(weight, 16, 4, 2, 8, tie_break=tie_break)


def test_bad_types():
    with pytest.raises(TypeError, match="num_replicas"):
        eplb.rebalance_experts(torch.ones(2, 12), 16.0, 4, 2, 8)
    with pytest.raises(ValueError, match=r"num_replicas must be < 2\^62"):
        eplb.rebalance_experts(torch.ones(2, 12), 2**70, 4, 2, 8)
    with pytest.raises(TypeError, match="weight"):
        eplb.rebalance_experts("weights", 16, 4, 2, 8)
    with pytest.raises(ValueError, match="tie_break"):
        eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8, tie_break="random")
    with pytest.raises(ValueError, match="previous_phy2log"):
        eplb.rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8, previous_phy2log=torch.zeros(2, 15, dtype=torch.int64))


def test_helpers_reject_nan():
    weight = torch.ones(2, 6)
    weight[1, 4] = float("nan")
    with pytest.raises(ValueError, match="layer 1, expert 4"):
        eplb.balanced_packing(weight, 2)
    with pytest.raises(ValueError, match="layer 1, expert 4"):
        eplb.replicate_experts(weight, 8)


def test_helper_bad_arguments():
    with pytest.raises(AssertionError, match="num_packs"):
        eplb.balanced_packing(torch.ones(2, 6), 4)
    with pytest.raises(AssertionError, match="num_phy"):
        eplb.replicate_experts(torch.ones(2, 6), 4)
    with pytest.raises(AssertionError, match="num_gpus"):
        eplb.rebalance_experts_hierarchical(torch.ones(2, 12), 16, 4, 2, 7)


def test_native_rejects_bad_orders():
    from trainfast import _core

    weight = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="order"):
        _core.eplb_balanced_packing(weight, np.zeros((2, 4), dtype=np.int64), 2, 1)
    with pytest.raises(ValueError, match="order"):
        _core.eplb_balanced_packing(weight, np.full((2, 4), 9, dtype=np.int64), 2, 1)


@pytest.mark.parametrize("avoid_gpu_duplicates", [False, True])
@pytest.mark.parametrize("bad", ["duplicate", "out_of_range", "negative", "short"])
def test_native_stages_reject_bad_orders(bad, avoid_gpu_duplicates):
    from trainfast import _core

    weight = np.asarray(README_WEIGHT, dtype=np.float32)
    loads = weight.reshape(2, 4, 3).sum(-1)
    good_groups = np.argsort(-loads, axis=-1, kind="stable").astype(np.int64)
    replication = _core.eplb_replicate(weight, 16, 4, 2, 8, loads, good_groups, 1)
    good = np.argsort(-replication.replica_loads, axis=-1, kind="stable").astype(np.int64)

    def spoil(order):
        order = order.copy()
        if bad == "duplicate":
            order[-1, 1] = order[-1, 0]
        elif bad == "out_of_range":
            order[-1, -1] = order.shape[1]
        elif bad == "negative":
            order[0, 0] = -1
        else:
            return order[:, :-1].copy()
        return order

    with pytest.raises(ValueError, match="replica_order"):
        _core.eplb_place(replication, spoil(good), False, avoid_gpu_duplicates, 1)
    with pytest.raises(ValueError, match="group_order"):
        _core.eplb_replicate(weight, 16, 4, 2, 8, loads, spoil(good_groups), 1)
    # The untouched orders still work: nothing was left half-done by the failures.
    phy2log, log2phy, logcnt, _ = _core.eplb_place(replication, good, False, avoid_gpu_duplicates, 1)
    assert int(logcnt.sum()) == 32 and (phy2log >= 0).all()


@pytest.mark.parametrize("refine", [False, True])
def test_bad_replica_order_error_names_the_first_bad_row_for_any_thread_count(refine):
    # Bad rows in every worker's share, each with its own value; the first bad row's must win.
    from trainfast import _core

    # Large enough that 4+ threads take part (each thread gets at least 16384 slots of work).
    weight = np.random.default_rng(0).random((512, 64), dtype=np.float32)
    loads = weight.reshape(512, 8, 8).sum(-1)
    groups = np.argsort(-loads, axis=-1, kind="stable").astype(np.int64)
    replication = _core.eplb_replicate(weight, 128, 8, 2, 8, loads, groups, 1)
    order = np.argsort(-replication.replica_loads, axis=-1, kind="stable").astype(np.int64)
    width = order.shape[1]
    for row in range(40, order.shape[0]):
        order[row, -1] = width + row
    for num_threads in (1, 2, 3, 7, 16):
        with pytest.raises(ValueError, match=rf"replica_order.*\(got {width + 40}\)"):
            _core.eplb_place(replication, order, refine, False, num_threads)


def test_bad_group_order_error_names_the_first_bad_layer_for_any_thread_count():
    from trainfast import _core

    weight = np.random.default_rng(1).random((512, 64), dtype=np.float32)
    loads = weight.reshape(512, 8, 8).sum(-1)
    groups = np.argsort(-loads, axis=-1, kind="stable").astype(np.int64)
    for layer in range(40, groups.shape[0]):
        groups[layer, 0] = groups[layer, 1] if layer % 2 else 8 + layer
    for num_threads in (1, 2, 3, 7, 16):
        with pytest.raises(ValueError, match=r"group_order.*\(got 48\)"):
            _core.eplb_replicate(weight, 128, 8, 2, 8, loads, groups, num_threads)


def test_replica_loads_is_a_copy():
    # eplb_place reads these loads without the GIL: writes through a view could race with it.
    from trainfast import _core

    weight = np.asarray(README_WEIGHT, dtype=np.float32)
    loads = weight.reshape(2, 4, 3).sum(-1)
    groups = np.argsort(-loads, axis=-1, kind="stable").astype(np.int64)
    replication = _core.eplb_replicate(weight, 16, 4, 2, 8, loads, groups, 1)
    expected = _core.eplb_place(replication, np.empty(0, dtype=np.int64), False, False, 1)
    copy = replication.replica_loads
    before = copy.copy()
    copy[:] = np.arange(copy.size, dtype=np.float32).reshape(copy.shape)
    np.testing.assert_array_equal(replication.replica_loads, before)
    for got, want in zip(_core.eplb_place(replication, np.empty(0, dtype=np.int64), False, False, 1), expected):
        np.testing.assert_array_equal(got, want)


# --- integration -----------------------------------------------------------------------------------------


def test_patch_module_with_deepseek_api():
    from trainfast.integrations import eplb as integration

    module = types.ModuleType("user_eplb")
    for name in ("balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts"):
        setattr(module, name, getattr(ref, name))
    weight = torch.tensor(README_WEIGHT)
    expected = module.rebalance_experts(weight, 16, 4, 2, 8)
    patched = integration.patch(module)
    try:
        assert "user_eplb.rebalance_experts" in patched
        assert module.rebalance_experts is not ref.rebalance_experts
        assert_same(module.rebalance_experts(weight, 16, 4, 2, 8), expected)
        assert_same(module.balanced_packing(weight, 2), ref.balanced_packing(weight, 2))
        assert integration.is_patched(module)
    finally:
        integration.unpatch(module)
    assert module.rebalance_experts is ref.rebalance_experts and not integration.is_patched(module)


def test_patch_refuses_a_module_without_the_api():
    from trainfast.integrations import eplb as integration

    module = types.ModuleType("not_eplb")
    module.balanced_packing = ref.balanced_packing  # a helper alone is not DeepSeek's API
    with pytest.raises(ValueError, match="module 'not_eplb' has no rebalance_experts"):
        integration.patch(module)
    assert module.balanced_packing is ref.balanced_packing and not integration.is_patched(module)


def _fixed_width_rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """DeepSeek's algorithm with log2phy as vLLM's copy sizes it: num_replicas - num_logical + 1."""
    phy2log, log2phy, logcnt = ref.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    width = num_replicas - weight.shape[1] + 1
    return phy2log, torch.nn.functional.pad(log2phy, (0, width - log2phy.shape[2]), value=-1), logcnt


def _sglang_style_rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, enable_hierarchical):
    """SGLang's signature: enable_hierarchical is required and picks the policy."""
    if enable_hierarchical:
        return ref.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    return ref.rebalance_experts(weight, num_replicas, 1, 1, num_gpus)


@pytest.mark.parametrize("variant", ["fixed_width", "sglang"])
def test_patch_keeps_each_copys_log2phy_width_and_signature(variant):
    from trainfast.integrations import eplb as integration

    original = _fixed_width_rebalance_experts if variant == "fixed_width" else _sglang_style_rebalance_experts
    module = types.ModuleType(f"{variant}_eplb")
    module.rebalance_experts = original
    assert integration.patch(module) == [f"{variant}_eplb.rebalance_experts"]
    try:
        assert module.rebalance_experts is not original
        rng = np.random.default_rng(31)
        for _ in range(40):
            args = random_problem(rng)
            extra = () if variant == "fixed_width" else (args[2] % args[3] == 0,)
            assert_same(module.rebalance_experts(*args, *extra), original(*args, *extra))
    finally:
        integration.unpatch(module)


def test_patch_leaves_a_different_algorithm_alone(caplog):
    from trainfast.integrations import eplb as integration

    def reversed_slots(weight, num_replicas, num_groups, num_nodes, num_gpus):  # same API, another answer
        phy2log, log2phy, logcnt = ref.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
        return phy2log.flip(-1), num_replicas - 1 - log2phy, logcnt

    module = types.ModuleType("other_eplb")
    module.rebalance_experts = reversed_slots
    module.balanced_packing = ref.balanced_packing
    with caplog.at_level("WARNING", logger="trainfast.integrations.eplb"):
        patched = integration.patch(module)
    try:  # the helper agrees, but rebalance_experts calls it: the whole module stays as it was
        assert patched == [] and not integration.is_patched(module)
        assert module.rebalance_experts is reversed_slots and module.balanced_packing is ref.balanced_packing
        assert "other_eplb left as it is: rebalance_experts's answer to a probe differs" in caplog.text
    finally:
        integration.unpatch(module)


def _other_tie_order_balanced_packing(weight, num_packs):
    """DeepSeek's packing rule with tied loads taken last index first (vLLM's copy sorts with NumPy,
    whose order among ties is its own): the same answer wherever loads differ."""
    num_layers, num_groups = weight.shape
    groups_per_pack = num_groups // num_packs
    pack_index = torch.full_like(weight, -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for layer in range(num_layers):
        loads, counts = [0.0] * num_packs, [0] * num_packs
        row = weight[layer].tolist()
        for group in sorted(range(num_groups), key=lambda g: (-row[g], -g)):
            pack = min((p for p in range(num_packs) if counts[p] < groups_per_pack), key=loads.__getitem__)
            pack_index[layer, group], rank_in_pack[layer, group] = pack, counts[pack]
            loads[pack] += float(weight[layer, group])
            counts[pack] += 1
    return pack_index, rank_in_pack


def test_patch_leaves_a_copy_with_another_tie_order_alone(caplog):
    from trainfast.integrations import eplb as integration

    module = types.ModuleType("other_order_eplb")
    module.balanced_packing = _other_tie_order_balanced_packing
    untied = torch.tensor(README_WEIGHT, dtype=torch.float32)
    assert_same(module.balanced_packing(untied, 4), ref.balanced_packing(untied, 4))  # differs on ties only
    module.rebalance_experts = ref.rebalance_experts
    with caplog.at_level("WARNING", logger="trainfast.integrations.eplb"):
        assert integration.patch(module) == []
    assert module.balanced_packing is _other_tie_order_balanced_packing and not integration.is_patched(module)
    assert "balanced_packing's answer to a probe differs" in caplog.text


def _recording_module(calls):
    """A module with DeepSeek's API whose functions (the oracle's) note each call."""
    from trainfast.integrations import eplb as integration

    module = types.ModuleType("user_eplb")
    for name in integration.FUNCTIONS:
        def function(*args, _function=getattr(ref, name), _name=name, **kwargs):
            calls.append(_name)
            return _function(*args, **kwargs)

        function.__name__ = function.__qualname__ = name
        setattr(module, name, function)
    return module


_GENERATOR_SEED = 5


def _weight(kind):
    generator = torch.Generator().manual_seed(_GENERATOR_SEED)
    if kind == "bool":
        return torch.randint(0, 2, (3, 8), generator=generator).bool()
    if kind == "int32 overflowing pack sums":  # 8 loads of ~2^28.5 per row: sums pass 2^31
        return torch.randint(2**28, 2**29, (3, 8), generator=generator, dtype=torch.int32)
    return (torch.rand(3, 8, generator=generator) * 4).to(getattr(torch, kind))


@pytest.mark.parametrize("kind, upstream_runs", [
    ("float16", {"balanced_packing", "replicate_experts", "rebalance_experts_hierarchical"}),
    ("bfloat16", {"balanced_packing", "replicate_experts", "rebalance_experts_hierarchical"}),
    ("bool", {"balanced_packing", "replicate_experts", "rebalance_experts_hierarchical"}),
    ("int32 overflowing pack sums", {"balanced_packing", "rebalance_experts_hierarchical"}),
    ("float64", {"rebalance_experts_hierarchical"}),
    ("float32", set()),
])
def test_patched_functions_answer_as_upstream_for_every_dtype(kind, upstream_runs):
    # Upstream computes in the weight's own dtype where trainfast.eplb refuses it or sums in int64;
    # patched, the module must still answer as upstream does: its own function runs for those.
    from trainfast.integrations import eplb as integration

    calls = []
    module = _recording_module(calls)
    weight = _weight(kind)
    expected = {"balanced_packing": ref.balanced_packing(weight, 2), "replicate_experts": ref.replicate_experts(weight, 12),
                "rebalance_experts_hierarchical": ref.rebalance_experts_hierarchical(weight, 16, 4, 2, 8)}
    integration.patch(module)
    assert sorted(set(calls)) == sorted(integration.FUNCTIONS)  # patch's probes of the module's own functions
    calls.clear()
    try:
        assert_same(module.balanced_packing(weight=weight, num_packs=2), expected["balanced_packing"])
        assert_same(module.replicate_experts(weight, 12), expected["replicate_experts"])
        assert_same(module.rebalance_experts_hierarchical(weight, 16, 4, 2, 8), expected["rebalance_experts_hierarchical"])
    finally:
        integration.unpatch(module)
    assert set(calls) == upstream_runs


def test_patch_follows_the_module_not_its_name():
    from trainfast.integrations import eplb as integration

    def user_module():
        module = types.ModuleType("user_eplb")
        for name in ("balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts"):
            setattr(module, name, getattr(ref, name))
        return module

    first, second = user_module(), user_module()  # two modules, one name
    try:
        integration.patch(first)
        integration.patch(second)
        assert second.rebalance_experts is not ref.rebalance_experts and integration.is_patched(second)
        for name in integration.FUNCTIONS:  # as importlib.reload does: new copies of upstream's functions
            function = getattr(ref, name)
            copy = types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__)
            copy.__qualname__, copy.__kwdefaults__ = function.__qualname__, function.__kwdefaults__
            setattr(second, name, copy)
        assert not integration.is_patched(second)
        integration.patch(second)
        assert second.rebalance_experts is not ref.rebalance_experts
        integration.unpatch(first)
        assert first.rebalance_experts is ref.rebalance_experts and integration.is_patched(second)
    finally:
        integration.unpatch()
    assert second.rebalance_experts.__code__ is ref.rebalance_experts.__code__ and not integration.is_patched()


# --- torch.library custom op -------------------------------------------------------------------------------


def test_custom_op_matches_and_passes_opcheck():
    weight = torch.tensor(README_WEIGHT, dtype=torch.float32)
    op = torch.ops.trainfast.rebalance_experts
    assert_same(op(weight, 16, 4, 2, 8), eplb.rebalance_experts(weight, 16, 4, 2, 8))
    result = torch.library.opcheck(op.default, (weight, 16, 4, 2, 8))
    assert all(value == "SUCCESS" for value in result.values()), result


def test_custom_op_under_torch_compile():
    weight = torch.tensor(README_WEIGHT, dtype=torch.float32)
    compiled = torch.compile(lambda w: torch.ops.trainfast.rebalance_experts(w, 16, 4, 2, 8), fullgraph=True,
                             backend="aot_eager")
    assert_same(compiled(weight), eplb.rebalance_experts(weight, 16, 4, 2, 8))


# --- CLI -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".pt"])
def test_cli_reads_loads_files(tmp_path, suffix, capsys):
    from trainfast.cli import main

    loads = np.random.default_rng(0).integers(0, 100, size=(3, 16))
    path = tmp_path / f"loads{suffix}"
    if suffix == ".npy":
        np.save(path, loads)
    elif suffix == ".csv":
        np.savetxt(path, loads, delimiter=",")
    else:
        torch.save(torch.from_numpy(loads), path)
    out_path = tmp_path / "placement.pt"
    assert main(["eplb", str(path), "--gpus", "4", "--nodes", "2", "--groups", "4", "--refine",
                 "--save", str(out_path)]) == 0
    assert "max/mean GPU load" in capsys.readouterr().out
    saved = torch.load(out_path, weights_only=True)
    assert_same((saved["phy2log"], saved["log2phy"], saved["logcnt"]),
                eplb.rebalance_experts(torch.from_numpy(loads).float(), 20, 4, 2, 4))


def test_cli_bad_arguments_exit_2(tmp_path):
    from trainfast.cli import main

    path = tmp_path / "loads.npy"
    np.save(path, np.ones((2, 16)))
    assert main(["eplb", str(path), "--gpus", "7", "--nodes", "2"]) == 2
    assert main(["eplb", str(tmp_path / "loads.json")]) == 2


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("refine", [False, True])
def test_cli_plot_writes_png(tmp_path, refine, capsys):
    pytest.importorskip("matplotlib")
    from trainfast.cli import main

    path, png = tmp_path / "loads.csv", tmp_path / "loads.png"
    np.savetxt(path, np.random.default_rng(1).integers(0, 100, size=(2, 16)), delimiter=",")
    args = ["eplb", str(path), "--gpus", "4", "--nodes", "2", "--groups", "4", "--plot", str(png)]
    assert main(args + (["--refine"] if refine else [])) == 0
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 300 and height >= 200 and len(data) > 5000  # a real chart, not an empty canvas
    assert f"wrote {png}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loads.csv", "loads.png"]  # no temp file left


def test_cli_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, caplog):
    import sys

    from trainfast.cli import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` raises ImportError
    path, png, saved = tmp_path / "loads.npy", tmp_path / "loads.png", tmp_path / "placement.pt"
    np.save(path, np.ones((2, 16), dtype=np.int64))
    code = main(["eplb", str(path), "--gpus", "4", "--nodes", "2", "--plot", str(png), "--save", str(saved)])
    assert code == 2
    assert "--plot needs matplotlib" in caplog.text and "pip install" in caplog.text
    assert not png.exists() and not saved.exists()  # failed before doing any work


@pytest.mark.parametrize("seed", range(4))
def test_strided_weight_matches_upstream(seed):
    # Every group holds the same loads in another order, so the group sums differ only by
    # rounding, and torch adds a strided row in another order than a contiguous one.
    generator = torch.Generator().manual_seed(seed)
    num_groups, group_size = 8, 64
    base = torch.rand(group_size, generator=generator) * 1000
    rows = [torch.cat([base[torch.randperm(group_size, generator=generator)] for _ in range(num_groups)])
            for _ in range(2)]
    strided = torch.stack(rows).t().contiguous().t()
    assert not strided.is_contiguous()
    args = (strided, num_groups * group_size * 2, num_groups, 2, 8)
    assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))
    assert_same(eplb.rebalance_experts_hierarchical(*args), ref.rebalance_experts_hierarchical(*args))
    as_int = (strided * 1000).to(torch.int64)  # sums past 2^24: float32 rounds, so torch's order shows
    args = (as_int, num_groups * group_size * 2, num_groups, 2, 8)
    assert_same(eplb.rebalance_experts(*args), ref.rebalance_experts(*args))


def test_log2phy_too_large_is_refused():
    # One hot expert takes every spare slot, so log2phy is [1, 2^18, 2^18 + 1]: 512 GiB, refused
    # up front (phy2log itself is small).
    weight = torch.zeros(1, 2**18)
    weight[0, 0] = 1
    with pytest.raises(ValueError, match="log2phy .* would need"):
        eplb.rebalance_experts(weight, 2**19, 1, 1, 1)


def test_native_replicate_names_num_replicas_past_2_31():
    """num_layers * num_replicas overflowing int64 was reported as "weight is too large"."""
    from trainfast import _core

    weight = np.asarray(README_WEIGHT, dtype=np.float32)
    empty = np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="num_replicas must be < 2.31"):
        _core.eplb_replicate(weight, 2**62, 4, 2, 8, *empty, 1)


# --- inputs upstream takes: the same answer ------------------------------------------------------------------


def _misaligned(tensor):
    """``tensor``'s values in memory one byte off its dtype's alignment (torch.frombuffer allows it)."""
    buffer = bytearray(tensor.numel() * tensor.element_size() + 1)
    view = torch.frombuffer(buffer, dtype=tensor.dtype, offset=1, count=tensor.numel()).view(tensor.shape)
    view.copy_(tensor)
    assert view.data_ptr() % view.element_size() != 0
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32, torch.float64])
def test_misaligned_and_transposed_tensors_as_upstream(dtype):
    weight = torch.tensor(README_WEIGHT).to(dtype)
    assert_same(eplb.rebalance_experts(_misaligned(weight), 16, 4, 2, 8), ref.rebalance_experts(weight, 16, 4, 2, 8))
    assert_same(eplb.balanced_packing(_misaligned(weight), 4), ref.balanced_packing(weight, 4))
    assert_same(eplb.replicate_experts(_misaligned(weight), 16), ref.replicate_experts(weight, 16))
    transposed = weight.T.contiguous().T  # the same values, column-major
    assert not transposed.is_contiguous()
    assert_same(eplb.balanced_packing(transposed, 4), ref.balanced_packing(weight, 4))
    assert_same(eplb.replicate_experts(transposed, 16), ref.replicate_experts(weight, 16))


def test_big_endian_numpy_weights_as_native():
    weight = np.array(README_WEIGHT, dtype=np.float32)
    expected = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    assert_same(eplb.rebalance_experts(weight.astype(">f4"), 16, 4, 2, 8), expected)
    assert_same(eplb.rebalance_experts(weight.astype(">i8"), 16, 4, 2, 8), expected)
    placement = expected[0].numpy()
    assert_same(eplb.rebalance_experts(weight, 16, 4, 2, 8, previous_phy2log=placement.astype(">i8")), expected)
