"""Gradient-bucket planning: Megatron DDP / distributed-optimizer buffer layout, bucket groups and
per-rank shard ranges.

Megatron lays every buffer's params out in reverse model order (roughly backprop order). With the
distributed optimizer each param starts 64-element aligned, a ``shared_embedding`` param sits alone in
its bucket, and bucket ends are padded to ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
``pad_buckets_for_high_nccl_busbw``); each bucket is then cut into ``dp`` equal shards, one per rank.

Two APIs:

- drop-ins with Megatron's signatures (:func:`compute_full_param_layout`,
  :func:`compute_per_buffer_param_layout`, :func:`compute_default_per_buffer_param_layout`,
  :func:`group_params_for_buffers`, :func:`partition_buckets` and the distributed optimizer's range
  builders), returning Megatron's own dataclasses when megatron-core has them;
- an array API for tools and huge models, O(params + ranks * buckets): :func:`plan_layout`,
  :func:`shard_ranges`, :func:`partition_bucket_indices`, :func:`materialize`.

>>> from trainfast.buckets import plan_layout, shard_ranges
>>> layout = plan_layout([5000, 5000, 5000], bucket_size=8000, data_parallel_world_size=2)
>>> layout.param_start.tolist(), layout.bucket_indices.tolist()
([10112, 5056, 0], [[0, 10112], [10112, 15232]])
>>> ranges = shard_ranges(layout, 2, rank=1)
>>> ranges.gbuf_world[-1].tolist(), ranges.param_range[-1].tolist()
([12672, 15112], [2560, 5000])
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from trainfast import _core
from trainfast._util import (
    INT64_MAX,
    UpstreamAssertionError,
    UpstreamIndexError,
    as_array,
    check_attrs,
    check_bool,
    check_int,
    resolve_num_threads,
    to_tensor,
)

__all__ = [
    "BucketGroups",
    "BufferKey",
    "FullParamLayout",
    "Materialized",
    "ParamLayout",
    "PerBufferParamLayout",
    "ShardRangeTable",
    "build_model_gbuf_param_range_map",
    "build_model_gbuf_range",
    "compute_default_per_buffer_param_layout",
    "compute_full_param_layout",
    "compute_per_buffer_param_layout",
    "default_bucket_size",
    "group_params_for_buffers",
    "materialize",
    "partition_bucket_indices",
    "partition_buckets",
    "plan_layout",
    "shard_ranges",
]


# --- Megatron's dataclasses (its own when importable) -------------------------------------------

@dataclass(frozen=True)
class BufferKey:
    """Identifies one contiguous buffer: storage dtype, grad dtype, expert-parallel flag (megatron's
    own class is used instead when megatron-core has it)."""

    param_dtype: Any
    grad_dtype: Any
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


@dataclass
class PerBufferParamLayout:
    """param_index_map {param: (start, end, bucket_id)}, bucket_indices, unpadded sizes."""

    param_index_map: dict = field(default_factory=dict)
    bucket_indices: list = field(default_factory=list)
    per_bucket_numel_unpadded: list = field(default_factory=list)
    param_indices: list = field(default_factory=list)
    num_optimizer_shards: int | None = None


@dataclass
class FullParamLayout:
    """{BufferKey: PerBufferParamLayout} for one model chunk."""

    layouts: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _dataclasses() -> tuple[Any, Any, Any]:
    """(BufferKey, PerBufferParamLayout, FullParamLayout): megatron's own when it has them."""
    import importlib.util

    if importlib.util.find_spec("megatron") is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron's import-time notices (no TE/Apex, ...)
                from megatron.core.optimizer import param_layout
            return param_layout.BufferKey, param_layout.PerBufferParamLayout, param_layout.FullParamLayout
        except ImportError:
            pass
    return BufferKey, PerBufferParamLayout, FullParamLayout


def default_bucket_size(data_parallel_world_size: int) -> int:
    """Megatron DDP's default bucket size: max(40M, 1M * dp) elements."""
    dp = check_int(data_parallel_world_size, "data_parallel_world_size", min_value=1, max_value=INT64_MAX)
    return max(40_000_000, 1_000_000 * dp)


# --- array API ------------------------------------------------------------------------------------


def _check_bucket_size(bucket_size: Any) -> int | None:
    if bucket_size is None:
        return None
    if isinstance(bucket_size, np.floating) and not isinstance(bucket_size, float):
        # A narrower float compares in its own precision (39999998 >= float32(4e7)), per NumPy version.
        raise TypeError(f"bucket_size must be an int, a Python float or None (got {type(bucket_size).__name__})")
    if isinstance(bucket_size, float):  # np.float64 too
        # Megatron only compares an int element count with it (``>= bucket_size``), exactly for a
        # double: 4e7 acts as its ceiling, and inf as no limit.
        if math.isnan(bucket_size):
            raise ValueError("bucket_size must be a number of elements or None (got nan)")
        if math.isinf(bucket_size):
            return None if bucket_size > 0 else 0
        bucket_size = math.ceil(bucket_size)
    bucket_size = check_int(bucket_size, "bucket_size")
    # A buffer holds under 2^63 elements, so such a size never closes a bucket: exactly None. A size
    # <= 0 closes one after every param, as Megatron does (its resolve_ddp_bucket_size can give 0).
    if bucket_size >= 2**63:
        return None
    return max(bucket_size, 0)


