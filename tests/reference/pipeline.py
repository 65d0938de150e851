"""Pure-Python oracle for trainfast.pipeline, written from the semantics in issue 5.

Plans are ``{(pp_rank, vp_stage): range}`` in global chunk order (chunk c = vp_stage * pp + pp_rank).
Invalid input raises ValueError (messages are not compared with the native ones).
"""

from __future__ import annotations

import itertools
import re
import struct
from dataclasses import dataclass
from typing import Optional


def chunk_key(chunk: int, pp: int) -> tuple[int, int]:
    return (chunk % pp, chunk // pp)


def plan_from_counts(counts: list[int], pp: int) -> dict:
    plan, start = {}, 0
    for chunk, count in enumerate(counts):
        plan[chunk_key(chunk, pp)] = range(start, start + count)
        start += count
    return plan


def tiles_exactly_once(plan: dict, num_layers: int) -> bool:
    """Every layer in exactly one chunk, chunks in global order."""
    layers = [layer for chunk_layers in plan.values() for layer in chunk_layers]
    return layers == list(range(num_layers))


# ------------------------------------------------------------------------------------------------
# Megatron (get_num_layers_to_build / get_transformer_layer_offset / TransformerConfig checks)


@dataclass(frozen=True)
class MegatronSpec:
    num_layers: int
    pp: int
    vpp: Optional[int] = None
    first: Optional[int] = None
    last: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False


def _uneven(spec: MegatronSpec) -> bool:
    return spec.first is not None or spec.last is not None


def megatron_count(spec: MegatronSpec, pp_rank: int, vp_stage: Optional[int]) -> int:
    """Decoder layers on (pp_rank, vp_stage), by Megatron's arithmetic (floor divisions, no checks)."""
    is_first, is_last = pp_rank == 0, pp_rank == spec.pp - 1
    if _uneven(spec):
        rest = spec.num_layers - (spec.first or 0) - (spec.last or 0)
        rest_stages = spec.pp - (spec.first is not None) - (spec.last is not None)
        per_rank = rest // rest_stages if rest_stages > 0 else 0
        if is_first and spec.first is not None:
            per_rank = spec.first
        if is_last and spec.last is not None:
            per_rank = spec.last
    else:
        per_rank = (spec.num_layers + spec.account_for_embedding + spec.account_for_loss) // spec.pp
    count = per_rank // spec.vpp if spec.vpp is not None and spec.pp > 1 else per_rank
    single = spec.vpp is None or spec.vpp <= 1
    if spec.account_for_embedding and is_first and (single or vp_stage == 0):
        count -= 1
    if spec.account_for_loss and is_last and (single or vp_stage == spec.vpp - 1):
        count -= 1
    return count


def megatron_offset(spec: MegatronSpec, pp_rank: int, vp_stage: Optional[int]) -> int:
    """First decoder layer id of (pp_rank, vp_stage), by Megatron's arithmetic."""
    if spec.pp <= 1:
        return 0
    v = vp_stage or 0
    if _uneven(spec):
        first, last = spec.first or 0, spec.last or 0
        middle_stages = spec.pp - (spec.first is not None) - (spec.last is not None)
        middle_layers = spec.num_layers - first - last
        middle_rank = pp_rank if spec.first is None else pp_rank - 1
        if spec.vpp is not None:
            first_v, last_v, middle_v = first // spec.vpp, last // spec.vpp, middle_layers // spec.vpp
            if pp_rank == 0:
                return v * (first_v + middle_v + last_v)
            per_middle = middle_v // middle_stages if middle_stages else 0  # upstream: ZeroDivisionError
            return v * (first_v + middle_v + last_v) + first_v + middle_rank * per_middle
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + first
    total = spec.num_layers + spec.account_for_embedding + spec.account_for_loss
    if spec.vpp is not None:
        offset = v * (total // spec.vpp) + pp_rank * (total // spec.pp // spec.vpp)
    else:
        offset = pp_rank * (total // spec.pp)
    first_chunk = pp_rank == 0 and (spec.vpp is None or spec.vpp <= 1 or v == 0)
    if spec.account_for_embedding and not first_chunk:
        offset -= 1
    return offset


def megatron_rule_violation(spec: MegatronSpec) -> Optional[str]:
    """The first TransformerConfig / function check the spec fails, or None."""
    vpp = spec.vpp
    if _uneven(spec) and (spec.account_for_embedding or spec.account_for_loss):
        return "uneven + account_for"
    if _uneven(spec):
        stages, layers = spec.pp, spec.num_layers
        for value in (spec.first, spec.last):
            if value is None:
                continue
            if value <= 0:
                return "first/last <= 0"
            if vpp is not None and value % vpp:
                return "first/last % vpp"
            layers -= value
            stages -= 1
        if bool(layers) != bool(stages):
            return "middle mismatch"
        if stages and layers % stages:
            return "middle % stages"
        if stages and vpp is not None and (layers // stages) % vpp:
            return "middle per stage % vpp"
        return None
    total = spec.num_layers + spec.account_for_embedding + spec.account_for_loss
    if total % spec.pp:
        return "total % pp"
    if vpp is not None and (spec.pp > 1 or spec.account_for_embedding or spec.account_for_loss) and (total // spec.pp) % vpp:
        return "per stage % vpp"
    return None


def megatron_plan(spec: MegatronSpec) -> dict:
    """Validated plan: raises ValueError where Megatron rejects the config or the split would not
    build every layer exactly once in order."""
    if spec.pp < 1 or (spec.vpp is not None and spec.vpp < 1) or spec.num_layers < 0:
        raise ValueError("bad sizes")
    violation = megatron_rule_violation(spec)
    if violation:
        raise ValueError(violation)
    num_vp = spec.vpp or 1
    plan = {}
    for chunk in range(spec.pp * num_vp):
        pp_rank, v = chunk_key(chunk, spec.pp)
        vp_stage = v if spec.vpp is not None else None
        count = megatron_count(spec, pp_rank, vp_stage)
        if count < 0:
            raise ValueError("negative layer count")
        offset = megatron_offset(spec, pp_rank, vp_stage)
        plan[(pp_rank, v)] = range(offset, offset + count)
    nonempty = {key: layers for key, layers in plan.items()}
    if not tiles_exactly_once(nonempty, spec.num_layers):
        raise ValueError("does not cover every layer exactly once")
    return plan


# ------------------------------------------------------------------------------------------------
# Seed rule and Paddle


def uneven_plan(num_layers: int, pp: int, vpp: int) -> dict:
    num_chunks = pp * vpp
    if pp < 1 or vpp < 1 or num_layers < num_chunks:
        raise ValueError("every chunk needs a layer")
    counts = [0] * num_chunks
    for layer in range(num_layers):  # the seed's loop: layer j adds one to chunk j % num_chunks
        counts[layer % num_chunks] += 1
    return plan_from_counts(counts, pp)


def paddle_plan(stage_ids: list[int], pp: int, vpp: int) -> dict:
    if pp < 1 or vpp < 1 or (pp < 2 and vpp > 1):
        raise ValueError("bad sizes")
    per_stage = [0] * pp
    for stage in stage_ids:
        if not 0 <= stage < pp:
            raise ValueError("stage out of range")
        per_stage[stage] += 1
    if any(count < vpp for count in per_stage):
        raise ValueError("a stage has fewer layers than vpp")
    counts = [0] * (pp * vpp)
    for stage in range(pp):
        for i in range(per_stage[stage]):  # round robin over the stage's virtual chunks
            counts[(i % vpp) * pp + stage] += 1
    return plan_from_counts(counts, pp)


# ------------------------------------------------------------------------------------------------
# Layout strings


def parse_layout(layout: str, pp: int) -> list[str]:
    """Expanded stages (global order) of a Megatron layout string."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        if any(char not in "ELtm" for char in stage):
            raise ValueError("invalid layer character")
    if pp < 1 or len(stages) % pp:
        raise ValueError("stage count is not a multiple of pp")
    return stages


def validate_layout(stages: list[str], pp: int, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
    """Megatron's validate_layer_layout; returns mtp_standalone."""
    vpp = len(stages) // pp
    flat = "".join(stages)
    if not flat or flat[0] != "E" or flat[-1] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError("E / L misplaced")
    if flat.count("t") != num_layers:
        raise ValueError("decoder count")
    if not (flat.count("m") == mtp_num_layers or (mtp_num_layers is None and flat.count("m") == 0)):
        raise ValueError("mtp count")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise ValueError("decoder after mtp")
    grid = [[stages[v * pp + p] for v in range(vpp)] for p in range(pp)]
    for p in range(pp):
        if any("m" in grid[p][v] for v in range(vpp - 1)):
            raise ValueError("mtp not in last virtual stage")
        if "m" in grid[p][-1] and grid[p][-1].count("m") != mtp_num_layers:
            raise ValueError("mtp split")
    return any("m" in grid[p][-1] for p in range(pp - 1))


def layout_plan(stages: list[str], pp: int, char: str = "t") -> dict:
    return plan_from_counts([stage.count(char) for stage in stages], pp)


# ------------------------------------------------------------------------------------------------
# Balanced layouts


def sum_in_order(values: list[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total


def chunk_cost(costs: list[float], begin: int, end: int, embedding: float, loss: float) -> float:
    total = embedding if begin == 0 else 0.0
    for cost in costs[begin:end]:  # a plain loop: sum() may compensate rounding (Python >= 3.12)
        total += cost
    if end == len(costs):
        total += loss
    return total


def stage_costs(chunk_costs: list[float], pp: int) -> list[float]:
    out = []
    for stage in range(pp):
        total = 0.0
        for chunk in range(stage, len(chunk_costs), pp):
            total += chunk_costs[chunk]
        out.append(total)
    return out


def brute_force_min_max(costs: list[float], num_chunks: int, embedding: float = 0.0, loss: float = 0.0):
    """(min over all splits of the max chunk cost, min of the max stage cost among those) by trying
    every split; for small inputs."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), num_chunks - 1):
        bounds = (0, *cuts, n)
        chunks = [chunk_cost(costs, bounds[c], bounds[c + 1], embedding, loss) for c in range(num_chunks)]
        key = max(chunks)
        if best is None or key < best:
            best = key
    return best


def brute_force_best_stage(costs: list[float], pp: int, vpp: int, embedding: float, loss: float, max_chunk: float):
    """The lowest max stage cost among splits whose max chunk cost is max_chunk."""
    n, num_chunks = len(costs), pp * vpp
    best = None
    for cuts in itertools.combinations(range(1, n), num_chunks - 1):
        bounds = (0, *cuts, n)
        chunks = [chunk_cost(costs, bounds[c], bounds[c + 1], embedding, loss) for c in range(num_chunks)]
        if max(chunks) != max_chunk:
            continue
        worst_stage = max(stage_costs(chunks, pp))
        best = worst_stage if best is None else min(best, worst_stage)
    return best


def dp_min_max(costs: list[float], num_chunks: int, embedding: float = 0.0, loss: float = 0.0) -> float:
    """min over splits of the max chunk cost, by dynamic programming over (chunks used, prefix)."""
    n = len(costs)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, num_chunks + 1):
        for end in range(k, n + 1):
            for begin in range(k - 1, end):
                if best[k - 1][begin] == inf:
                    continue
                value = max(best[k - 1][begin], chunk_cost(costs, begin, end, embedding, loss))
                if value < best[k][end]:
                    best[k][end] = value
    return best[num_chunks][n]


def _min_chunks(costs: list[float], limit: float, embedding: float, loss: float) -> int:
    n, chunks, begin = len(costs), 0, 0
    while begin < n:
        end = begin
        while end < n and chunk_cost(costs, begin, end + 1, embedding, loss) <= limit:
            end += 1
        if end == begin:
            return n + 1
        chunks += 1
        begin = end
    return chunks


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def balanced_layout(costs: list[float], pp: int, vpp: int, embedding: float = 0.0, loss: float = 0.0):
    """The native algorithm in plain Python: (boundaries, chunk_costs, stage_costs)."""
    n, num_chunks = len(costs), pp * vpp
    if n < num_chunks or any(not (c >= 0 and c != float("inf")) for c in costs):
        raise ValueError("bad costs")
    # smallest limit (as a bit pattern) that fits in num_chunks chunks
    lo, hi = 0, _bits(float("inf"))
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_chunks(costs, _from_bits(mid), embedding, loss) <= num_chunks:
            hi = mid
        else:
            lo = mid + 1
    limit = _from_bits(lo)
    cost = lambda a, b: chunk_cost(costs, a, b, embedding, loss)  # noqa: E731
    earliest = [0] * (num_chunks + 1)
    earliest[num_chunks] = n
    for c in range(num_chunks - 1, 0, -1):
        end = earliest[c + 1]
        candidates = [i for i in range(c, min(end - 1, n - (num_chunks - c)) + 1) if cost(i, end) <= limit]
        earliest[c] = candidates[0]
    # first split: each chunk aims at what keeps its stage on track for total / pp (the stage's
    # earlier chunks' error is made up by its later ones), within the feasible window
    ideal = sum_in_order([embedding, *costs, loss]) / pp
    bounds = [0] * (num_chunks + 1)
    bounds[num_chunks] = n
    stage_so_far = [0.0] * pp
    for c in range(1, num_chunks):
        stage, v = (c - 1) % pp, (c - 1) // pp
        target = (v + 1) * ideal / vpp - stage_so_far[stage]
        reach = bounds[c - 1]
        while reach < n and cost(bounds[c - 1], reach + 1) <= limit:
            reach += 1
        low = max(earliest[c], bounds[c - 1] + 1)
        high = min(reach, n - (num_chunks - c))
        errors = [abs(cost(bounds[c - 1], end) - target) for end in range(low, high + 1)]
        bounds[c] = low + errors.index(min(errors))
        stage_so_far[stage] += cost(bounds[c - 1], bounds[c])
    chunks = [cost(bounds[c], bounds[c + 1]) for c in range(num_chunks)]
    stages = stage_costs(chunks, pp)
    # local search: move boundary k anywhere between its neighbours, or boundaries k and k+1 by up
    # to 2 each; take the move whose costliest stage around k is cheapest, among moves that keep
    # every chunk under the limit and make the costliest changed stage cheaper
    for _ in range(1000 if pp > 1 else 0):
        moved = False
        for k in range(1, num_chunks):
            has_next = k + 1 < num_chunks
            b0, b1, b2 = bounds[k - 1], bounds[k], bounds[k + 1]
            b3 = bounds[k + 2] if has_next else n
            around = [k - 1, k, k + 1] if has_next else [k - 1, k]
            candidates = [(nb1, b2) for nb1 in range(max(b0 + 1, b1 - 256), min(b2 - 1, b1 + 256) + 1) if nb1 != b1]
            if has_next:
                candidates += [(b1 + d1, b2 + d2) for d1 in range(-2, 3) for d2 in range(-2, 3) if d2 != 0]
            best_score, best = float("inf"), None
            for nb1, nb2 in candidates:
                if not (b0 < nb1 < nb2 and (nb2 < b3 if has_next else nb2 == n)):
                    continue
                trial = list(chunks)
                trial[k - 1], trial[k] = cost(b0, nb1), cost(nb1, nb2)
                if has_next:
                    trial[k + 1] = cost(nb2, b3)
                changed = [c for c in around if (c == k - 1 and nb1 != b1) or c == k or (c == k + 1 and nb2 != b2)]
                if any(trial[c] > limit for c in changed):
                    continue
                trial_stages = stage_costs(trial, pp)
                old_changed = max(stages[c % pp] for c in changed)
                new_changed = max(trial_stages[c % pp] for c in changed)
                score = max(trial_stages[c % pp] for c in around)
                if new_changed < old_changed and score < best_score:
                    best_score, best = score, (nb1, nb2, trial, trial_stages)
            if best is not None:
                bounds[k], bounds[k + 1], chunks, stages = best[0], best[1], best[2], best[3]
                moved = True
        if not moved:
            moved = _chain_moves(cost, limit, pp, bounds, chunks, stages)
        if not moved:
            break
    return bounds, chunks, stages


def _chain_moves(cost, limit: float, pp: int, bounds: list[int], chunks: list[float], stages: list[float]) -> bool:
    """Shift boundaries i..j together by one layer; per i take the move with the cheapest costliest
    changed stage if it beats the costliest stage it changes. Updates the lists in place."""
    num_chunks, moved = len(chunks), False
    for i in range(1, num_chunks):
        best, choice = float("inf"), None
        for d in (-1, 1):
            if bounds[i] + d <= bounds[i - 1]:
                continue
            first = cost(bounds[i - 1], bounds[i] + d)
            if first > limit:
                continue
            slid = []  # new costs of chunks i .. j-1
            for j in range(i, min(num_chunks - 1, i + pp) + 1):
                if j > i:
                    moved_chunk = cost(bounds[j - 1] + d, bounds[j] + d)
                    if moved_chunk > limit:
                        break
                    slid.append(moved_chunk)
                if bounds[j] + d >= bounds[j + 1]:
                    continue
                last = cost(bounds[j] + d, bounds[j + 1])
                if last > limit:
                    continue
                trial = list(chunks)
                trial[i - 1:j + 1] = [first, *slid, last]
                trial_stages = stage_costs(trial, pp)
                changed = {c % pp for c in range(i - 1, j + 1)}
                old_max = max(stages[s] for s in changed)
                new_max = max(trial_stages[s] for s in changed)
                if new_max < old_max and new_max < best:
                    best, choice = new_max, (d, j, trial, trial_stages)
        if choice is not None:
            d, j, trial, trial_stages = choice
            for c in range(i, j + 1):
                bounds[c] += d
            chunks[:] = trial
            stages[:] = trial_stages
            moved = True
    return moved
