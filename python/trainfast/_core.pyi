# Type stub of the private native module trainfast._core (csrc/bindings/). tests/test_package.py
# checks that every name the module exports is declared here.
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# --- checkpoint (csrc/bindings/checkpoint.cpp) ---
def checkpoint_split_write_items(
    items: list[Any],
    bins: int,
    byte_io_type: Any,
    element_sizes: dict[Any, int],
    global_sizing: bool,
    refined: bool,
    num_threads: int,
) -> list[list[Any]]: ...
def checkpoint_write_item_sizes(
    items: list[Any],
    byte_io_type: Any,
    element_sizes: dict[Any, int],
    global_sizing: bool,
    count_bytes: bool,
    num_threads: int,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]: ...
def checkpoint_assign_bins(
    is_bytes: npt.NDArray[np.uint8], sizes: npt.NDArray[np.int64], bins: int, refined: bool
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def checkpoint_read_counts() -> tuple[int, int, int]: ...

# --- buckets (csrc/bindings/buckets.cpp) ---
_I64 = npt.NDArray[np.int64]

def buckets_plan_layout(
    numels: npt.NDArray[np.int64],
    shared_embedding: npt.NDArray[np.uint8],
    bucket_size: int | None,
    data_parallel_world_size: int,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool,
) -> tuple[_I64, _I64, _I64, _I64, _I64, int, int]: ...
def buckets_shard_ranges(
    param_start: _I64,
    param_end: _I64,
    bucket_id: _I64,
    bucket_indices: _I64,
    data_parallel_world_size: int,
    rank_begin: int,
    rank_end: int,
    reverse_order: bool,
    num_threads: int,
) -> tuple[_I64, _I64, _I64, _I64, _I64, _I64, _I64]: ...
def buckets_partition(
    is_uint8: npt.NDArray[np.uint8], num_buckets: _I64, force_single_bucket_group: bool,
    reduce_scatter_with_fp32_accumulation: bool,
) -> tuple[_I64, _I64]: ...
def buckets_param_range_map(
    param_world_index_map: dict[Any, Any], world_start: int, world_end: int, bucket_offset: int, range_type: Any
) -> dict[Any, dict[str, Any]]: ...
def buckets_group_params(
    params: list[Any], grad_reduce_in_fp32: bool, fp32: Any, uint8: Any, quantized: Any, parameter_type: Any,
    tensor_nelement: Any, layout_inputs: bool,
) -> list[tuple[tuple[Any, Any, bool, Any], list[Any], list[int], Any, Any]] | None: ...
def buckets_index_map(
    params: list[Any], param_start: npt.NDArray[np.int64], param_end: npt.NDArray[np.int64],
    bucket_id: npt.NDArray[np.int64], id_hash_type: Any,
) -> dict[Any, tuple[int, int, int]]: ...
# (keys, values, param_start, param_end, max_end, starts_sorted, version), or None: the plain path runs.
_IndexSnapshot = tuple[tuple[Any, ...], tuple[Any, ...], npt.NDArray[np.int64], npt.NDArray[np.int64],
                       npt.NDArray[np.int64], bool, int]
def buckets_index_snapshot(param_world_index_map: dict[Any, Any]) -> _IndexSnapshot | None: ...
def buckets_param_range_map_indexed(
    param_world_index_map: dict[Any, Any], keys: tuple[Any, ...], values: tuple[Any, ...],
    param_start: npt.NDArray[np.int64], param_end: npt.NDArray[np.int64], max_end: npt.NDArray[np.int64],
    starts_sorted: bool, version: int, world_start: int, world_end: int, bucket_offset: int, range_type: Any,
) -> dict[Any, dict[str, Any]] | None: ...
# --- pipeline (csrc/bindings/pipeline.cpp) ---
def pipeline_megatron_plan(
    num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None,
    account_for_embedding: bool, account_for_loss: bool,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def pipeline_megatron_rank(
    num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None,
    account_for_embedding: bool, account_for_loss: bool, pp_rank: int, vp_stage: int | None,
) -> tuple[int, int | None]: ...
def pipeline_uneven_plan(num_layers: int, pp: int, vpp: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def pipeline_paddle_plan(
    stage_ids: npt.NDArray[np.int64], pp: int, vpp: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def pipeline_parse_layout(layout: str, pp: int) -> list[str]: ...
def pipeline_validate_layout(
    stages: list[str], pp: int, num_layers: int | None, mtp_num_layers: int | None, check_mtp_count: bool
) -> bool: ...
def pipeline_layout_counts(
    stages: list[str], pp: int, layer_char: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def pipeline_layout_to_str(stages: list[str], pp: int) -> str: ...
def pipeline_plan_to_layout_str(counts: npt.NDArray[np.int64], pp: int, vpp: int) -> str: ...
def pipeline_balanced_split(
    layer_costs: npt.NDArray[np.float64], pp: int, vpp: int, embedding_cost: float, loss_cost: float
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64], float, float]: ...
# --- eplb (csrc/bindings/eplb.cpp) ---
class EplbReplication:
    """Stage 1 of the hierarchical policy (groups on nodes, replicas chosen)."""

    @property
    def replica_loads(self) -> npt.NDArray[np.float32]: ...

def eplb_replicate(
    weight: npt.NDArray[np.float32],
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    group_loads: npt.NDArray[np.float32],
    group_order: npt.NDArray[np.int64],
    num_threads: int,
) -> EplbReplication: ...
def eplb_place(
    replication: EplbReplication,
    replica_order: npt.NDArray[np.int64],
    refine: bool,
    avoid_gpu_duplicates: bool,
    num_threads: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def eplb_int_loads(
    weight: npt.NDArray[Any], num_groups: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32] | None]: ...
def eplb_balanced_packing(
    weight: npt.NDArray[Any], order: npt.NDArray[np.int64], num_packs: int, num_threads: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def eplb_max_weight_assignment(weight: npt.NDArray[np.int64], num_threads: int) -> npt.NDArray[np.int64]: ...
def eplb_replicate_experts(
    weight: npt.NDArray[Any], num_phy: int, num_threads: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
# --- bpe training (csrc/bindings/bpe_train.cpp) ---
class BpeWordTable:
    def __len__(self) -> int: ...

def bpe_train_merges(
    word_counts: dict[bytes, int], num_merges: int, progress: Callable[[int], object] | None = None
) -> list[tuple[bytes, bytes]]: ...
def bpe_train_merges_table(
    table: BpeWordTable, num_merges: int, progress: Callable[[int], object] | None = None
) -> list[tuple[bytes, bytes]]: ...
# --- bpe pre-tokenizer (csrc/bindings/bpe_pretokenize.cpp); pattern: 0 gpt2, 1 cl100k, 2 o200k ---
def bpe_pretokenize(text: str, pattern: int, special_tokens: list[str]) -> list[str]: ...
def bpe_pretokenize_ends(text: str, pattern: int) -> npt.NDArray[np.int64]: ...

class BpePretokenCounter:
    def __init__(
        self,
        pattern: int,
        special_tokens: list[str],
        errors: int,
        num_threads: int,
        chunk_bytes: int = 0,
        block_bytes: int = 0,
    ) -> None: ...
    def add_file(self, path: str | bytes, progress: Callable[[int], object] | None = None) -> None: ...
    def add_documents(
        self, documents: list[str | bytes], first_index: int = 0, progress: Callable[[int], object] | None = None
    ) -> int: ...  # bytes of UTF-8 text counted
    def finish(self) -> dict[bytes, int]: ...
    def finish_table(self) -> BpeWordTable: ...
    def finish_arrays(self) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint64], npt.NDArray[np.int64]]: ...

# --- bpe encoding (csrc/bindings/bpe_encode.cpp) ---
class BpeEncoder:
    def __init__(
        self,
        tokens: list[bytes],
        ids: npt.NDArray[np.int64],
        merge_left: npt.NDArray[np.int64],
        merge_right: npt.NDArray[np.int64],
        merge_result: npt.NDArray[np.int64],
        special_tokens: list[bytes],
        special_ids: npt.NDArray[np.int64],
        pattern: int,
    ) -> None: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]: ...
    def encode_prefix(self, text: str) -> tuple[list[int], int]: ...
    def encode_pieces(self, pieces: list[bytes]) -> list[int]: ...
    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...
    def decode(self, ids: Sequence[int]) -> str: ...
