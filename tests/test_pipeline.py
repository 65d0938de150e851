"""trainfast.pipeline: the issue's worked examples, differential tests against the oracle and the
real megatron-core, exact optimality of balanced_layout against brute force, and bad input."""

from __future__ import annotations

import contextlib
import importlib
import random
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from reference import pipeline as ref
from trainfast import pipeline as tp
from trainfast._util import UpstreamAssertionError


def layers_of(plan):
    return {key: list(layers) for key, layers in plan.items()}


def assert_tiles(plan, num_layers, pp, vpp):
    """Every layer exactly once, chunks in global (vp-major) order, keys complete."""
    assert list(plan) == [(c % pp, c // pp) for c in range(pp * vpp)]
    assert [layer for layers in plan.values() for layer in layers] == list(range(num_layers))


# ------------------------------------------------------------------------------------------------
# megatron-core, imported once; its parallel state is faked per call


@pytest.fixture(scope="module")
def mcore():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from megatron.core import parallel_state
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    def make_config(**fields):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation notes about unrelated fields
            return TransformerConfig(hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32, **fields)

    return SimpleNamespace(
        parallel_state=parallel_state, Layout=PipelineParallelLayerLayout, make_config=make_config,
        num_layers_to_build=get_num_layers_to_build, layer_offset=get_transformer_layer_offset,
    )


@contextlib.contextmanager
def fake_parallel_state(parallel_state, pp_rank, vpp_world_size):
    saved = (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK, parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK = pp_rank
    parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = vpp_world_size
    try:
        yield
    finally:
        parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK, parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = saved


def upstream_plan(mcore, config):
    """{(p, v): range} from megatron-core's two functions, or the exception they raise."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    plan = {}
    try:
        for chunk in range(pp * (vpp or 1)):
            p, v = chunk % pp, chunk // pp
            vp_stage = v if vpp is not None else None
            with fake_parallel_state(mcore.parallel_state, p, vpp):
                count = mcore.num_layers_to_build(config, vp_stage=vp_stage, pp_rank=p)
                offset = mcore.layer_offset(config, vp_stage=vp_stage, pp_rank=p)
            plan[(p, v)] = range(offset, offset + count)
    except (AssertionError, ValueError, ZeroDivisionError, IndexError) as error:
        return error
    return plan


# ------------------------------------------------------------------------------------------------
# The worked examples


def test_megatron_worked_examples():
    emb = tp.plan_layers(7, 2, 2, account_for_embedding_in_pipeline_split=True)
    assert layers_of(emb) == {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3, 4], (1, 1): [5, 6]}
    loss = tp.plan_layers(7, 2, 2, account_for_loss_in_pipeline_split=True)
    assert layers_of(loss) == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6]}
    uneven = tp.plan_layers(12, 4, 2, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    assert layers_of(uneven) == {
        (0, 0): [0], (1, 0): [1, 2], (2, 0): [3, 4], (3, 0): [5],
        (0, 1): [6], (1, 1): [7, 8], (2, 1): [9, 10], (3, 1): [11],
    }


def test_drop_ins_on_worked_examples():
    config = SimpleNamespace(num_layers=12, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                             num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    got = [(tp.get_transformer_layer_offset(config, v, p), tp.get_num_layers_to_build(config, v, p))
           for v in range(2) for p in range(4)]
    assert got == [(0, 1), (1, 2), (3, 2), (5, 1), (6, 1), (7, 2), (9, 2), (11, 1)]
    config = SimpleNamespace(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                             account_for_embedding_in_pipeline_split=True)
    assert [tp.get_num_layers_to_build(config, v, p) for v in range(2) for p in range(2)] == [1, 2, 2, 2]
    assert [tp.get_transformer_layer_offset(config, v, p) for v in range(2) for p in range(2)] == [0, 1, 3, 5]


def test_layout_worked_example():
    layout = tp.PipelineLayout.from_str("Et*3|(tt|)*29,m|L", 16, num_layers=61, mtp_num_layers=1)
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert layout.layer_ids(vp_stage=0, pp_rank=0) == [0, 1, 2]
    assert layout.layer_ids(vp_stage=0, pp_rank=1) == [3, 4]
    assert layout.layer_ids(vp_stage=0, pp_rank=15) == [31, 32]
    assert layout.layer_ids(vp_stage=1, pp_rank=0) == [33, 34]
    assert layout.layout[14][1] == "m" and layout.num_layers_to_build(vp_stage=1, pp_rank=14) == 0
    assert layout.num_layers_to_build("mtp", vp_stage=1, pp_rank=14) == 1
    assert layout.layout[15][1] == "L"
    assert layout.validate(61, 1) is True  # MTP on pp rank 14, not the last: standalone
    assert layout.to_str() == "Et*3|(tt|)*29,m|L"
    assert tp.PipelineLayout.from_str(layout.to_str(), 16) == layout


def test_paddle_worked_example():
    plan = tp.plan_layers(8, 2, 2, method="paddle", stage_ids=[0, 0, 0, 0, 0, 1, 1, 1])
    assert layers_of(plan) == {(0, 0): [0, 1, 2], (1, 0): [3, 4], (0, 1): [5, 6], (1, 1): [7]}


def test_seed_worked_example():
    plan = tp.plan_layers(7, 2, 2, method="uneven")
    assert layers_of(plan) == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6]}
    assert tp.to_layout_str(plan, 2, 2) == "Ett|tt|tt|tL"


# ------------------------------------------------------------------------------------------------
# Megatron: oracle and real megatron-core

megatron_specs = st.builds(
    ref.MegatronSpec,
    num_layers=st.integers(0, 40),
    pp=st.integers(1, 6),
    vpp=st.none() | st.integers(1, 4),
    first=st.none() | st.none() | st.integers(-1, 12),
    last=st.none() | st.none() | st.integers(-1, 12),
    account_for_embedding=st.booleans(),
    account_for_loss=st.booleans(),
)


def native_plan(spec):
    return tp.plan_layers(
        spec.num_layers, spec.pp, spec.vpp,
        num_layers_in_first_pipeline_stage=spec.first, num_layers_in_last_pipeline_stage=spec.last,
        account_for_embedding_in_pipeline_split=spec.account_for_embedding,
        account_for_loss_in_pipeline_split=spec.account_for_loss,
    )


def spec_config(spec):
    return SimpleNamespace(
        num_layers=spec.num_layers, pipeline_model_parallel_size=spec.pp, virtual_pipeline_model_parallel_size=spec.vpp,
        num_layers_in_first_pipeline_stage=spec.first, num_layers_in_last_pipeline_stage=spec.last,
        account_for_embedding_in_pipeline_split=spec.account_for_embedding,
        account_for_loss_in_pipeline_split=spec.account_for_loss, pipeline_model_parallel_layout=None,
    )


@given(megatron_specs)
def test_megatron_plan_matches_oracle(spec):
    try:
        expected = ref.megatron_plan(spec)
    except ValueError:
        with pytest.raises(UpstreamAssertionError):
            native_plan(spec)
        return
    plan = native_plan(spec)
    assert plan == expected
    assert_tiles(plan, spec.num_layers, spec.pp, spec.vpp or 1)
    config = spec_config(spec)
    for (p, v), layers in plan.items():
        vp_stage = v if spec.vpp is not None else None
        assert tp.get_num_layers_to_build(config, vp_stage, p) == len(layers)
        assert tp.get_transformer_layer_offset(config, vp_stage, p) == layers.start or len(layers) == 0


@given(megatron_specs)
def test_megatron_matches_megatron_core(mcore, spec):
    assume(spec.num_layers > 0)  # TransformerConfig divides by num_layers in its init methods
    fields = dict(
        num_layers=spec.num_layers, pipeline_model_parallel_size=spec.pp, virtual_pipeline_model_parallel_size=spec.vpp,
        num_layers_in_first_pipeline_stage=spec.first, num_layers_in_last_pipeline_stage=spec.last,
        account_for_embedding_in_pipeline_split=spec.account_for_embedding,
        account_for_loss_in_pipeline_split=spec.account_for_loss,
    )
    try:
        config = mcore.make_config(**fields)
    except (ValueError, AssertionError):
        with pytest.raises(UpstreamAssertionError):
            native_plan(spec)
        with pytest.raises(UpstreamAssertionError):
            tp.get_num_layers_to_build(SimpleNamespace(**fields), None if spec.vpp is None else 0, 0)
        return
    upstream = upstream_plan(mcore, config)
    try:
        plan = native_plan(spec)
    except UpstreamAssertionError:
        # we reject exactly what upstream rejects, plus splits that do not build every layer once
        assert isinstance(upstream, Exception) or not ref.tiles_exactly_once(
            {k: r for k, r in upstream.items() if len(r)}, spec.num_layers)
        return
    if isinstance(upstream, ZeroDivisionError):  # uneven first+last with vpp and pp=2: upstream bug
        assert spec.pp == 2 and spec.vpp is not None and spec.first is not None and spec.last is not None
        return
    assert not isinstance(upstream, Exception), upstream
    for key, layers in plan.items():
        assert len(upstream[key]) == len(layers)
        assert upstream[key].start == layers.start or not len(layers)
        # the drop-ins read the real TransformerConfig object
        vp_stage = key[1] if spec.vpp is not None else None
        assert tp.get_num_layers_to_build(config, vp_stage, key[0]) == len(upstream[key])
        assert tp.get_transformer_layer_offset(config, vp_stage, key[0]) == upstream[key].start


def test_zero_division_case_gets_the_meant_offset(mcore):
    config = mcore.make_config(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    with pytest.raises(ZeroDivisionError):
        mcore.layer_offset(config, vp_stage=0, pp_rank=1)
    assert [tp.get_transformer_layer_offset(config, v, p) for v in range(2) for p in range(2)] == [0, 1, 2, 3]


def test_vp_stage_none_quirks_match_upstream(mcore):
    config = mcore.make_config(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               account_for_embedding_in_pipeline_split=True)
    # upstream compares None with 0, so (pp 0, vp None) does not subtract the embedding
    assert tp.get_num_layers_to_build(config, None, 0) == mcore.num_layers_to_build(config, None, 0) == 2
    with pytest.raises(AssertionError):
        mcore.layer_offset(config, None, 0)
    with pytest.raises(UpstreamAssertionError, match="vp_stage must be provided"):
        tp.get_transformer_layer_offset(config, None, 0)


def test_vpp_of_one_counts_the_embedding_as_without_vpp(mcore):
    # Found by mutation testing: with vpp == 1 every chunk is the first, even for vp_stage None.
    fields = dict(num_layers=7, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True)
    with_vpp = mcore.make_config(virtual_pipeline_model_parallel_size=1, **fields)
    without = mcore.make_config(**fields)
    assert tp.get_num_layers_to_build(with_vpp, None, 0) == mcore.num_layers_to_build(with_vpp, None, 0) == 3
    assert tp.get_num_layers_to_build(without, None, 0) == 3


def test_negative_middle_layers_are_floor_divided_in_the_message():
    # Python's // as upstream: -1 middle layers over 2 stages is -1 per stage, not 0.
    with pytest.raises(UpstreamAssertionError, match=r"chunk \(pp_rank=1, vp_stage=0\) would build -1 layers$"):
        tp.plan_layers(8, 4, num_layers_in_first_pipeline_stage=5, num_layers_in_last_pipeline_stage=4)


def test_to_layout_str_refuses_a_strided_range():
    with pytest.raises(ValueError, match="must be a range of consecutive layer ids"):
        tp.to_layout_str({(0, 0): range(0, 3, 2), (1, 0): range(2, 4)}, 2)


def test_pp_rank_from_megatron_parallel_state(mcore):
    config = spec_config(ref.MegatronSpec(8, 4))
    with fake_parallel_state(mcore.parallel_state, 3, None):
        assert tp.get_transformer_layer_offset(config) == 6 == mcore.layer_offset(config)
        assert tp.get_num_layers_to_build(config) == 2


def test_pp_rank_required_without_parallel_state(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    # Upstream asserts there: the error is an AssertionError as well as a ValueError.
    with pytest.raises(AssertionError, match="pp_rank must be given"):
        tp.get_num_layers_to_build(SimpleNamespace(num_layers=8, pipeline_model_parallel_size=4))
    with pytest.raises(ValueError, match="pp_rank must be given"):
        tp.get_transformer_layer_offset(SimpleNamespace(num_layers=8, pipeline_model_parallel_size=4))
    # With one pipeline rank and a layout too: upstream reads the rank before it sees the offset is 0.
    one_rank = SimpleNamespace(num_layers=2, pipeline_model_parallel_size=1,
                               pipeline_model_parallel_layout=tp.PipelineLayout.from_str("EttL", 1))
    with pytest.raises(AssertionError, match="pp_rank must be given"):
        tp.get_transformer_layer_offset(one_rank)
    assert tp.get_transformer_layer_offset(one_rank, None, 0) == 0


# ------------------------------------------------------------------------------------------------
# Layout strings


def encode_layout(stages, rng):
    """A random spelling of the stages: runs as c*n, repeated stages as (S|)*r, stray commas."""
    def spell_stage(stage):
        out, i = [], 0
        while i < len(stage):
            j = i
            while j < len(stage) and stage[j] == stage[i]:
                j += 1
            run = j - i
            out.append(f"{stage[i]}*{run}" if run > 1 and rng.random() < 0.6 else stage[i] * run)
            i = j
        return ",".join(out) if rng.random() < 0.3 else "".join(out)

    parts, i = [], 0
    while i < len(stages):
        j = i
        while j < len(stages) and stages[j] == stages[i]:
            j += 1
        run = j - i
        if run >= 2 and j < len(stages) and stages[i] and rng.random() < 0.7:
            parts.append(f"({spell_stage(stages[i])}|)*{run}")
            parts.append("")  # the group already ends with '|'
        else:
            parts.extend(spell_stage(stages[i]) + "|" for _ in range(run))
        i = j
    text = "".join(parts)
    return text[:-1] if text.endswith("|") else text


@st.composite
def layouts(draw):
    pp = draw(st.integers(1, 5))
    vpp = draw(st.integers(1, 3))
    n = pp * vpp
    stages = [draw(st.text("tt", max_size=4)) for _ in range(n)]
    num_mtp = draw(st.integers(0, 2))
    if num_mtp and draw(st.booleans()):
        mtp_rank = draw(st.integers(1 if vpp > 1 else 0, pp - 1)) if pp > 1 else 0
        stages[(vpp - 1) * pp + mtp_rank] += "m" * num_mtp
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    if draw(st.integers(0, 9)) == 0:  # sometimes break a rule
        c = draw(st.integers(0, n - 1))
        stages[c] = stages[c] + draw(st.sampled_from("ELtm"))
    return pp, stages, draw(st.randoms(use_true_random=False))


@given(layouts())
def test_layout_parse_and_validate_match_megatron(mcore, case):
    pp, stages, rng = case
    text = encode_layout(stages, rng)
    expected = ref.parse_layout(text, pp)
    assert expected == stages, text
    layout = tp.PipelineLayout.from_str(text, pp, validate=False)
    assert list(layout.stages) == stages
    upstream = mcore.Layout(text, pp)
    assert layout.layout == [["".join(_char(t) for t in s) for s in row] for row in upstream.layout]
    num_layers = sum(stage.count("t") for stage in stages)
    for mtp in (None, sum(stage.count("m") for stage in stages)):
        try:
            standalone = upstream.validate_layer_layout(num_layers, mtp)
        except (AssertionError, IndexError):
            with pytest.raises(ValueError):
                layout.validate(num_layers, mtp)
            continue
        assert layout.validate(num_layers, mtp) == standalone == ref.validate_layout(stages, pp, num_layers, mtp)
    assert tp.PipelineLayout.from_str(layout.to_str(), pp, validate=False) == layout
    for chunk, stage in enumerate(stages):
        p, v = chunk % pp, chunk // pp
        with fake_parallel_state(mcore.parallel_state, p, layout.virtual_pipeline_model_parallel_size):
            assert layout.num_layers_to_build("t", v, p) == upstream.get_num_layers_to_build(vp_stage=v)
            assert layout.layer_offset("t", v, p) == upstream.get_layer_offset(vp_stage=v)


def _char(layer_type):
    return {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}[layer_type.name]


LAYOUT_ALPHABET = "EtmL|()*,0123xé😀３٢"  # Megatron's \d and int() read any Unicode decimal digit; (.) a whole character


@given(st.text(LAYOUT_ALPHABET, max_size=14), st.integers(1, 3))
def test_layout_parser_on_arbitrary_strings(mcore, text, pp):
    try:
        upstream = mcore.Layout(text, pp)
    except AssertionError:
        with pytest.raises(ValueError):
            tp.PipelineLayout.from_str(text, pp, validate=False)
        return
    layout = tp.PipelineLayout.from_str(text, pp, validate=False)
    assert layout.layout == [["".join(_char(t) for t in s) for s in row] for row in upstream.layout]


@pytest.mark.parametrize("text, char", [("Eé*2|tL", "'é' (U+00E9)"), ("E😀|tL", "'😀' (U+1F600)"),
                                        ("Et\x01|tL", r"'\x01'"), ("E" + "t" * 78 + "é|L", "'é' (U+00E9)")])
def test_layout_errors_name_non_ascii_characters_whole(text, char):
    # Repeats and messages work on characters: a message cut inside one was not even decodable.
    with pytest.raises(ValueError, match="invalid layer character " + re.escape(char)):
        tp.PipelineLayout.from_str(text, 2)
    with pytest.raises(ValueError, match="invalid layer character " + re.escape(char)):
        tp.PipelineLayout(text.split("|"), 2)


def test_layout_repeat_of_a_non_ascii_character_zero_times_is_dropped(mcore):
    layout = tp.PipelineLayout.from_str("Eé*0t|tL", 2)
    assert layout.stages == ("Et", "tL")
    assert layout.layout == [["".join(_char(t) for t in s) for s in row] for row in mcore.Layout("Eé*0t|tL", 2).layout]


def test_layout_through_transformer_config(mcore):
    text = "Et|tt|tt|t|(t|)*2,tm|L"  # pp=4, vpp=2, MTP on pp rank 2's last virtual stage
    config = mcore.make_config(num_layers=9, pipeline_model_parallel_size=4, pipeline_model_parallel_layout=text,
                               mtp_num_layers=1)
    assert config.virtual_pipeline_model_parallel_size == 2
    ours = SimpleNamespace(num_layers=9, pipeline_model_parallel_size=4, pipeline_model_parallel_layout=text,
                           mtp_num_layers=1)
    for p in range(4):
        for v in range(2):
            with fake_parallel_state(mcore.parallel_state, p, 2):
                expected = (mcore.num_layers_to_build(config, vp_stage=v), mcore.layer_offset(config, vp_stage=v))
            assert (tp.get_num_layers_to_build(config, v, p), tp.get_transformer_layer_offset(config, v, p)) == expected
            assert (tp.get_num_layers_to_build(ours, v, p), tp.get_transformer_layer_offset(ours, v, p)) == expected
    with pytest.raises(UpstreamAssertionError, match="9 decoder layers 't' but num_layers is 10: layer 9 would be lost"):
        tp.get_num_layers_to_build(SimpleNamespace(**{**vars(ours), "num_layers": 10}), 0, 0)


def test_layout_offset_on_one_pipeline_rank_needs_no_vp_stage(mcore):
    # Upstream returns 0 for pp=1 before looking at vp_stage (found by a differential run: the
    # drop-in asked the layout for a vp_stage first), but after reading the parallel state when
    # pp_rank is None: without one initialized, both assert.
    for text in ("Ett|L", "Ett|mL", "E|tt|mmL"):
        mtp = text.count("m")
        config = mcore.make_config(num_layers=2, pipeline_model_parallel_size=1, pipeline_model_parallel_layout=text,
                                   mtp_num_layers=mtp or None)
        with fake_parallel_state(mcore.parallel_state, 0, config.virtual_pipeline_model_parallel_size):
            expected = mcore.layer_offset(config, vp_stage=None)
            assert tp.get_transformer_layer_offset(config, vp_stage=None) == expected
        assert expected == 0
        assert tp.get_transformer_layer_offset(config, vp_stage=None, pp_rank=0) == expected
        with pytest.raises(AssertionError):
            mcore.layer_offset(config, vp_stage=None)
        with pytest.raises(AssertionError, match="pp_rank must be given"):
            tp.get_transformer_layer_offset(config, vp_stage=None)


def test_layout_to_str_examples():
    cases = {
        "Et*3|(tt|)*29,m|L": 16,
        "Ettt|tt|tt|ttL": 2,
        "E|t|t|L": 4,
        "Et||tL": 3,
        "(Et|)*1,tL": 1,
    }
    for text, pp in cases.items():
        layout = tp.PipelineLayout.from_str(text, pp, validate=False)
        assert tp.PipelineLayout.from_str(layout.to_str(), pp, validate=False) == layout
    assert tp.PipelineLayout.from_str("E|t|t|t|t|L", 1).to_str() == "E|(t|)*4,L"


@given(megatron_specs)
def test_to_layout_str_gives_megatron_the_same_split(mcore, spec):
    try:
        plan = native_plan(spec)
    except UpstreamAssertionError:
        return
    vpp = spec.vpp or 1
    text = tp.to_layout_str(plan, spec.pp, vpp)
    upstream = mcore.Layout(text, spec.pp)
    upstream.validate_layer_layout(spec.num_layers, None)
    for (p, v), layers in plan.items():
        with fake_parallel_state(mcore.parallel_state, p, vpp if vpp > 1 else None):
            assert upstream.get_num_layers_to_build(vp_stage=v) == len(layers)
            assert upstream.get_layer_offset(vp_stage=v) == layers.start or not len(layers)


# ------------------------------------------------------------------------------------------------
# Seed rule and Paddle


@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 60))
def test_uneven_matches_oracle(pp, vpp, extra):
    num_layers = pp * vpp + extra
    plan = tp.plan_layers(num_layers, pp, vpp, method="uneven")
    assert plan == ref.uneven_plan(num_layers, pp, vpp)
    assert_tiles(plan, num_layers, pp, vpp)
    sizes = [len(r) for r in plan.values()]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if num_layers % (pp * vpp) == 0 and (pp > 1 or vpp == 1):  # divisible: Megatron's even split
        assert plan == native_plan(ref.MegatronSpec(num_layers, pp, vpp))


@given(st.integers(2, 5), st.integers(1, 4), st.data())
def test_paddle_matches_oracle(pp, vpp, data):
    per_stage = [data.draw(st.integers(vpp, vpp + 6)) for _ in range(pp)]
    stage_ids = [stage for stage, count in enumerate(per_stage) for _ in range(count)]
    plan = tp.plan_layers(len(stage_ids), pp, vpp, method="paddle", stage_ids=np.array(stage_ids))
    assert plan == ref.paddle_plan(stage_ids, pp, vpp)
    assert_tiles(plan, len(stage_ids), pp, vpp)
    for stage in range(pp):  # each stage keeps the number of layers the user gave it
        assert sum(len(plan[(stage, v)]) for v in range(vpp)) == per_stage[stage]


# ------------------------------------------------------------------------------------------------
# balanced_layout


def check_balanced(costs, pp, vpp, embedding, loss):
    if pp == 1 and vpp > 1:  # Megatron would number both virtual stages' layers from 0
        with pytest.raises(ValueError, match="needs pp > 1 when vpp > 1"):
            tp.balanced_layout(costs, pp, vpp, embedding_cost=embedding, loss_cost=loss)
        return None
    result = tp.balanced_layout(costs, pp, vpp, embedding_cost=embedding, loss_cost=loss)
    plan, layout_str = result
    assert_tiles(plan, len(costs), pp, vpp)
    assert all(len(layers) >= 1 for layers in plan.values())
    bounds, chunks, stages = ref.balanced_layout(list(costs), pp, vpp, embedding, loss)
    assert result.boundaries.tolist() == bounds
    assert result.chunk_costs.tolist() == chunks and result.stage_costs.tolist() == stages
    assert result.max_chunk_cost == max(chunks) and result.max_stage_cost == max(stages)
    assert tp.chunk_costs(plan, costs, pp, vpp, embedding_cost=embedding, loss_cost=loss) == (chunks, stages)
    parsed = tp.PipelineLayout.from_str(layout_str, pp, num_layers=len(costs))
    assert parsed.plan() == plan
    return result


cost_values = st.floats(0, 10, allow_nan=False) | st.integers(0, 5).map(float)


@given(st.integers(1, 3), st.integers(1, 2), st.data())
def test_balanced_layout_is_optimal_brute_force(pp, vpp, data):
    num_chunks = pp * vpp
    costs = data.draw(st.lists(cost_values, min_size=num_chunks, max_size=min(num_chunks + 5, 9)))
    embedding, loss = data.draw(cost_values), data.draw(cost_values)
    result = check_balanced(costs, pp, vpp, embedding, loss)
    if result is None:
        return
    assert result.max_chunk_cost == ref.brute_force_min_max(costs, num_chunks, embedding, loss)
    best_stage = ref.brute_force_best_stage(costs, pp, vpp, embedding, loss, result.max_chunk_cost)
    assert best_stage <= result.max_stage_cost  # the stage step is a local search, not an exact optimum:
    assert_no_single_move_lowers_a_stage(result, costs, pp, vpp, embedding, loss)  # ... it ends at a local one


def assert_no_single_move_lowers_a_stage(result, costs, pp, vpp, embedding, loss):
    """The local search's stopping point: moving one chunk boundary anywhere between its neighbours
    either puts a chunk over the optimal chunk cost or leaves the costlier of the two stages it
    changes no cheaper."""
    bounds = result.boundaries.tolist()
    for k in range(1, pp * vpp):
        changed = {(k - 1) % pp, k % pp}
        before = max(result.stage_costs[s].item() for s in changed)
        for position in range(bounds[k - 1] + 1, bounds[k + 1]):
            moved = bounds[:k] + [position] + bounds[k + 1:]
            plan = {(c % pp, c // pp): range(moved[c], moved[c + 1]) for c in range(pp * vpp)}
            chunks, stages = tp.chunk_costs(plan, costs, pp, vpp, embedding_cost=embedding, loss_cost=loss)
            if max(chunks) <= result.max_chunk_cost:
                assert max(stages[s] for s in changed) >= before, (k, position, moved, bounds)


@pytest.mark.parametrize("seed", range(12))
def test_balanced_layout_is_optimal_dp(seed):
    rng = random.Random(seed)
    pp, vpp = rng.randint(1, 4), rng.randint(1, 3)
    n = rng.randint(pp * vpp, 40)
    costs = [rng.choice([rng.uniform(0, 3), float(rng.randint(0, 4)), rng.uniform(0, 1) * 1e-12]) for _ in range(n)]
    embedding, loss = rng.uniform(0, 5), rng.uniform(0, 5)
    result = check_balanced(costs, pp, vpp, embedding, loss)
    if result is not None:
        assert result.max_chunk_cost == ref.dp_min_max(costs, pp * vpp, embedding, loss)
        assert_no_single_move_lowers_a_stage(result, costs, pp, vpp, embedding, loss)


def test_balanced_layout_large_and_tie_break():
    rng = np.random.default_rng(0)
    costs = rng.uniform(0.5, 1.5, 1000)
    result = check_balanced(costs, 16, 4, 3.0, 5.0)
    # never worse than the even split on either figure
    even = tp.plan_layers(1000, 16, 4, method="uneven")
    even_chunks, even_stages = tp.chunk_costs(even, costs, 16, 4, embedding_cost=3.0, loss_cost=5.0)
    assert result.max_chunk_cost <= max(even_chunks) and result.max_stage_cost <= max(even_stages)
    assert result.max_stage_cost <= 1.02 * sum(even_stages) / 16


def test_balanced_layout_torch_input():
    torch = pytest.importorskip("torch")
    result = tp.balanced_layout(torch.tensor([1.0, 1.0, 1.0, 5.0], dtype=torch.float32), 2, 1)
    assert result.layout_str == "Et*3|tL" and result.max_chunk_cost == 5.0 and result.stage_costs.tolist() == [3.0, 5.0]
    # bfloat16 (no NumPy dtype) widens exactly; sparse tensors are refused by name
    result = tp.balanced_layout(torch.tensor([1.0, 1.0, 1.0, 5.0], dtype=torch.bfloat16), 2, 1)
    assert result.layout_str == "Et*3|tL" and result.stage_costs.tolist() == [3.0, 5.0]
    assert tp.chunk_costs(result.plan, torch.ones(4, dtype=torch.bfloat16), 2) == ([3.0, 1.0], [3.0, 1.0])
    with pytest.raises(TypeError, match="layer_costs must be a dense tensor"):
        tp.balanced_layout(torch.ones(4).to_sparse(), 2, 1)
    with pytest.raises(TypeError, match="stage_ids must have an int dtype"):
        tp.plan_layers(4, 2, 1, method="paddle", stage_ids=torch.zeros(4, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: tp.plan_layers(8, 0, 2), ValueError, "pp must be >= 1"),
        (lambda: tp.plan_layers(8, 2, 0), ValueError, "vpp must be >= 1"),
        (lambda: tp.plan_layers(8, -1, 2, method="uneven"), ValueError, "pp must be >= 1"),
        (lambda: tp.plan_layers(3, 2, 2, method="uneven"), ValueError,
         r"num_layers \(3\) must be at least pp \* vpp = 4.*\(pp_rank=1, vp_stage=1\)"),
        (lambda: tp.plan_layers(7, 2, 2), UpstreamAssertionError, r"layers? .*would be lost"),
        (lambda: tp.plan_layers(12, 4, 2, num_layers_in_first_pipeline_stage=3), UpstreamAssertionError,
         r"num_layers_in_first_pipeline_stage \(3\) must be divisible by virtual_pipeline_model_parallel_size \(2\): "
         r"layers .* would be lost"),
        (lambda: tp.plan_layers(12, 4, 2, num_layers_in_last_pipeline_stage=3), UpstreamAssertionError,
         r"num_layers_in_last_pipeline_stage \(3\) must be divisible"),
        (lambda: tp.plan_layers(7, 1, 2), UpstreamAssertionError, "built more than once"),
        (lambda: tp.plan_layers(8, 2, 2, method="paddle", stage_ids=[0] * 7 + [1]), ValueError,
         r"pipeline stage 1 has 1 layers \(layer 7\), fewer than vpp=2"),
        (lambda: tp.plan_layers(8, 2, 2, method="paddle", stage_ids=[0] * 7 + [2]), ValueError, r"stage_ids\[7\]"),
        (lambda: tp.plan_layers(8, 2, 2, method="paddle"), ValueError, "needs stage_ids"),
        (lambda: tp.plan_layers(8, 2, 2, method="magic"), ValueError, "method must be one of"),
        (lambda: tp.plan_layers(8.0, 2, 2), TypeError, "num_layers must be an int"),
        (lambda: tp.PipelineLayout.from_str("Et|(tt|L", 1), ValueError, r"invalid layer character '\('.*parentheses"),
        (lambda: tp.PipelineLayout.from_str("Et|tt)*2|L", 1), ValueError, r"invalid layer character '\)'"),
        (lambda: tp.PipelineLayout.from_str("Etx|L", 2), ValueError, r"invalid layer character 'x' in stage 0"),
        (lambda: tp.PipelineLayout.from_str("tE|tL", 2), ValueError, "first layer must be the embedding 'E'"),
        (lambda: tp.PipelineLayout.from_str("Et|Lt", 2), ValueError, "last layer must be the loss 'L'"),
        (lambda: tp.PipelineLayout.from_str("EtE|tL", 2), ValueError, "'E' must appear exactly once"),
        (lambda: tp.PipelineLayout.from_str("Et|t|L", 2), ValueError, "3 stages, which is not a multiple"),
        (lambda: tp.PipelineLayout.from_str("Et|tL", 2, num_layers=3), ValueError, "layer 2 would be lost"),
        (lambda: tp.PipelineLayout.from_str("Et|mt|tL", 1, num_layers=3, mtp_num_layers=1), ValueError,
         "decoder layers must be placed before MTP"),
        (lambda: tp.PipelineLayout.from_str("Et|t|m|L", 1, num_layers=2, mtp_num_layers=1), ValueError,
         "last virtual stage"),
        (lambda: tp.PipelineLayout.from_str("t*99999999999", 1), ValueError, "repeat count"),
        (lambda: tp.PipelineLayout.from_str(["Et"], 1), TypeError, "layout must be a str"),
        (lambda: tp.balanced_layout([1.0, -1.0, 2.0], 1, 1), ValueError, r"layer_costs\[1\] must be a finite non-negative"),
        (lambda: tp.balanced_layout([1.0, float("nan")], 1, 1), ValueError, r"layer_costs\[1\]"),
        (lambda: tp.balanced_layout([1.0, float("inf")], 1, 1), ValueError, r"layer_costs\[1\]"),
        (lambda: tp.balanced_layout([1.0] * 3, 2, 2), ValueError, "3 layers, fewer than pp \\* vpp = 4"),
        (lambda: tp.balanced_layout([1.0] * 4, 0, 2), ValueError, "pp must be >= 1"),
        (lambda: tp.balanced_layout([1.0] * 4, 2, 0), ValueError, "vpp must be >= 1"),
        (lambda: tp.balanced_layout([1.0] * 4, 2, 2, embedding_cost=float("nan")), ValueError, "embedding_cost"),
        (lambda: tp.balanced_layout([1.0] * 4, 2, 2, loss_cost=-2), ValueError, "loss_cost"),
        (lambda: tp.balanced_layout(["a"], 1, 1), TypeError, "layer_costs"),
        (lambda: tp.balanced_layout([1.0] * 8, 1, 2), ValueError, "needs pp > 1 when vpp > 1"),
        (lambda: tp.to_layout_str(tp.plan_layers(8, 1, 2, method="uneven"), 1, 2), ValueError,
         "needs pp > 1 when vpp > 1"),
        (lambda: tp.balanced_layout([[1.0, 2.0], [3.0]], 2, 1), ValueError, "layer_costs must be a rectangular"),
        (lambda: tp.to_layout_str({(0, 0): range(0, 2), (1, 0): range(3, 4)}, 2, 1), ValueError,
         r"layers 2-2 would be lost"),
        (lambda: tp.to_layout_str({(0, 0): range(0, 2)}, 2, 1), ValueError, r"missing \[\(1, 0\)\]"),
        (lambda: tp.to_layout_str({(0, 0): range(0, 1), (1, 0): range(1, 2**63)}, 2), ValueError,
         "more than 16777216 layers"),
        # INT64_MIN is the native core's None: refused, not taken for an unset stage.
        (lambda: tp.plan_layers(8, 2, num_layers_in_first_pipeline_stage=-2**63), ValueError,
         r"num_layers_in_first_pipeline_stage must be in \(-2\^60, 2\^60\)"),
        (lambda: tp.get_num_layers_to_build(SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2,
                                                             virtual_pipeline_model_parallel_size=2),
                                            vp_stage=-2**63, pp_rank=0), ValueError, "vp_stage must be in"),
        # Past int64 too: a message naming the argument, not pybind's "incompatible function arguments".
        (lambda: tp.PipelineLayout.from_str("Et|L", 2**63), ValueError, r"pipeline_model_parallel_size must be in"),
        (lambda: tp.plan_layers(4, 2**63), ValueError, r"pp must be in \(-2\^60, 2\^60\)"),
        (lambda: tp.balanced_layout([1.0] * 4, 2, -2**64), ValueError, "vpp must be >= 1"),
        (lambda: tp.PipelineLayout.from_str("Et\ud800|L", 2), ValueError, r"invalid layer character '\\ud800'"),
        # Stages are counted before they are built: 12 characters would make 2^24 of them.
        (lambda: tp.PipelineLayout.from_str("(|)*16777215", 1), ValueError, r"expands to 16777216 stages"),
        # The chunk count is bounded before a set of every (pp_rank, vp_stage) is built.
        (lambda: tp.to_layout_str({(0, 0): range(4)}, 2**40), ValueError, r"pp times vpp must be <= 2\^22"),
        (lambda: tp.chunk_costs({(0, 0): range(4)}, [1.0] * 4, 1, 2**30), ValueError, r"pp times vpp must be <= 2\^22"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_megatron_config_errors_name_the_problem():
    config = SimpleNamespace(num_layers=7, pipeline_model_parallel_size=2)
    with pytest.raises(UpstreamAssertionError, match=r"num_layers \(7\) must be divisible by pipeline_model_parallel_size \(2\): layer 6 would be lost"):
        tp.get_num_layers_to_build(config, pp_rank=0)
    with pytest.raises(AssertionError):  # also an AssertionError, like upstream
        tp.get_transformer_layer_offset(config, pp_rank=1)
    config = SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=4,
                             account_for_loss_in_pipeline_split=True)
    with pytest.raises(ValueError, match="cannot be set together"):
        tp.get_num_layers_to_build(config, pp_rank=0)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, pipeline_model_parallel_size=2\)"):
        tp.get_num_layers_to_build(SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2), pp_rank=2)
    with pytest.raises(ValueError, match="vp_stage must be None or in"):
        tp.get_num_layers_to_build(SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2,
                                                   virtual_pipeline_model_parallel_size=2), vp_stage=2, pp_rank=0)
    with pytest.raises(TypeError, match="num_layers field"):
        tp.get_num_layers_to_build(object(), pp_rank=0)
    with pytest.raises(UpstreamAssertionError, match="mismatch: 2 middle layers"):
        tp.plan_layers(6, 2, None, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_pipeline_table():
    out = subprocess.run(
        [sys.executable, "-m", "trainfast.cli", "pipeline", "--num-layers", "7", "--pp", "2", "--vpp", "2",
         "--method", "uneven"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "Ett|tt|tt|tL" in out and "0-1" in out and "6" in out


def test_cli_pipeline_extra_costs_are_not_layer_counts(capsys):
    from trainfast.cli import main

    assert main(["pipeline", "--num-layers", "8", "--pp", "2", "--embedding-cost", "5"]) == 0
    out = capsys.readouterr().out
    # Rank 0 holds 4 layers and the embedding: its column is a cost, not a layer count.
    assert "stage cost" in out and "layers" not in out.splitlines()[0]
    assert "9.00" in out
    assert main(["pipeline", "--num-layers", "8", "--pp", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == "layers"


def test_cli_pipeline_bad_input_exit_code():
    result = subprocess.run(
        [sys.executable, "-m", "trainfast.cli", "pipeline", "--num-layers", "7", "--pp", "2", "--vpp", "2"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2 and "would be lost" in result.stderr


def test_megatron_integration_patches_the_pipeline_functions(mcore):
    from trainfast.integrations import megatron as integration
    from megatron.core.transformer import transformer_block, transformer_layer

    config = mcore.make_config(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               account_for_embedding_in_pipeline_split=True)
    before = [(transformer_block.get_num_layers_to_build(config, v, p), transformer_layer.get_transformer_layer_offset(config, v, p))
              for v in range(2) for p in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched = integration.patch()
    try:
        assert "megatron.core.transformer.transformer_block.get_num_layers_to_build" in patched
        assert "megatron.core.transformer.transformer_block.get_transformer_layer_offset" in patched
        assert transformer_block.get_num_layers_to_build.__trainfast_original__ is mcore.num_layers_to_build
        after = [(transformer_block.get_num_layers_to_build(config, v, p), transformer_block.get_transformer_layer_offset(config, v, p))
                 for v in range(2) for p in range(2)]
        assert after == before == [(1, 0), (2, 1), (2, 3), (2, 5)]
        with pytest.raises(AssertionError, match="layer 6 would be lost"):
            transformer_layer.get_transformer_layer_offset(SimpleNamespace(num_layers=7, pipeline_model_parallel_size=2), None, 1)
    finally:
        integration.unpatch()
    assert transformer_block.get_num_layers_to_build is mcore.num_layers_to_build


def _upstream_0_12(config):  # megatron-core 0.12's form: the ranks come from parallel_state
    return 0


def _upstream_0_14(config, vp_stage=None):  # 0.14's form: vp_stage, no pp_rank
    return 0


@pytest.mark.parametrize("upstream_function, version", [
    (_upstream_0_12, None), (_upstream_0_14, None), (None, "0.15.0"), (None, "unknown"),
])
def test_megatron_integration_keeps_pipeline_functions_of_older_releases(mcore, monkeypatch, upstream_function,
                                                                         version):
    """Releases before 0.16 call these functions another way (0.12: config only; 0.14: no pp_rank) or
    accept splits that the drop-ins, validating as 0.16's TransformerConfig does, refuse (0.15: two
    middle stages with no layers); patch() keeps upstream's there."""
    from megatron.core import package_info
    from megatron.core.transformer import transformer_block, transformer_layer

    from trainfast.integrations import megatron as integration

    if upstream_function is not None:  # in every module that patch() would swap it in
        for target in integration.patcher.targets:
            if target.attribute in ("get_num_layers_to_build", "get_transformer_layer_offset"):
                with contextlib.suppress(Exception):
                    monkeypatch.setattr(importlib.import_module(target.module), target.attribute, upstream_function)
    if version is not None:
        monkeypatch.setattr(package_info, "__version__", version)
    kept = (transformer_block.get_num_layers_to_build, transformer_layer.get_transformer_layer_offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched = integration.patch()
    try:
        assert not [name for name in patched if name.endswith(("get_num_layers_to_build", "get_transformer_layer_offset"))]
        assert (transformer_block.get_num_layers_to_build, transformer_layer.get_transformer_layer_offset) == kept
        assert any(name.endswith("_split_by_size_and_type") for name in patched)  # the rest still patched
    finally:
        integration.unpatch()


def test_balanced_layout_takes_python_ints_past_int64_as_costs():
    # NumPy keeps such a list as objects; as floats they are ordinary costs.
    assert tp.balanced_layout([1, 2**70, 3], 2) == tp.balanced_layout([1.0, float(2**70), 3.0], 2)


def test_tensor_subclass_costs_as_plain_tensors():
    # A torch.Tensor subclass from user code is a tensor like any other.
    import torch

    class UserTensor(torch.Tensor):
        pass

    costs = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 1.0])
    assert tp.balanced_layout(costs.as_subclass(UserTensor), 2) == tp.balanced_layout(costs, 2)


def test_a_parsed_layout_cannot_be_edited():
    # from_str caches its result: an edit would change every later parse of the same string.
    layout = tp.PipelineLayout.from_str("Ett|ttL", 2)
    with pytest.raises(AttributeError, match="immutable"):
        layout.stages = ("Et", "tttL")
    with pytest.raises(AttributeError, match="immutable"):
        del layout.pipeline_model_parallel_size
    assert tp.PipelineLayout.from_str("Ett|ttL", 2).to_str() == "Ett|ttL"