@dataclass
class ParamLayout:
    """Result of :func:`plan_layout`; int64 CPU tensors, params in the input (model) order.

    - ``param_start``, ``param_end``, ``bucket_id`` `[num_params]`: the param's ``[start, end)`` in the
      buffer and its bucket.
    - ``bucket_indices`` `[num_buckets, 2]`: each bucket's padded ``[start, end)``.
    - ``per_bucket_numel_unpadded`` `[num_buckets]`; ``numel`` (padded buffer size) and
      ``numel_unpadded`` (their sum).
    """

    param_start: Any
    param_end: Any
    bucket_id: Any
    bucket_indices: Any
    per_bucket_numel_unpadded: Any
    numel: int
    numel_unpadded: int
    data_parallel_world_size: int = 1
    use_distributed_optimizer: bool = True
    bucket_size: int | None = None

    @property
    def num_params(self) -> int:
        return len(self.param_start)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(param_start, param_end, bucket_id ``[num_params]``, bucket_indices ``[num_buckets, 2]``) as
        C-contiguous int64 NumPy (no copy for plan_layout's own tensors; the dataclass is mutable,
        so fields may have been replaced)."""
        return (as_array(self.param_start, "layout.param_start", np.int64, kind="int"),
                as_array(self.param_end, "layout.param_end", np.int64, kind="int"),
                as_array(self.bucket_id, "layout.bucket_id", np.int64, kind="int"),
                as_array(self.bucket_indices, "layout.bucket_indices", np.int64, kind="int", ndim=2))

    def _checked_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_arrays`, after checking they still describe one buffer of ``numel`` elements."""
        starts, ends, ids, indices = self._arrays()
        numel = check_int(self.numel, "layout.numel", min_value=0, max_value=INT64_MAX)
        if not starts.shape == ends.shape == ids.shape:
            raise ValueError(f"layout.param_start, param_end and bucket_id must have one entry per param (got "
                             f"{starts.shape[0]}, {ends.shape[0]} and {ids.shape[0]})")
        if indices.shape[1] != 2:
            raise ValueError(f"layout.bucket_indices must be [num_buckets, 2] (got shape {tuple(indices.shape)})")
        bad = np.flatnonzero((starts < 0) | (ends < starts) | (ends > numel) | (ids < 0) | (ids >= indices.shape[0]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"layout param {i} is inconsistent: [{starts[i]}, {ends[i]}) in bucket {ids[i]}, "
                             f"with {indices.shape[0]} buckets and numel={numel}")
        return starts, ends, ids, indices

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_indices)

    def summary(self, *, param_bytes: int = 2, grad_bytes: int = 4, max_buckets: int = 8) -> str:
        """A planning report: buckets, padding waste and per-rank shard bytes.

        ``param_bytes``/``grad_bytes``: element sizes of the param and grad buffers (bf16 params,
        fp32 grads by default); ``max_buckets``: buckets listed one per line (>= 0).
        """
        param_bytes = check_int(param_bytes, "param_bytes", min_value=0)
        grad_bytes = check_int(grad_bytes, "grad_bytes", min_value=0)
        max_buckets = check_int(max_buckets, "max_buckets", min_value=0)
        starts, ends, ids, indices = self._checked_arrays()
        dp = check_int(self.data_parallel_world_size, "layout.data_parallel_world_size", min_value=1,
                       max_value=INT64_MAX)
        param_numel = int((ends - starts).sum())
        padding = self.numel - param_numel
        sizes = (indices[:, 1] - indices[:, 0]) if indices.shape[0] else None
        lines = [
            f"{self.num_params:,} params in {self.num_buckets:,} buckets "
            f"({'distributed optimizer' if self.use_distributed_optimizer else 'default DDP'} layout, "
            f"dp={dp}, bucket_size={self.bucket_size if self.bucket_size is not None else 'None'})",
            f"buffer: {self.numel:,} elements, {param_numel:,} in params, padding {padding:,} "
            f"({100.0 * padding / max(self.numel, 1):.3f}%; {self.numel - self.numel_unpadded:,} at bucket "
            f"ends, {self.numel_unpadded - param_numel:,} from 64-element alignment)",
        ]
        if sizes is not None:
            lines.append(
                f"bucket sizes: min {_fmt_count(int(sizes.min()))}, max {_fmt_count(int(sizes.max()))}, "
                f"mean {_fmt_count(int(sizes.astype(np.float64).mean()))} elements"
            )
        if self.use_distributed_optimizer:
            shard = self.numel // dp
            lines.append(
                f"per-rank shard: {shard:,} elements = {_fmt_bytes(shard * grad_bytes)} grads + "
                f"{_fmt_bytes(shard * param_bytes)} params (of {_fmt_bytes(self.numel * (grad_bytes + param_bytes))} "
                f"full buffers)"
            )
        else:
            # Megatron allocates a param buffer only for the distributed optimizer.
            lines.append(f"grad buffer per rank: {_fmt_bytes(self.numel * grad_bytes)} (not sharded; params stay "
                         f"in their own tensors)")
        num_buckets = indices.shape[0]
        shown = min(num_buckets, max_buckets)
        if shown:
            counts = np.bincount(ids, minlength=num_buckets).tolist()
            bucket_param_numel = np.zeros(num_buckets, dtype=np.int64)
            np.add.at(bucket_param_numel, ids, ends - starts)
            in_params = bucket_param_numel.tolist()
        for b in range(shown):
            start, end = (int(x) for x in indices[b])
            lines.append(
                f"  bucket {b}: [{start:,}, {end:,}) {counts[b]} params, {end - start - in_params[b]:,} padding"
            )
        if num_buckets > max_buckets:
            lines.append(f"  ... {num_buckets - max_buckets:,} more buckets")
        return "\n".join(lines)


def _fmt_count(value: int) -> str:
    return f"{value:,}"


