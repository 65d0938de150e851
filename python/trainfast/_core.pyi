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

# --- bpe training (csrc/bindings/bpe_train.cpp) ---
def bpe_train_merges(
    word_counts: dict[bytes, int], num_merges: int, progress: Any = None
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
