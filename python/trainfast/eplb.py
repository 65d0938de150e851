"""DeepSeek's expert-parallel load balancer (deepseek-ai/EPLB ``eplb.py``), native and drop-in.

``rebalance_experts`` returns exactly what upstream returns on the same torch build: the two
descending orders upstream takes from torch's non-stable ``sort`` are still taken from torch (on
the same-shaped tensors), and so are the group loads from torch's ``sum`` unless float32 adds
them exactly in any order (integer loads whose group totals are <= 2^24, summed natively);
everything else (greedy packing with tournament trees, replication, index maps) runs natively,
layers in parallel.

Opt-in extras (the default output stays bit-identical):

- ``tie_break="stable"``: fully native and torch-independent; ties go to the lowest index, group
  loads are float32 sums in index order. Reproducible across torch versions; no torch calls (on
  short rows, such as one node's replicas, its native sort costs about as much as torch's).
- ``refine=True``: after the greedy packing, swap replicas between the heaviest GPU of each node
  and the others while that lowers the pair's maximum load (see :func:`balancedness`).
- ``avoid_gpu_duplicates=True``: the greedy skips GPUs that already hold a replica of the same
  expert whenever another non-full GPU does not (upstream issue #22).
- ``previous_phy2log=``: minimal migration: relabel GPUs within a node and reorder slots so that
  experts already on a GPU keep their previous slot (see :func:`count_moved`).

>>> import torch
>>> from trainfast.eplb import rebalance_experts
>>> weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
...                        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
>>> phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
>>> phy2log[0].tolist()
[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import torch

from trainfast import _core
from trainfast._util import (
    UpstreamAssertionError,
    check_bool,
    check_choice,
    check_has_data,
    check_int,
    check_ints_fit_int64,
    resolve_num_threads,
)

__all__ = [
    "balanced_packing",
    "balancedness",
    "count_moved",
    "gpu_loads",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
]

logger = logging.getLogger(__name__)

TieBreak = Literal["torch", "stable"]
_TIE_BREAKS = ("torch", "stable")
_EMPTY_F32 = np.empty(0, dtype=np.float32)
_EMPTY_I64 = np.empty(0, dtype=np.int64)


def _count(value: Any, name: str) -> int:
    """A positive int argument; upstream asserts on these, so the error is also an AssertionError."""
    value = check_int(value, name)
    if value <= 0:
        raise UpstreamAssertionError(f"{name} must be positive (got {value})")
    if value >= 2**62:  # the native core takes int64; no real count comes near
        raise ValueError(f"{name} must be < 2^62 (got {value})")
    return value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UpstreamAssertionError(message)


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        check_has_data(value, name)
        value = value.detach()
        if value.data_ptr() % value.element_size() != 0:  # a view at an odd byte offset: copied, aligned
            value = value.clone()
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf" or value.dtype.itemsize > 8:
            raise TypeError(f"{name} must have a real numeric dtype of at most 64 bits (got NumPy {value.dtype})")
        if not value.dtype.isnative:  # torch takes native byte order only
            value = value.astype(value.dtype.newbyteorder("="))
        return torch.from_numpy(np.require(value, requirements=["C", "A"]))  # a view at an odd byte offset: copied
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a torch tensor, NumPy array or nested sequence (got {type(value).__name__})")
    if isinstance(value, (list, tuple)) and value and all(isinstance(row, torch.Tensor) for row in value):
        for row in value:
            check_has_data(row, name)
        try:  # torch.tensor() takes no list of tensors
            return torch.stack([row.detach().cpu() for row in value])
        except RuntimeError as error:
            raise ValueError(f"{name} must be a rectangular nested sequence of numbers ({error})") from None
    try:
        return torch.tensor(value)
    except ValueError as error:  # ragged nesting, or an int past int64
        try:
            objects = np.array(value, dtype=object)
        except ValueError:
            objects = None
        if objects is not None:
            check_ints_fit_int64(objects, name)
        raise ValueError(f"{name} must be a rectangular nested sequence of numbers ({error})") from None
    except (TypeError, RuntimeError) as error:  # not numbers
        raise TypeError(f"{name} must be a nested sequence of numbers ({error})") from None


def _weight_2d(weight: Any, allow_empty: bool = False) -> torch.Tensor:
    tensor = _as_tensor(weight, "weight")
    if tensor.dtype.is_complex:
        raise TypeError(f"weight must have a real dtype (got {tensor.dtype})")
    if tensor.dim() != 2:
        raise UpstreamAssertionError(f"weight must be 2-D [num_layers, num_logical_experts] (got shape "
                                     f"{tuple(tensor.shape)})")
    if not allow_empty and (tensor.shape[0] == 0 or tensor.shape[1] == 0):
        raise UpstreamAssertionError(f"weight must not be empty (got shape {tuple(tensor.shape)})")
    return tensor


def _float32_cpu(weight: torch.Tensor) -> torch.Tensor:
    """Upstream's ``weight.float().cpu()``, made contiguous for the native core."""
    return weight.float().cpu().contiguous()


