# Type stub of the private native module trainfast._core (csrc/bindings/). tests/test_package.py
# checks that every name the module exports is declared here.
from typing import Any

import numpy as np
import numpy.typing as npt

# --- checkpoint (csrc/bindings/checkpoint.cpp) ---
def checkpoint_split_write_items(
    items: list[Any], bins: int, byte_io_type: Any, element_sizes: dict[Any, int], global_sizing: bool, refined: bool
) -> list[list[Any]]: ...
def checkpoint_write_item_sizes(
    items: list[Any], byte_io_type: Any, element_sizes: dict[Any, int], global_sizing: bool, count_bytes: bool
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]: ...
def checkpoint_assign_bins(
    is_bytes: npt.NDArray[np.uint8], sizes: npt.NDArray[np.int64], bins: int, refined: bool
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

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
def eplb_balanced_packing(
    weight: npt.NDArray[Any], order: npt.NDArray[np.int64], num_packs: int, num_threads: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def eplb_replicate_experts(
    weight: npt.NDArray[Any], num_phy: int, num_threads: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