def _fmt_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def plan_layout(
    numels: Any,
    *,
    shared_embedding: Any = None,
    bucket_size: int | None = None,
    data_parallel_world_size: int = 1,
    use_distributed_optimizer: bool = True,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> ParamLayout:
    """Lays out one buffer's params as Megatron does (its ``param_index_map`` on arrays).

    Args:
        numels: int `[num_params]`, element count of each param in model order, >= 0.
        shared_embedding: bool `[num_params]` or None; marked params get a bucket of their own
            (distributed optimizer only, as upstream).
        bucket_size: close a bucket once it holds >= this many elements (0 or less: after every
            param, as Megatron); None means one bucket. A float (e.g. ``4e7``) is compared as
            Megatron compares it: as its ceiling, ``inf`` as None.
        data_parallel_world_size: dp, > 0 (bucket ends pad to a multiple of lcm(dp, 128)).
        use_distributed_optimizer: False gives DDP's default layout (no padding, no shared rule).
        pad_buckets_for_high_nccl_busbw: pad bucket ends to lcm(dp, 128, 2**16).

    Returns:
        A :class:`ParamLayout` of int64 CPU tensors.
    """
    dp = check_int(data_parallel_world_size, "data_parallel_world_size", min_value=1, max_value=INT64_MAX)
    bucket_size = _check_bucket_size(bucket_size)
    use_distributed_optimizer = check_bool(use_distributed_optimizer, "use_distributed_optimizer")
    pad_buckets_for_high_nccl_busbw = check_bool(pad_buckets_for_high_nccl_busbw, "pad_buckets_for_high_nccl_busbw")
    numels_arr = as_array(numels, "numels", "int64", kind="int")
    if shared_embedding is None:
        shared_arr = np.zeros(0, dtype=np.uint8)
    else:
        shared_arr = as_array(shared_embedding, "shared_embedding", "uint8", kind="bool")
        if shared_arr.shape != numels_arr.shape:
            raise ValueError(
                f"shared_embedding must have one flag per param (got {shared_arr.shape[0]} flags for "
                f"{numels_arr.shape[0]} numels)"
            )
    start, end, bucket, indices, unpadded, numel, numel_unpadded = _core.buckets_plan_layout(
        numels_arr, shared_arr, bucket_size, dp, bool(use_distributed_optimizer),
        bool(pad_buckets_for_high_nccl_busbw),
    )
    return ParamLayout(
        to_tensor(start), to_tensor(end), to_tensor(bucket), to_tensor(indices), to_tensor(unpadded),
        int(numel), int(numel_unpadded), dp, bool(use_distributed_optimizer), bucket_size,
    )


class ShardRangeTable(NamedTuple):
    """Result of :func:`shard_ranges`: one row per (rank, bucket, owned param), ordered by rank, then
    bucket, then layout order; int64 CPU tensors.

    - ``rank``, ``bucket``, ``param`` `[n]` (``param``: model-order index).
    - ``gbuf_world`` `[n, 2]`: the owned piece in buffer coordinates.
    - ``gbuf_world_in_bucket`` `[n, 2]`: the same, relative to the bucket start.
    - ``gbuf_local`` `[n, 2]`: relative to the rank's shard start.
    - ``param_range`` `[n, 2]`: offsets inside the flattened param (upstream's ``"param"``).
    """

    rank: Any
    bucket: Any
    param: Any
    gbuf_world: Any
    gbuf_world_in_bucket: Any
    gbuf_local: Any
    param_range: Any


def shard_ranges(
    layout: ParamLayout,
    data_parallel_world_size: int,
    *,
    rank: int | None = None,
    num_threads: int | None = None,
) -> ShardRangeTable:
    """Every rank's shard ranges (the distributed optimizer's ``_build_model_gbuf_range`` for all ranks
    and buckets at once), or only ``rank``'s.

    Each bucket of padded size S is cut into dp shards of S / dp; rank r owns
    ``[offset + r * S/dp, offset + (r + 1) * S/dp)`` and every param overlapping it.

    Args:
        layout: a :class:`ParamLayout` (from :func:`plan_layout`).
        data_parallel_world_size: dp, > 0; must divide every bucket's padded size.
        rank: only this rank's rows (0 <= rank < dp); None for all ranks.
        num_threads: worker threads (default: $TRAINFAST_NUM_THREADS or all cores).
    """
    if not isinstance(layout, ParamLayout):
        raise TypeError(f"layout must be a ParamLayout from plan_layout (got {type(layout).__name__})")
    dp = check_int(data_parallel_world_size, "data_parallel_world_size", min_value=1, max_value=INT64_MAX)
    if rank is None:
        rank_begin, rank_end = 0, dp
    else:
        rank = check_int(rank, "rank", min_value=0, max_value=INT64_MAX)
        if rank >= dp:
            raise ValueError(f"rank must be < data_parallel_world_size={dp} (got {rank})")
        rank_begin, rank_end = rank, rank + 1
    threads = resolve_num_threads(num_threads)
    # Megatron's layouts run in reverse model order: the core reads the arrays backwards.
    arrays = _core.buckets_shard_ranges(*layout._arrays(), dp, rank_begin, rank_end, True, threads)
    return ShardRangeTable(*(to_tensor(a) for a in arrays))


class BucketGroups(NamedTuple):
    """Result of :func:`partition_bucket_indices`; int64 CPU tensors.

    - ``group_offsets`` `[num_groups + 1]`: group g is ``members[group_offsets[g]:group_offsets[g+1]]``.
    - ``members`` `[num_members, 2]`: (buffer index, bucket index) pairs in group order.
    """

    group_offsets: Any
    members: Any

    def groups(self) -> list[list[tuple[int, int]]]:
        pairs = [tuple(pair) for pair in self.members.tolist()]
        offsets = self.group_offsets.tolist()
        return [pairs[offsets[g]: offsets[g + 1]] for g in range(len(offsets) - 1)]


def partition_bucket_indices(
    is_uint8: Any,
    num_buckets: Any,
    *,
    force_single_bucket_group: bool = False,
    reduce_scatter_with_fp32_accumulation: bool = False,
) -> BucketGroups:
    """Megatron's ``partition_buckets`` on counts.

    Args:
        is_uint8: bool `[num_buffers]`, true for the (at most one) fp8/quantized buffer.
        num_buckets: int `[num_buffers]`, buckets in each buffer.
        force_single_bucket_group: one group of every bucket.
        reduce_scatter_with_fp32_accumulation: every bucket in its own group; with an fp8 buffer its
            buckets come first, then the others (none at all if the fp8 buffer has no bucket).

    Without fp8 every bucket is its own group (buffer order, then bucket order); with one fp8 buffer
    each fp8 bucket is its own group except the last, which also takes every non-fp8 bucket.
    """
    force_single_bucket_group = check_bool(force_single_bucket_group, "force_single_bucket_group")
    reduce_scatter_with_fp32_accumulation = check_bool(reduce_scatter_with_fp32_accumulation,
                                                       "reduce_scatter_with_fp32_accumulation")
    flags = as_array(is_uint8, "is_uint8", "uint8", kind="bool")
    counts = as_array(num_buckets, "num_buckets", "int64", kind="int")
    if flags.shape != counts.shape:
        raise ValueError(
            f"num_buckets must have one entry per buffer (got {counts.shape[0]} for {flags.shape[0]} buffers)"
        )
    offsets, members = _core.buckets_partition(
        flags, counts, bool(force_single_bucket_group), bool(reduce_scatter_with_fp32_accumulation)
    )
    return BucketGroups(to_tensor(offsets), to_tensor(members))


# --- drop-ins with Megatron's signatures ------------------------------------------------------------


def _quantized_predicates() -> list:
    """Upstream's "stored as uint8" test: newer megatron-core has one function for it (fp8, nvfp4
    and grouped quantized tensors); older releases check fp8 and nvfp4 separately, calling them by
    the names ``param_and_grad_buffer`` imported (so a stand-in bound there is what they call)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return []
    predicates = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time notices (no TE/Apex, ...)
        try:
            from megatron.core.distributed import param_and_grad_buffer as pgb
        except ImportError:
            pgb = None
        if hasattr(pgb, "_param_uses_quantized_storage"):
            return [pgb._param_uses_quantized_storage]
        for module_name, name in (("fp8_utils", "is_float8tensor"), ("fp4_utils", "is_nvfp4tensor")):
            check = getattr(pgb, name, None)
            if check is None:  # a release whose buffer module does not import it
                try:
                    check = getattr(importlib.import_module(f"megatron.core.{module_name}"), name, None)
                except ImportError:
                    continue
            if check is not None:
                predicates.append(check)
    return predicates


def _genuine(function: Any, module: Any, name: str, first_global: str | None = None) -> bool:
    """``function`` is ``module.name`` as megatron-core defines it (not a stand-in), and its first
    global read is ``first_global``."""
    code = getattr(function, "__code__", None)
    return (
        function is getattr(module, name, None)
        and getattr(function, "__module__", None) == module.__name__
        and getattr(function, "__qualname__", None) == name
        and code is not None
        and (first_global is None or code.co_names[:1] == (first_global,))
    )


def _quantized_storage_check(predicates: list) -> Any:
    """The predicate to call per param, or None where upstream's test is False for every param:
    without Transformer Engine each of megatron's checks opens with ``HAVE_TE_... and`` on a False
    flag. Stand-ins (monkeypatched checks, TE present, another release's body) are called per param."""
    if not predicates:
        return None
    call = predicates[0] if len(predicates) == 1 else (lambda p: any(pred(p) for pred in predicates))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import fp4_utils, fp8_utils
            from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:
        return call
    fp8_flag = "HAVE_TE_FP8_TENSOR_CLASS"
    fp4_flag = "HAVE_TE_FP4_TENSOR_CLASS"
    grouped_flag = "HAVE_TE_GROUPED_TENSOR_CLASS"
    if getattr(fp8_utils, fp8_flag, True) is not False or getattr(fp4_utils, fp4_flag, True) is not False:
        return call
    fp8_check = _genuine(fp8_utils.is_float8tensor, fp8_utils, "is_float8tensor", fp8_flag)
    fp4_check = _genuine(getattr(fp4_utils, "is_nvfp4tensor", None), fp4_utils, "is_nvfp4tensor", fp4_flag)
    if len(predicates) == 1:
        combined = predicates[0]
        names = ("is_float8tensor", "is_nvfp4tensor", "is_grouped_tensor_with_quantized_storage")
        grouped = getattr(fp8_utils, "is_grouped_tensor_with_quantized_storage", None)
        known = (
            _genuine(combined, pgb, "_param_uses_quantized_storage")
            and combined.__code__.co_names == names
            and pgb.is_float8tensor is fp8_utils.is_float8tensor and fp8_check
            and getattr(pgb, "is_nvfp4tensor", None) is fp4_utils.is_nvfp4tensor and fp4_check
            and getattr(pgb, names[2], None) is grouped
            and grouped is not None and _genuine(grouped, fp8_utils, names[2], "_unwrap_parameter_data")
            and grouped.__code__.co_names[:2] == ("_unwrap_parameter_data", "is_grouped_tensor")
            and _genuine(fp8_utils._unwrap_parameter_data, fp8_utils, "_unwrap_parameter_data", grouped_flag)
            and _genuine(fp8_utils.is_grouped_tensor, fp8_utils, "is_grouped_tensor", grouped_flag)
            and getattr(fp8_utils, grouped_flag, True) is False
        )
    else:
        known = len(predicates) == 2 and predicates[0] is fp8_utils.is_float8tensor and fp8_check and (
            predicates[1] is getattr(fp4_utils, "is_nvfp4tensor", None) and fp4_check)
    return None if known else call


def _param_list(params: Any, name: str = "params", what: str = "parameters") -> list:
    if isinstance(params, list):
        return params
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        try:
            return list(params)
        except TypeError:
            raise TypeError(f"{name} must be a list of {what} (got {type(params).__name__})") from None
    return list(params)


def _numel_reader() -> Any:
    """Upstream reads ``param.data.nelement()``; a plain Parameter's ``.data`` has its size, and
    skipping that alias (a new tensor object per call) is 4x cheaper."""
    import torch

    parameter_type = torch.nn.Parameter
    tensor_nelement = torch.Tensor.nelement
    if tensor_nelement is not getattr(torch._C.TensorBase, "nelement", None):
        return lambda param: param.data.nelement()

    def numel(param: Any) -> int:
        # torch.Tensor.nelement on the param itself: an attribute on the param cannot shadow it
        return tensor_nelement(param) if type(param) is parameter_type else param.data.nelement()

    return numel


def _numels(params: list) -> np.ndarray:
    numel = _numel_reader()
    try:
        return np.fromiter((numel(p) for p in params), dtype=np.int64, count=len(params))
    except AttributeError as error:
        raise TypeError(f"params must be torch parameters/tensors ({error})") from None


def group_params_for_buffers(params: Any, grad_reduce_in_fp32: bool) -> dict:
    """Groups trainable params by :class:`BufferKey` (first-seen order), as Megatron's
    ``group_params_for_buffers``: returns ``{BufferKey: (params, param_indices)}``.

    Key: storage dtype (torch.uint8 for fp8/nvfp4 params), grad dtype (fp32 if ``grad_reduce_in_fp32``
    else the param's dtype), ``is_expert_parallel = not param.allreduce``, and the layer-wise-optimizer
    flag; ``param_indices`` count params under the *fake* (high-precision) dtype.
    """
    return {key: entry[:2] for key, entry in _group_params(_param_list(params), grad_reduce_in_fp32, False).items()}


def _group_params(param_list: list, grad_reduce_in_fp32: bool, layout_inputs: bool) -> dict:
    """{BufferKey: (params, param_indices[, numels, shared_embedding flags])} in one pass."""
    import torch

    predicates = _quantized_predicates()
    check = _quantized_storage_check(predicates)
    # torch.Tensor.nelement, what upstream's param.data.nelement() runs, while it is torch's own method
    nelement: Callable[[torch.Tensor], int] | None = torch.Tensor.nelement
    if nelement is not getattr(torch._C.TensorBase, "nelement", None) or (
            type(nelement).__name__ != "method_descriptor"):
        nelement = None
    native = _core.buckets_group_params(
        param_list, bool(grad_reduce_in_fp32), torch.float, torch.uint8, check, torch.nn.Parameter, nelement,
        layout_inputs,
    )
    if native is not None:
        return {_make_key(*key): (members, indices, numels, shared) for key, members, indices, numels, shared in native}
    # The reference path: reproduces upstream's errors (and the result) where the native pass gave up.
    quantized = predicates[0] if len(predicates) == 1 else (lambda p: any(pred(p) for pred in predicates))
    numel = _numel_reader()
    uint8, fp32 = torch.uint8, torch.float
    # A group-by on attributes read once per param: plain tuples as keys (upstream hashes two frozen
    # dataclasses per param), megatron's BufferKey built once per buffer.
    # key -> (params, param_indices, numels, shared_embedding flags); the last two only for layouts
    members: dict[tuple[Any, ...], tuple[list[Any], list[int], list[int], list[bool]]] = {}
    counters: dict[tuple[Any, ...], int] = {}
    for i, param in enumerate(param_list):
        try:
            if not param.requires_grad:
                raise UpstreamAssertionError(f"params[{i}] does not require grad (Megatron asserts requires_grad)")
            dtype = param.dtype
        except AttributeError:
            raise TypeError(f"params[{i}] must be a torch parameter (got {type(param).__name__})") from None
        grad_dtype = fp32 if grad_reduce_in_fp32 else dtype
        is_expert = not getattr(param, "allreduce", True)
        layer_wise = getattr(param, "is_managed_by_layer_wise_optimizer", False)
        key = (uint8 if quantized(param) else dtype, grad_dtype, is_expert, layer_wise)
        entry = members.get(key)
        if entry is None:
            entry = members[key] = ([], [], [], [])
        entry[0].append(param)
        # param_indices count under the fake (high-precision) dtype
        fake_key = (dtype, grad_dtype, is_expert, layer_wise)
        index = counters.get(fake_key, 0)
        counters[fake_key] = index + 1
        entry[1].append(index)
        if layout_inputs:
            entry[2].append(numel(param))
            entry[3].append(bool(getattr(param, "shared_embedding", False)))
    return {_make_key(*key): entry for key, entry in members.items()}


def _make_key(param_dtype: Any, grad_dtype: Any, is_expert: bool, layer_wise: Any) -> Any:
    key_type = _dataclasses()[0]
    if layer_wise or "is_managed_by_layer_wise_optimizer" in getattr(key_type, "__dataclass_fields__", {}):
        return key_type(param_dtype, grad_dtype, is_expert, layer_wise)
    return key_type(param_dtype, grad_dtype, is_expert)


def _id_hashed_parameter_type() -> Any:
    """torch.nn.Parameter while its hash is torch.Tensor's ``id(self)`` (the native dict build then
    skips the Python-level ``__hash__`` call per param); None otherwise."""
    import builtins

    import torch

    tensor_hash = torch.Tensor.__hash__
    code = getattr(tensor_hash, "__code__", None)
    if (
        torch.nn.Parameter.__hash__ is tensor_hash
        and code is not None
        and code.co_names == ("id",)
        and getattr(torch._tensor, "id", builtins.id) is builtins.id
        and type(builtins.id).__name__ == "builtin_function_or_method"
        and getattr(builtins.id, "__module__", None) == "builtins"
    ):
        return torch.nn.Parameter
    return None


def _to_per_buffer_layout(params: list, layout: ParamLayout, param_indices: Any, num_optimizer_shards: Any = None) -> Any:
    # Megatron's dict iterates in layout (reverse model) order.
    index_map = _core.buckets_index_map(
        params if isinstance(params, list) else list(params), layout.param_start.numpy(), layout.param_end.numpy(),
        layout.bucket_id.numpy(), _id_hashed_parameter_type(),
    )
    layout_type = _dataclasses()[1]
    extra = {}
    # megatron-core 0.18 has the layout class without this field (0.19 added it).
    if num_optimizer_shards is not None and _has_field(layout_type, "num_optimizer_shards"):
        extra["num_optimizer_shards"] = num_optimizer_shards
    return layout_type(
        param_index_map=index_map,
        bucket_indices=[tuple(pair) for pair in layout.bucket_indices.tolist()],
        per_bucket_numel_unpadded=layout.per_bucket_numel_unpadded.tolist(),
        param_indices=param_indices if param_indices is not None else [],  # kept as given, as upstream does
        **extra,
    )


@functools.lru_cache(maxsize=None)
def _has_field(cls: type, name: str) -> bool:
    return name in getattr(cls, "__dataclass_fields__", {})


def compute_default_per_buffer_param_layout(params: Any, bucket_size: int | None) -> Any:
    """Megatron's ``_compute_default_per_buffer_param_layout``: no padding, reverse order, buckets
    closed once they hold >= ``bucket_size`` elements (None: one bucket)."""
    param_list = _param_list(params)
    layout = plan_layout(_numels(param_list), bucket_size=bucket_size, use_distributed_optimizer=False)
    return _to_per_buffer_layout(param_list, layout, None)


def compute_per_buffer_param_layout(
    params: Any,
    bucket_size: int | None,
    data_parallel_world_size: int,
    ddp_config: Any,
    param_indices: Sequence[int] | None = None,
) -> Any:
    """``DistributedOptimizer._compute_per_buffer_param_layout``: the distributed-optimizer layout of
    one buffer (64-aligned params, shared embeddings alone, bucket ends padded for dp)."""
    param_list = _param_list(params)
    shared = np.fromiter(
        (bool(getattr(p, "shared_embedding", False)) for p in param_list), dtype=np.uint8, count=len(param_list)
    )
    return _distopt_layout(param_list, _numels(param_list), shared, bucket_size, data_parallel_world_size,
                           ddp_config, param_indices)


def _config_field(ddp_config: Any, name: str) -> Any:
    """``ddp_config.<name>``, which upstream reads unguarded: a config without it is refused, not
    taken as False."""
    try:
        return getattr(ddp_config, name)
    except AttributeError:
        raise TypeError(f"ddp_config must be a DistributedDataParallelConfig with {name} "
                        f"(got {type(ddp_config).__name__} without it)") from None


def _distopt_layout(param_list: list, numels: Any, shared: Any, bucket_size: Any, data_parallel_world_size: int,
                    ddp_config: Any, param_indices: Any) -> Any:
    layout = plan_layout(
        numels,
        shared_embedding=shared,
        bucket_size=bucket_size,
        data_parallel_world_size=data_parallel_world_size,
        use_distributed_optimizer=True,
        pad_buckets_for_high_nccl_busbw=bool(_config_field(ddp_config, "pad_buckets_for_high_nccl_busbw")),
    )
    # Upstream records the shard count so the range builders can check the group matches.
    return _to_per_buffer_layout(param_list, layout, param_indices, layout.data_parallel_world_size)


def compute_full_param_layout(
    params: Any,
    bucket_size: int | None,
    data_parallel_world_size: int,
    ddp_config: Any,
    expert_data_parallel_world_size: int | None = None,
) -> Any:
    """``DistributedOptimizer.compute_full_param_layout``: groups params into buffers and lays each out;
    expert-parallel buffers use ``expert_data_parallel_world_size`` (default: the dense dp)."""
    bucket_size = _check_bucket_size(bucket_size)
    grouped = _group_params(_param_list(params), bool(_config_field(ddp_config, "grad_reduce_in_fp32")), True)
    # Each world size is checked only when a buffer uses it: upstream never reads it otherwise.
    uses_expert = any(key.is_expert_parallel for key in grouped)
    dp = expert_dp = None
    if any(not key.is_expert_parallel for key in grouped) or (uses_expert and expert_data_parallel_world_size is None):
        dp = expert_dp = check_int(data_parallel_world_size, "data_parallel_world_size", min_value=1,
                                   max_value=INT64_MAX)
    if uses_expert and expert_data_parallel_world_size is not None:
        expert_dp = check_int(expert_data_parallel_world_size, "expert_data_parallel_world_size",
                              min_value=1, max_value=INT64_MAX)
    layouts = {}
    for key, (buffer_params, indices, numels, shared) in grouped.items():
        world = expert_dp if key.is_expert_parallel else dp
        assert world is not None  # checked above for each kind of buffer present
        layouts[key] = _distopt_layout(buffer_params, np.asarray(numels, dtype=np.int64),
                                       np.asarray(shared, dtype=np.uint8), bucket_size, world, ddp_config, indices)
    return _dataclasses()[2](layouts=layouts)


# What partition_buckets reads from each buffer.
_BUFFER_ATTRS = ("param_dtype", "buckets", "ddp_config", "data_parallel_group", "data_parallel_world_size")


def partition_buckets(
    buffers: Any,
    force_single_bucket_group: bool = False,
    reduce_scatter_with_fp32_accumulation: bool = False,
    *,
    require_distinct_param_dtypes: bool = False,
) -> list:
    """Megatron's ``partition_buckets``: regroups the buckets of ``_ParamAndGradBuffer`` objects into
    ``_ParamAndGradBucketGroup`` objects (the upstream class), with upstream's checks.

    ``reduce_scatter_with_fp32_accumulation`` (newer megatron-core) puts every bucket in a group of
    its own, fp8 buckets first. ``require_distinct_param_dtypes`` adds the check of megatron-core
    <= 0.17 (no two buffers of one param dtype); newer releases only refuse two uint8 buffers.
    """
    buffer_list = _param_list(buffers, "buffers", "_ParamAndGradBuffer objects")
    if not buffer_list:
        return []
    for idx, buffer in enumerate(buffer_list):
        check_attrs(buffer, f"buffers[{idx}]", _BUFFER_ATTRS, "a _ParamAndGradBuffer")
    import torch
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    if require_distinct_param_dtypes:
        seen = set()
        for buffer in buffer_list:
            if buffer.param_dtype in seen:
                raise UpstreamAssertionError(
                    f"buffers must have distinct param dtypes (got {buffer.param_dtype} twice)"
                )
            seen.add(buffer.param_dtype)
    flags = np.fromiter((b.param_dtype == torch.uint8 for b in buffer_list), dtype=np.uint8, count=len(buffer_list))
    if int(flags.sum()) > 1:
        raise UpstreamAssertionError(
            f"buffers must hold at most one uint8 (fp8) buffer (got {int(flags.sum())})"
        )
    if force_single_bucket_group:
        first = buffer_list[0]
        for buffer in buffer_list:
            if not (
                buffer.ddp_config == first.ddp_config
                and buffer.data_parallel_group == first.data_parallel_group
                and buffer.data_parallel_world_size == first.data_parallel_world_size
            ):
                raise UpstreamAssertionError(
                    "force_single_bucket_group needs every buffer to share ddp_config and data-parallel group"
                )
    if not force_single_bucket_group and not flags.any():
        # One group per bucket, each built with its own buffer's settings: building the groups is all the
        # work (upstream's constructor, one per bucket), so no index arrays in between.
        groups = []
        for buffer in buffer_list:
            config, group, size = buffer.ddp_config, buffer.data_parallel_group, buffer.data_parallel_world_size
            groups.extend([_ParamAndGradBucketGroup([bucket], config, group, size) for bucket in buffer.buckets])
        return groups
    counts = np.fromiter((len(b.buckets) for b in buffer_list), dtype=np.int64, count=len(buffer_list))
    offsets, pairs = _core.buckets_partition(
        flags, counts, bool(force_single_bucket_group), bool(reduce_scatter_with_fp32_accumulation)
    )
    offsets, pairs = offsets.tolist(), pairs.tolist()
    has_uint8 = bool(flags.any())
    groups = []
    for g in range(len(offsets) - 1):
        members = pairs[offsets[g]: offsets[g + 1]]
        # Upstream builds each group with the buffer its loop left behind: the first, the last, or its own.
        if force_single_bucket_group:
            owner = buffer_list[0]
        elif has_uint8:
            owner = buffer_list[-1]  # upstream reuses the loop variable left by the non-fp8 scan
        else:
            owner = buffer_list[members[0][0]]
        buckets = [buffer_list[b].buckets[j] for b, j in members]
        groups.append(
            _ParamAndGradBucketGroup(
                buckets, owner.ddp_config, owner.data_parallel_group, owner.data_parallel_world_size
            )
        )
    return groups


def build_model_gbuf_param_range_map(param_world_index_map: Mapping, gbuf_world_range: Any, bucket_offset: int) -> dict:
    """``DistributedOptimizer._build_model_gbuf_param_range_map``: ``{param: {"gbuf_world",
    "gbuf_world_in_bucket", "gbuf_local", "param": Range}}`` for params overlapping
    ``gbuf_world_range``, in the map's order (one native pass over the dict)."""
    range_type = _range_type()
    if not isinstance(param_world_index_map, Mapping):
        raise TypeError(
            f"param_world_index_map must be a mapping (got {type(param_world_index_map).__name__})"
        )
    if type(param_world_index_map) is not dict:
        # The native pass reads a dict's storage order; upstream reads .items(), which a subclass or
        # another mapping may order differently (an OrderedDict after move_to_end).
        param_world_index_map = dict(param_world_index_map.items())
    # Checked here, not in _range_bounds: the range builder passes a Range it made itself.
    check_attrs(gbuf_world_range, "gbuf_world_range", ("start", "end"), "a Range")
    return _core.buckets_param_range_map(
        param_world_index_map, *_range_bounds(gbuf_world_range, bucket_offset), range_type
    )


def _range_bounds(world_range: Any, bucket_offset: Any) -> tuple[int, int, int]:
    """(start, end, bucket_offset) as int64 values, checked (the native range builder takes int64)."""
    def bound(value: Any, name: str) -> int:
        return check_int(value, name, min_value=-INT64_MAX - 1, max_value=INT64_MAX)

    start, end = world_range.start, world_range.end
    return (bound(start, "gbuf_world_range.start"), bound(end, "gbuf_world_range.end"),
            bound(bucket_offset, "bucket_offset"))


def build_model_gbuf_range(param_and_grad_buffer: Any, bucket_index: int, *, cls: Any = None) -> dict:
    """``DistributedOptimizer._build_model_gbuf_range``: this rank's shard of one bucket and its
    params' ranges, ``{"param_map": ...}``; computes only this rank's range (upstream builds all)."""
    check_attrs(param_and_grad_buffer, "param_and_grad_buffer", ("data_parallel_group", "buckets", "param_index_map"),
                "a _ParamAndGradBuffer")
    group = param_and_grad_buffer.data_parallel_group
    check_attrs(group, "param_and_grad_buffer.data_parallel_group", ("rank", "size"), "a process group")
    rank, world = group.rank(), group.size()
    shards = getattr(param_and_grad_buffer, "num_optimizer_shards", None)
    if shards is not None and shards != world:
        raise UpstreamAssertionError(
            f"Parameter layout was built for {shards} optimizer shards but the buffer's data-parallel "
            f"group has {world} ranks"
        )
    if rank < 0:
        # Upstream indexes a list with it: -1 (torch's "not a member") would give the last rank's shard.
        raise ValueError(f"data-parallel rank {rank} (data_parallel_group.rank()): this process is not a "
                         f"member of the group of size {world}")
    if rank >= world:
        raise ValueError(f"data-parallel rank {rank} (data_parallel_group.rank()) is not below the group's "
                         f"size() {world}")
    num_buckets = len(param_and_grad_buffer.buckets)
    bucket_index = check_int(bucket_index, "bucket_index")
    if not -num_buckets <= bucket_index < num_buckets:  # upstream indexes a list: negative ones count from the end
        raise UpstreamIndexError(f"bucket_index must index the buffer's {num_buckets} buckets (got {bucket_index})")
    bucket = param_and_grad_buffer.buckets[bucket_index]
    size = bucket.grad_data.numel()
    if size % world != 0:
        raise UpstreamAssertionError(f"Each bucket's buffer size should be divisible by {world}")
    shard = size // world
    start = rank * shard
    range_type = _range_type()
    world_range = range_type(start + bucket.offset, min(size, start + shard) + bucket.offset)
    build = cls._build_model_gbuf_param_range_map if cls is not None else build_model_gbuf_param_range_map
    if cls is None or getattr(getattr(build, "__func__", None), "_trainfast_range_map", False):
        param_map = _indexed_range_map(param_and_grad_buffer, world_range, bucket.offset, range_type)
        if param_map is not None:
            return {"param_map": param_map}
    return {"param_map": build(param_and_grad_buffer.param_index_map, world_range, bucket.offset)}


# buffer -> (its param_index_map, a snapshot of it): the range builder runs once per (rank, bucket)
# on the same map; the snapshot is re-checked against the dict on every call.
_SNAPSHOTS: weakref.WeakKeyDictionary[Any, tuple[dict[Any, Any], _core._IndexSnapshot]] = weakref.WeakKeyDictionary()


def _indexed_range_map(buffer: Any, world_range: Any, bucket_offset: Any, range_type: Any) -> dict | None:
    """build_model_gbuf_param_range_map through a snapshot of ``buffer.param_index_map`` (visits only
    the params that can overlap the range); None where the plain path must run."""
    index_map = buffer.param_index_map
    if type(index_map) is not dict:
        return None
    start, end, offset = _range_bounds(world_range, bucket_offset)
    for _ in range(2):
        try:
            cached = _SNAPSHOTS.get(buffer)
        except TypeError:  # not weak-referenceable or unhashable: no cache
            return None
        if cached is None or cached[0] is not index_map:
            snapshot = _core.buckets_index_snapshot(index_map)
            if snapshot is None:
                return None
            cached = (index_map, snapshot)
            try:
                _SNAPSHOTS[buffer] = cached
            except TypeError:
                return None
        result = _core.buckets_param_range_map_indexed(index_map, *cached[1], start, end, offset, range_type)
        if result is not None:
            return result
        _SNAPSHOTS.pop(buffer, None)  # the dict changed since: snapshot it again
    return None


def _range_type() -> Any:
    try:
        from megatron.core.optimizer.distrib_optimizer import Range

        return Range
    except ImportError:
        return _Range


class _Range:
    """Stand-in for megatron's Range (start, end, size) when megatron-core is absent."""

    __slots__ = ("start", "end", "size")

    def __init__(self, start: int, end: int):
        self.start, self.end, self.size = start, end, end - start

    def normalize(self, start: int = 0) -> _Range:
        return _Range(start, start + self.size)

    def __len__(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return "%d,%d [%d]" % (self.start, self.end, self.size)


# --- buffers ----------------------------------------------------------------------------------------


class Materialized(NamedTuple):
    """Result of :func:`materialize`: flat buffers and per-param views into them (model order)."""

    param_data: Any  # [numel] param_dtype, or None
    grad_data: Any  # [numel] grad_dtype
    param_views: list  # per param, shaped as the param (None without a param buffer)
    grad_views: list


def _check_shape(shape: Any, name: str) -> tuple[int, ...]:
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"{name} must be a shape (a sequence of ints) or a tensor (got {type(shape).__name__})")
    return tuple(check_int(d, f"{name}[{k}]", min_value=0, max_value=INT64_MAX) for k, d in enumerate(shape))


def materialize(
    layout: ParamLayout,
    shapes: Any = None,
    *,
    param_dtype: Any = None,
    grad_dtype: Any = None,
    device: Any = "cpu",
    bind_main_grad: bool = False,
) -> Materialized:
    """Allocates the flat param/grad buffers of ``layout`` (zeroed) on ``device`` and returns per-param
    views exactly as Megatron's ``_ParamAndGradBuffer._get`` makes them
    (``buffer[start:start + numel].view(shape)``).

    Args:
        layout: a :class:`ParamLayout`.
        shapes: per-param shapes (model order) or the params themselves; None for flat 1-D views.
        param_dtype: dtype of the param buffer; None for no param buffer (DDP without distributed
            optimizer keeps params where they are).
        grad_dtype: dtype of the grad buffer (default torch.float32).
        device: where to allocate (e.g. "cuda"), a torch.device, str or int.
        bind_main_grad: when ``shapes`` are params, set ``param.main_grad`` to its grad view.
    """
    import torch

    if not isinstance(layout, ParamLayout):
        raise TypeError(f"layout must be a ParamLayout from plan_layout (got {type(layout).__name__})")
    grad_dtype = torch.float32 if grad_dtype is None else grad_dtype
    for name, dtype in (("param_dtype", param_dtype), ("grad_dtype", grad_dtype)):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype (got {dtype!r})")
    param_start, param_end, _, _ = layout._checked_arrays()
    if not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, str or int (got {type(device).__name__})")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device must name a torch device (got {device!r}: {error})") from None
    if device.type == "cuda":  # torch would raise an AssertionError / RuntimeError at the allocation
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"device {str(device)!r} is not available here (torch sees {count} CUDA devices)")
    for name, dtype in (("param_dtype", param_dtype), ("grad_dtype", grad_dtype)):
        if dtype is None:
            continue
        try:  # an empty buffer first: a backend torch lacks, or a dtype it cannot zero, named here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's deprecation of quantized dtypes
                torch.zeros(0, dtype=dtype, device=device)
        except Exception as error:
            reason = f"{type(error).__name__}: {error}".split(". ")[0][:200]
            raise ValueError(f"cannot make a {name}={dtype} buffer on device {str(device)!r} ({reason})") from None
    n = len(param_start)
    numels = (param_end - param_start).tolist()
    params: list[Any] | None = None
    shape_list: list[tuple[int, ...]]
    if shapes is None:
        shape_list = [(k,) for k in numels]
    else:
        items = _param_list(shapes)
        if len(items) != n:
            raise ValueError(f"shapes must have one entry per param (got {len(items)} for {n} params)")
        is_tensor = [isinstance(item, torch.Tensor) for item in items]
        if any(is_tensor) and not all(is_tensor):
            odd = is_tensor.index(not is_tensor[0])
            raise TypeError(f"shapes must be all params (tensors) or all shapes, not a mix (shapes[0] is "
                            f"a {type(items[0]).__name__}, shapes[{odd}] a {type(items[odd]).__name__})")
        if any(is_tensor):
            params = items
            shape_list = [tuple(p.shape) for p in items]
        else:
            shape_list = [_check_shape(s, f"shapes[{i}]") for i, s in enumerate(items)]
        for i, (shape, numel) in enumerate(zip(shape_list, numels)):
            if math.prod(shape) != numel:
                raise ValueError(f"shapes[{i}] has {math.prod(shape)} elements but the layout holds {numel}")
    bind_main_grad = check_bool(bind_main_grad, "bind_main_grad")
    if bind_main_grad and params is None:
        raise ValueError("bind_main_grad needs the params themselves as shapes")
    _check_buffers_fit(layout.numel, [d for d in (param_dtype, grad_dtype) if d is not None], device)
    param_data = torch.zeros(layout.numel, dtype=param_dtype, device=device) if param_dtype is not None else None
    grad_data = torch.zeros(layout.numel, dtype=grad_dtype, device=device)
    starts = param_start.tolist()
    param_views, grad_views = [], []
    for i in range(n):
        start, end = starts[i], starts[i] + numels[i]
        grad_views.append(grad_data[start:end].view(shape_list[i]))
        param_views.append(param_data[start:end].view(shape_list[i]) if param_data is not None else None)
    if params is not None and bind_main_grad:  # (bind_main_grad without params raised above)
        _bind_main_grads(params, grad_views)
    return Materialized(param_data, grad_data, param_views, grad_views)