_NATIVE_INT_DTYPES = (torch.int64, torch.int32)


def _float32_loads(weight: torch.Tensor, num_groups: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(upstream's ``weight.float().cpu()`` as a float32 array, the `[num_layers, num_groups]` group
    loads or None). Integer CPU loads convert natively (same IEEE rounding, faster than torch) and
    come with their group sums when float32 adds them exactly in any order, so that they equal
    torch's; otherwise (None) the caller takes the sums from torch. A strided weight's sums are
    taken here, from torch on upstream's strided tensor: torch adds a strided row in another order."""
    if weight.dtype in _NATIVE_INT_DTYPES and weight.device.type == "cpu":
        values, loads = _core.eplb_int_loads(weight.contiguous().numpy(), num_groups)
        if loads is None and num_groups > 1 and not weight.is_contiguous():
            loads = _group_sums(weight.float(), num_groups)
        return values, loads
    upstream = weight.float().cpu()
    loads = _group_sums(upstream, num_groups) if num_groups > 1 and not upstream.is_contiguous() else None
    return upstream.contiguous().numpy(), loads


def _orders_groups(tie_break: str, num_groups: int, num_nodes: int) -> bool:
    """Whether the placement sorts each node's groups by load with torch (upstream's tie order)."""
    return tie_break == "torch" and num_groups // num_nodes > 1


def _group_sums(upstream: torch.Tensor, num_groups: int) -> np.ndarray:
    """Upstream's ``weight.unflatten(-1, (num_groups, group_size)).sum(-1)``, float32 `[num_layers, num_groups]`."""
    grouped = upstream.unflatten(-1, (num_groups, upstream.shape[-1] // num_groups))
    return grouped.sum(-1).contiguous().numpy()


def _check_hierarchical(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                        physical_name: str) -> None:
    """Upstream's asserts of the hierarchical policy (messages built only on failure)."""
    if num_logical % num_groups:
        raise UpstreamAssertionError(f"num_groups must divide the number of logical experts (got "
                                     f"num_groups={num_groups}, {num_logical} experts)")
    if num_groups % num_nodes:
        raise UpstreamAssertionError(f"num_nodes must divide num_groups (got num_nodes={num_nodes}, "
                                     f"num_groups={num_groups})")
    if num_gpus % num_nodes:
        raise UpstreamAssertionError(f"num_gpus must be a multiple of num_nodes (got num_gpus={num_gpus}, "
                                     f"num_nodes={num_nodes})")
    if num_physical % num_gpus:
        raise UpstreamAssertionError(f"{physical_name} must be a multiple of num_gpus (got "
                                     f"{physical_name}={num_physical}, num_gpus={num_gpus})")
    if num_physical < num_logical:
        raise UpstreamAssertionError(f"{physical_name} must be >= the number of logical experts (got "
                                     f"{physical_name}={num_physical}, {num_logical} experts)")
    if num_physical >= 2**31:  # the native planner's slot indices are 32-bit
        raise ValueError(f"{physical_name} must be < 2^31 (got {num_physical})")


def _descending_order(values: torch.Tensor) -> np.ndarray:
    """Upstream's ``values.float().sort(-1, descending=True).indices`` (torch's tie order)."""
    # contiguous: a transposed weight's sort indices are a transposed view
    return np.ascontiguousarray(values.float().sort(-1, descending=True).indices.cpu().numpy())


def _descending_order_f32(values: np.ndarray) -> np.ndarray:
    """The same for a float32 CPU array (``.float()`` and ``.cpu()`` would be no-ops)."""
    return torch.sort(torch.from_numpy(values), -1, True).indices.numpy()


def _run(weight: np.ndarray, group_loads: np.ndarray | None, num_physical: int, num_groups: int, num_nodes: int,
         num_gpus: int, *, tie_break: str, refine: bool, avoid_gpu_duplicates: bool,
         num_threads: int | None) -> tuple[np.ndarray, ...]:
    """Both stages on float32 CPU ``weight`` (group_loads: torch's group sums, or None to take them from
    torch here); returns numpy (phy2log, log2phy, logcnt, phyrank)."""
    threads = resolve_num_threads(num_threads)
    group_order = _EMPTY_I64
    if _orders_groups(tie_break, num_groups, num_nodes):
        if group_loads is None:
            group_loads = _group_sums(torch.from_numpy(weight), num_groups)
        group_order = _descending_order_f32(group_loads)
    else:
        group_loads = _EMPTY_F32
    replication = _core.eplb_replicate(weight, num_physical, num_groups, num_nodes, num_gpus, group_loads,
                                       group_order, threads)
    replica_order = _EMPTY_I64
    if tie_break == "torch" and num_physical // num_gpus > 1:
        replica_order = _descending_order_f32(replication.replica_loads)
    return _core.eplb_place(replication, replica_order, bool(refine), bool(avoid_gpu_duplicates), threads)


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int | None,
    num_nodes: int | None,
    num_gpus: int,
    enable_hierarchical: bool | None = None,
    *,
    tie_break: TieBreak = "torch",
    refine: bool = False,
    avoid_gpu_duplicates: bool = False,
    previous_phy2log: Any = None,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entry point of the load balancer; same arguments and outputs as upstream.

    Args:
        weight: `[num_layers, num_logical_experts]` loads, any real dtype and device (used as float32
            CPU, like upstream). NaN, infinite or negative loads raise ValueError.
        num_replicas: physical experts per layer, a multiple of ``num_gpus``, >= the logical experts.
        num_groups: expert groups; the hierarchical policy runs when ``num_groups % num_nodes == 0``,
            else the global one (one group, one node). Unused (any value, e.g. None) when
            ``enable_hierarchical`` is False, as in SGLang.
        num_nodes: server nodes (fast intra-node network); unused, like ``num_groups``, when
            ``enable_hierarchical`` is False.
        num_gpus: GPUs, a multiple of ``num_nodes`` (hierarchical policy).
        enable_hierarchical: SGLang's variant of the API: forces the policy (None: DeepSeek's rule).
        tie_break: ``"torch"`` (default, bit-identical to upstream on this torch) or ``"stable"``.
        refine: swap replicas to lower each node's heaviest GPU after the greedy packing.
        avoid_gpu_duplicates: keep replicas of one expert on distinct GPUs where the greedy can.
        previous_phy2log: `[num_layers, num_replicas]` current placement: the GPUs of each node are
            relabelled (the matching that keeps the most slots) and each GPU's slots reordered so
            that experts already there keep their slot; balance is unchanged (see :func:`count_moved`).
        num_threads: threads for the layers (default $TRAINFAST_NUM_THREADS or all cores).

    Returns:
        ``(phy2log, log2phy, logcnt)``, int64 CPU contiguous: `[num_layers, num_replicas]` logical
        expert of each slot; `[num_layers, num_logical_experts, max_count]` slots of each expert by
        replica rank, -1 padded; `[num_layers, num_logical_experts]` replicas per expert.

    Raises:
        UpstreamAssertionError (both ValueError and AssertionError) where upstream asserts, naming
        the argument; ValueError naming the layer and expert of a bad load.
    """
    tensor = _weight_2d(weight)
    num_replicas = _count(num_replicas, "num_replicas")
    num_gpus = _count(num_gpus, "num_gpus")
    check_choice(tie_break, "tie_break", _TIE_BREAKS)
    refine = check_bool(refine, "refine")
    avoid_gpu_duplicates = check_bool(avoid_gpu_duplicates, "avoid_gpu_duplicates")
    num_logical = tensor.shape[1]
    # Upstream's global policy is the hierarchical one with one group and one node. SGLang passes
    # num_groups=None for models without expert groups, with enable_hierarchical=False: then neither
    # num_groups nor num_nodes is read.
    groups, nodes = 1, 1
    if enable_hierarchical is None or bool(enable_hierarchical):
        checked_groups = _count(num_groups, "num_groups")
        checked_nodes = _count(num_nodes, "num_nodes")
        if enable_hierarchical is not None or checked_groups % checked_nodes == 0:
            groups, nodes = checked_groups, checked_nodes
    _check_hierarchical(num_logical, num_replicas, groups, nodes, num_gpus, "num_replicas")
    # Checked before the plan is made, which takes seconds at scale.
    previous = None if previous_phy2log is None else _previous_placement(previous_phy2log,
                                                                         (tensor.shape[0], num_replicas))
    sum_groups = groups if _orders_groups(tie_break, groups, nodes) else 0
    phy2log, log2phy, logcnt, phyrank = _run(
        *_float32_loads(tensor, sum_groups), num_replicas, groups, nodes, num_gpus, tie_break=tie_break,
        refine=refine, avoid_gpu_duplicates=avoid_gpu_duplicates, num_threads=num_threads)
    if previous is not None:
        phy2log, log2phy = _keep_previous_slots(previous, phy2log, phyrank, log2phy.shape,
                                                num_replicas // num_gpus, num_gpus // nodes,
                                                resolve_num_threads(num_threads))
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)


def rebalance_experts_hierarchical(
    weight: Any,
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    tie_break: TieBreak = "torch",
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream's hierarchical policy on float32 ``weight`` `[num_layers, num_logical_experts]`.

    Returns ``(phy2log, phyrank, logcnt)``: `[num_layers, num_physical_experts]` logical expert and
    replica rank of each slot, `[num_layers, num_logical_experts]` replica counts; int64 CPU.
    Other dtypes raise TypeError (upstream's arithmetic would differ; ``rebalance_experts`` casts).
    """
    tensor = _weight_2d(weight)
    if tensor.dtype != torch.float32:
        raise TypeError(f"weight must be float32 here, as rebalance_experts passes it (got {tensor.dtype})")
    num_physical_experts = _count(num_physical_experts, "num_physical_experts")
    num_groups = _count(num_groups, "num_groups")
    num_nodes = _count(num_nodes, "num_nodes")
    num_gpus = _count(num_gpus, "num_gpus")
    check_choice(tie_break, "tie_break", _TIE_BREAKS)
    _check_hierarchical(tensor.shape[1], num_physical_experts, num_groups, num_nodes, num_gpus,
                        "num_physical_experts")
    sum_groups = num_groups if _orders_groups(tie_break, num_groups, num_nodes) else 0
    phy2log, _, logcnt, phyrank = _run(
        *_float32_loads(tensor, sum_groups), num_physical_experts, num_groups, num_nodes, num_gpus,
        tie_break=tie_break, refine=False, avoid_gpu_duplicates=False, num_threads=num_threads)
    return torch.from_numpy(phy2log), torch.from_numpy(phyrank), torch.from_numpy(logcnt)


# Narrow integer weights are summed in int64 here; upstream's pack sums stay in their dtype.
NARROW_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.uint8)
# The weight dtypes of balanced_packing / replicate_experts: upstream computes in the weight's own
# dtype, and the native core reproduces that arithmetic for these.
HELPER_DTYPES = (torch.float32, torch.float64, torch.int64, *NARROW_INT_DTYPES)


def _helper_weight(weight: Any) -> tuple[torch.Tensor, np.ndarray]:
    """(tensor, numpy array in the dtype whose arithmetic matches upstream's on this tensor)."""
    tensor = _weight_2d(weight, allow_empty=True)  # upstream's helpers answer an empty weight with empty tables
    if tensor.dtype in (torch.float32, torch.float64, torch.int64):
        native = tensor.cpu().contiguous()
    elif tensor.dtype in NARROW_INT_DTYPES:
        native = tensor.cpu().to(torch.int64).contiguous()  # same result unless upstream's narrow sums overflow
    else:
        raise TypeError(f"weight must be float32, float64, int64, int32, int16, int8 or uint8 (got {tensor.dtype})")
    if native.is_floating_point() and bool(torch.isnan(native).any()):
        layer, expert = (int(i) for i in torch.nonzero(torch.isnan(native))[0])
        raise ValueError(f"weight[{layer}, {expert}] is NaN (layer {layer}, expert {expert})")
    return tensor, native.numpy()


def balanced_packing(weight: Any, num_packs: int, *, num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs each row's items into ``num_packs`` packs of equal size, heaviest first.

    Args:
        weight: `[rows, n]` item weights (float32/float64/integer); ``n % num_packs == 0``. With
            no rows or no items the tables are empty, as upstream's.
            Narrower integers (int8/16/32, uint8) are summed as int64, where upstream's pack sums
            would wrap in the narrow dtype: equal results unless a pack's load overflows it.
        num_packs: number of packs.

    Returns:
        ``(pack_index, rank_in_pack)``, int64 CPU `[rows, n]`: each item's pack and arrival rank.
    """
    tensor, native = _helper_weight(weight)
    num_packs = _count(num_packs, "num_packs")
    num_rows, num_items = tensor.shape
    _require(num_items % num_packs == 0,
             f"num_packs must divide the number of items (got num_packs={num_packs}, {num_items} items)")
    if num_items == num_packs:  # one item per pack: upstream skips the sort
        return (torch.arange(num_items, dtype=torch.int64).repeat(num_rows, 1),
                torch.zeros(num_rows, num_items, dtype=torch.int64))
    if native.size == 0:
        return (torch.empty(num_rows, num_items, dtype=torch.int64),
                torch.empty(num_rows, num_items, dtype=torch.int64))
    order = _descending_order(tensor)
    pack_index, rank_in_pack = _core.eplb_balanced_packing(native, order, num_packs, resolve_num_threads(num_threads))
    return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)


def replicate_experts(weight: Any, num_phy: int, *, num_threads: int | None = None) -> tuple[torch.Tensor, ...]:
    """Adds ``num_phy - num_log`` replicas, each to the expert with the largest load per replica.

    Args:
        weight: `[rows, num_log]` loads (float32/float64/integer; integers divide in float32 as torch).
            With no rows the tables are empty, as upstream's; a row needs at least one expert.
        num_phy: replicas per row, >= ``num_log``.

    Returns:
        ``(phy2log [rows, num_phy], rank [rows, num_phy], logcnt [rows, num_log])``, int64 CPU.
    """
    _, native = _helper_weight(weight)
    num_phy = _count(num_phy, "num_phy")
    num_rows, num_log = native.shape
    _require(num_phy >= num_log,
             f"num_phy must be >= the number of logical experts (got num_phy={num_phy}, {num_log} experts)")
    if num_rows == 0:
        return (torch.empty(0, num_phy, dtype=torch.int64), torch.empty(0, num_phy, dtype=torch.int64),
                torch.empty(0, num_log, dtype=torch.int64))
    # No expert to replicate (upstream fails in torch's max over an empty row).
    _require(num_log > 0, f"weight must have at least one logical expert per row (got shape {tuple(native.shape)})")
    outputs = _core.eplb_replicate_experts(native, num_phy, resolve_num_threads(num_threads))
    return tuple(torch.from_numpy(x) for x in outputs)


# --- beyond upstream -------------------------------------------------------------------------------

def _placement_table(value: Any, name: str) -> np.ndarray:
    """An integer 2-D placement table (phy2log, logcnt, ...) as int64 NumPy."""
    if isinstance(value, torch.Tensor):
        check_has_data(value, name)
        value = value.detach().cpu()
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype (got {value.dtype})")
        value = value.contiguous().numpy()
    elif isinstance(value, (str, bytes)) or not (isinstance(value, np.ndarray) or hasattr(value, "__len__")):
        raise TypeError(f"{name} must be a torch tensor, NumPy array or nested sequence "
                        f"(got {type(value).__name__} {value!r})")
    else:
        try:
            value = np.asarray(value)
        except ValueError as exc:  # ragged nesting
            raise ValueError(f"{name} must be a rectangular 2-D table ({exc})") from None
        if value.size == 0 and value.dtype.kind == "f":
            value = value.astype(np.int64)
        if value.dtype == object:  # NumPy's fallback for an int past 64 bits: name that value
            check_ints_fit_int64(value, name)
    if value.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype (got {value.dtype})")
    if value.ndim != 2:
        raise ValueError(f"{name} must be 2-D (got shape {tuple(value.shape)})")
    if value.dtype.kind == "u" and value.size and value.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has values that do not fit in int64 (max {value.max()})")
    return np.require(value, dtype=np.int64, requirements=["C", "A"])


def gpu_loads(weight: Any, phy2log: Any, logcnt: Any, num_gpus: int) -> np.ndarray:
    """float64 `[num_layers, num_gpus]`: each GPU's load, every replica carrying load / count.

    Args:
        weight: `[num_layers, num_logical]` loads (any real dtype, bool included; finite and >= 0 once
            made float32).
        phy2log: `[num_layers, num_physical]` integer logical expert of each slot, in ``[0, num_logical)``;
            ``num_physical`` divisible by ``num_gpus``.
        logcnt: `[num_layers, num_logical]` integer replica count of each logical expert, >= 1.
        num_gpus: positive int.
    """
    tensor = _weight_2d(weight)  # any real dtype, bool included, as rebalance_experts takes it
    w = _float32_cpu(tensor).numpy().astype(np.float64)
    bad = ~(np.isfinite(w) & (w >= 0))  # as rebalance_experts: an inf or negative load gives a meaningless ratio
    if bad.any():
        layer, expert = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"weight[{layer}, {expert}] must be a finite, non-negative load (got {w[layer, expert]})")
    p2l = _placement_table(phy2log, "phy2log")
    cnt = _placement_table(logcnt, "logcnt")
    num_gpus = _count(num_gpus, "num_gpus")
    num_layers, num_logical = w.shape
    if p2l.shape[0] != num_layers or p2l.shape[1] == 0:
        raise ValueError(f"phy2log must have shape [{num_layers}, num_physical > 0] to match weight "
                         f"(got shape {tuple(p2l.shape)})")
    if cnt.shape != w.shape:
        raise ValueError(f"logcnt must have the shape of weight {tuple(w.shape)} (got shape {tuple(cnt.shape)})")
    if p2l.shape[1] % num_gpus:
        raise ValueError(f"num_gpus must divide the number of physical experts "
                         f"(got num_gpus={num_gpus}, {p2l.shape[1]} physical experts)")
    bad = (p2l < 0) | (p2l >= num_logical)
    if bad.any():
        layer, slot = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"phy2log[{layer}, {slot}] must be in [0, {num_logical}) (got {p2l[layer, slot]})")
    if (cnt < 1).any():
        layer, expert = (int(i) for i in np.argwhere(cnt < 1)[0])
        raise ValueError(f"logcnt[{layer}, {expert}] must be >= 1 (got {cnt[layer, expert]})")
    per_replica = np.take_along_axis(w / cnt, p2l, axis=1)
    return per_replica.reshape(num_layers, num_gpus, -1).sum(-1)


def balancedness(weight: Any, phy2log: Any, logcnt: Any, num_gpus: int) -> float:
    """Mean over layers of max / mean GPU load (1.0 is perfect; layers without load count as 1).

    Arguments as :func:`gpu_loads`: ``weight`` `[num_layers, num_logical]`, ``phy2log``
    `[num_layers, num_physical]`, ``logcnt`` `[num_layers, num_logical]` (e.g. the first and third
    outputs of :func:`rebalance_experts`).
    """
    loads = gpu_loads(weight, phy2log, logcnt, num_gpus)
    mean = loads.mean(-1)
    ratio = np.where(mean > 0, loads.max(-1) / np.where(mean > 0, mean, 1.0), 1.0)
    return float(ratio.mean())


def _gpu_targets(new_gpus: np.ndarray, old_gpus: np.ndarray, num_logical: int, gpus_per_node: int,
                 num_threads: int) -> np.ndarray:
    """For each layer, a permutation of the GPUs inside each node (new GPU -> GPU index it takes)
    that keeps the most slots: a new and an old GPU share min(new count, old count) slots of each
    expert. Among the best permutations, the one leaving the most GPUs in place. Balance is
    unchanged: GPUs of one node are interchangeable.

    ``new_gpus``, ``old_gpus``: int64 `[num_layers, num_gpus, slots_per_gpu]`; returns int64
    `[num_layers, num_gpus]`."""
    num_layers, num_gpus, slots_per_gpu = new_gpus.shape
    num_nodes = num_gpus // gpus_per_node
    # A new GPU keeps the j-th replica of expert e on an old GPU of its node holding a j-th e: count
    # the pairs of slots with equal (layer, node, expert, occurrence) keys, one new and one old.
    node_of = np.repeat(np.arange(num_gpus) // gpus_per_node, slots_per_gpu)
    row_node = (np.arange(num_layers)[:, None] * num_nodes + node_of).reshape(-1, num_gpus, slots_per_gpu)

    def keys(experts: np.ndarray, occurrence: np.ndarray) -> np.ndarray:
        return ((row_node * num_logical + experts) * slots_per_gpu + occurrence).ravel()

    flat = (num_layers * num_gpus, slots_per_gpu)
    valid = (old_gpus >= 0) & (old_gpus < num_logical)  # other ids (-1: an empty slot) match nothing
    old_keys = keys(np.where(valid, old_gpus, 0),
                    _occurrence(old_gpus.reshape(flat)).reshape(old_gpus.shape))[valid.ravel()]
    old_gpu = np.broadcast_to(np.arange(num_gpus)[:, None], old_gpus.shape).ravel()[valid.ravel()]
    by_key = np.argsort(old_keys, kind="stable")
    old_keys, old_gpu = old_keys[by_key], old_gpu[by_key]
    new_keys = keys(new_gpus, _occurrence(new_gpus.reshape(flat)).reshape(new_gpus.shape))
    first = np.searchsorted(old_keys, new_keys, side="left")
    matches = np.searchsorted(old_keys, new_keys, side="right") - first
    # One (new slot, old slot) pair per match: its cell (layer, new GPU, old GPU in the node).
    new_cell = np.arange(new_keys.size) // slots_per_gpu  # layer * num_gpus + new GPU
    pair_new = np.repeat(new_cell, matches)
    pair_old = old_gpu[np.repeat(first - np.cumsum(matches) + matches, matches) + np.arange(matches.sum())]
    cell = pair_new * gpus_per_node + pair_old % gpus_per_node
    weight = np.bincount(cell, minlength=num_layers * num_gpus * gpus_per_node).astype(np.int64)
    weight = weight.reshape(num_layers, num_nodes, gpus_per_node, gpus_per_node)
    # Kept slots first; staying in place (at most gpus_per_node in all) only breaks ties.
    weight *= gpus_per_node + 1
    weight += np.eye(gpus_per_node, dtype=np.int64)
    within_node = _core.eplb_max_weight_assignment(weight.reshape(-1, gpus_per_node, gpus_per_node), num_threads)
    first_gpu = (np.arange(num_nodes) * gpus_per_node)[:, None]
    return (within_node.reshape(num_layers, num_nodes, gpus_per_node) + first_gpu).reshape(num_layers, num_gpus)


def _previous_placement(previous_phy2log: Any, shape: tuple[int, int]) -> np.ndarray:
    """``previous_phy2log`` as an int64 array of ``shape`` `[num_layers, num_replicas]`."""
    previous = _as_tensor(previous_phy2log, "previous_phy2log")
    if previous.dtype.is_floating_point or previous.dtype.is_complex or previous.dtype == torch.bool:
        raise TypeError(f"previous_phy2log must have an integer dtype (got {previous.dtype})")
    if tuple(previous.shape) != shape:
        raise ValueError(f"previous_phy2log must have shape {shape} (got {tuple(previous.shape)})")
    return previous.cpu().to(torch.int64).numpy()


def _occurrence(values: np.ndarray) -> np.ndarray:
    """For each element of each row of ``values`` `[rows, n]`, how many equal elements precede it in
    its row (int64, same shape)."""
    order = np.argsort(values, axis=-1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=-1)
    position = np.broadcast_to(np.arange(values.shape[-1]), values.shape)
    new_run = np.ones(values.shape, dtype=bool)
    new_run[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run_start = np.maximum.accumulate(np.where(new_run, position, 0), axis=-1)
    occurrence = np.empty(values.shape, dtype=np.int64)
    np.put_along_axis(occurrence, order, position - run_start, axis=-1)
    return occurrence


def _order_slots(previous: np.ndarray, phy2log: np.ndarray, phyrank: np.ndarray, targets: np.ndarray,
                 slots_per_gpu: int, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """Moves each new GPU's slots to the GPU ``targets`` names and orders them there: in slot order,
    each (expert, rank) entry takes the first slot still free whose ``previous`` expert is its own;
    the other entries fill the free slots in order. ``previous``, ``phy2log``, ``phyrank``: int64
    `[num_layers, num_slots]`; ``targets``: int64 `[num_layers, num_gpus]`. Returns the new
    ``(phy2log, phyrank)``, same shapes."""
    num_layers, num_slots = phy2log.shape
    num_gpus = num_slots // slots_per_gpu
    rows = num_layers * num_gpus
    layer = np.arange(num_layers)[:, None]
    new = np.empty((num_layers, num_gpus, slots_per_gpu), dtype=np.int64)
    rank = np.empty_like(new)
    new[layer, targets] = phy2log.reshape(num_layers, num_gpus, slots_per_gpu)
    rank[layer, targets] = phyrank.reshape(num_layers, num_gpus, slots_per_gpu)
    new, rank, old = new.reshape(rows, -1), rank.reshape(rows, -1), previous.reshape(rows, -1)

    # The j-th entry of expert e on a GPU takes the slot of the j-th previous e there, if any: one
    # key per (GPU, expert, occurrence), unique on each side.
    def keys(experts: np.ndarray, occurrence: np.ndarray) -> np.ndarray:
        return ((np.arange(rows)[:, None] * num_logical + experts) * slots_per_gpu + occurrence).ravel()

    valid = (old >= 0) & (old < num_logical)  # other ids (-1: an empty slot) match nothing
    old_keys = keys(np.where(valid, old, 0), _occurrence(old))[valid.ravel()]
    old_slots = np.flatnonzero(valid)
    by_key = np.argsort(old_keys)
    old_keys, old_slots = old_keys[by_key], old_slots[by_key]
    new_keys = keys(new, _occurrence(new))
    found_at = np.minimum(np.searchsorted(old_keys, new_keys), max(len(old_keys) - 1, 0))
    kept = old_keys[found_at] == new_keys if len(old_keys) else np.zeros(new_keys.shape, dtype=bool)
    slot = np.empty(new_keys.shape, dtype=np.int64)
    slot[kept] = old_slots[found_at[kept]]
    taken = np.zeros(new_keys.shape, dtype=bool)
    taken[slot[kept]] = True
    # Every GPU has as many free slots as entries left, so in flat order each entry left meets a
    # free slot of its own GPU.
    slot[~kept] = np.flatnonzero(~taken)
    out_phy2log = np.empty(rows * slots_per_gpu, dtype=np.int64)
    out_rank = np.empty_like(out_phy2log)
    out_phy2log[slot] = new.ravel()
    out_rank[slot] = rank.ravel()
    return out_phy2log.reshape(num_layers, num_slots), out_rank.reshape(num_layers, num_slots)


def _keep_previous_slots(previous: np.ndarray, phy2log: np.ndarray, phyrank: np.ndarray,
                         log2phy_shape: tuple[int, ...], slots_per_gpu: int,
                         gpus_per_node: int, num_threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Minimal migration: permutes the GPUs inside each node, then each GPU's slots, so that as many
    experts as possible stay in the slot they had in ``previous`` (the checked ``previous_phy2log``)."""
    num_layers, num_slots = phy2log.shape
    num_gpus = num_slots // slots_per_gpu
    targets = _gpu_targets(phy2log.reshape(num_layers, num_gpus, slots_per_gpu),
                           previous.reshape(num_layers, num_gpus, slots_per_gpu), log2phy_shape[1], gpus_per_node,
                           num_threads)
    new_phy2log, new_rank = _order_slots(previous, phy2log, phyrank, targets, slots_per_gpu, log2phy_shape[1])
    log2phy = np.full(log2phy_shape, -1, dtype=np.int64)
    layers = np.repeat(np.arange(num_layers), num_slots)
    log2phy[layers, new_phy2log.ravel(), new_rank.ravel()] = np.tile(np.arange(num_slots), num_layers)
    moved = count_moved(previous, new_phy2log)
    logger.info("rebalance_experts: %d of %d slots change expert", moved, new_phy2log.size)
    return new_phy2log, log2phy


def count_moved(previous_phy2log: Any, phy2log: Any) -> int:
    """Number of physical slots whose logical expert changes (experts to migrate).

    Both are `[num_layers, num_physical]` integer tables of the same shape.
    """
    previous = _placement_table(previous_phy2log, "previous_phy2log")
    current = _placement_table(phy2log, "phy2log")
    if previous.shape != current.shape:
        raise ValueError(f"previous_phy2log must have the shape of phy2log {tuple(current.shape)} "
                         f"(got shape {tuple(previous.shape)})")
    return int((previous != current).sum())


# --- torch.library custom op (works under torch.compile) ---------------------------------------------

def _register_torch_op() -> Any:
    """Registers ``torch.ops.trainfast.rebalance_experts`` (default mode) with a fake implementation."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:  # torch < 2.4
        return None

    @custom_op("trainfast::rebalance_experts", mutates_args=(), device_types=None)
    def rebalance_experts_op(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                             num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
        return phy2log.clone(), log2phy.clone(), logcnt.clone()  # the op owns fresh storage

    @rebalance_experts_op.register_fake
    def _(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
          num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_layers, num_logical = weight.shape
        max_count = torch.library.get_ctx().new_dynamic_size(min=1)  # data-dependent width of log2phy
        cpu = torch.device("cpu")
        return (weight.new_empty((num_layers, num_replicas), dtype=torch.int64, device=cpu),
                weight.new_empty((num_layers, num_logical, max_count), dtype=torch.int64, device=cpu),
                weight.new_empty((num_layers, num_logical), dtype=torch.int64, device=cpu))

    return rebalance_experts_op


try:
    rebalance_experts_op = _register_torch_op()
except RuntimeError as error:  # already registered (module reloaded)
    logger.debug("torch.ops.trainfast.rebalance_experts not re-registered: %s", error)
    rebalance_experts_op = getattr(getattr(torch.ops, "trainfast", None), "rebalance_experts", None)
