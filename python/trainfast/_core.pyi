# Type stub of the private native module trainfast._core (csrc/bindings/). tests/test_package.py
# checks that every name the module exports is declared here.
from collections.abc import Callable, Sequence
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
    def add_file(self, path: str, progress: Callable[[int], object] | None = None) -> None: ...
    def add_documents(
        self, documents: list[str | bytes], first_index: int = 0, progress: Callable[[int], object] | None = None
    ) -> None: ...
    def finish(self) -> dict[bytes, int]: ...

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