def _check_buffers_fit(numel: int, dtypes: list, device: Any) -> None:
    """ValueError, before allocating, for buffers past 2^63 bytes or the device's whole memory."""
    import os

    import torch

    num_bytes = sum(numel * dtype.itemsize for dtype in dtypes)
    if num_bytes > INT64_MAX:
        raise ValueError(f"layout.numel={numel} would need {num_bytes} bytes of param/grad buffers, over 2^63")
    capacity = 0
    try:
        if device.type == "cpu":
            capacity = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        elif device.type == "cuda" and torch.cuda.is_available():
            capacity = torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, RuntimeError, AssertionError):  # unknown: let the allocation decide
        capacity = 0
    if capacity and num_bytes > capacity:
        raise ValueError(f"layout.numel={numel} would need {num_bytes / 2**30:.1f} GiB of param/grad buffers, "
                         f"more than the {device.type} device's {capacity / 2**30:.1f} GiB of memory")


def _bind_main_grads(params: list, grad_views: list) -> None:
    """Sets every ``params[i].main_grad``, or none: a param that refuses it undoes the ones before."""
    missing = object()
    previous: list = []
    for i, (param, view) in enumerate(zip(params, grad_views)):
        try:
            previous.append(param.__dict__.get("main_grad", missing))
            param.main_grad = view
        except Exception as error:
            # Last first: a param listed twice gets back the value it had before the first.
            for earlier, old in reversed(list(zip(params[:i], previous))):
                if old is missing:
                    del earlier.main_grad
                else:
                    earlier.main_grad = old
            raise TypeError(f"shapes[{i}]: cannot set main_grad on this param "
                            f"({type(error).__name__}: {error})") from None
