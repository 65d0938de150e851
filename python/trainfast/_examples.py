"""Realistic synthetic inputs shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

import math
import random
from typing import Any


def gpt_write_items(
    num_layers: int = 48,
    hidden: int = 4096,
    ffn_hidden: int = 14336,
    num_experts: int = 16,
    expert_ffn_hidden: int = 2048,
    vocab_size: int = 128256,
    tp: int = 8,
    dp: int = 8,
    dp_rank: int = 3,
    seed: int = 0,
) -> list[Any]:
    """One rank's write plan of a GPT-style MoE Megatron checkpoint, as torch DCP WriteItems.

    Model weights (bf16) are SHARD items whose chunk is this TP rank's slice of the global tensor.
    Distributed-optimizer state (fp32 main param, exp_avg, exp_avg_sq) lives in a flat buffer split
    evenly over ``dp`` ranks: this rank writes the intersection of its range with each parameter, so
    most of those chunks are a small part of their global tensor. A few BYTE_IO items (common state,
    RNG, args, param groups) are interleaved. The defaults give about 1,500 items.
    """
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    rng = random.Random(seed)
    items: list[Any] = []

    def add_bytes(name: str) -> None:
        items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))

    def add_shard(name: str, global_shape: tuple[int, ...], chunk_offsets: tuple[int, ...],
                  chunk_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        items.append(
            WriteItem(
                index=MetadataIndex(name, torch.Size(chunk_offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk_offsets), sizes=torch.Size(chunk_shape)),
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(global_shape),
                ),
            )
        )

    tp_rank = rng.randrange(tp)
    add_bytes("common.pt")
    add_bytes("rng_state")
    # (name, global shape, dim split over TP or -1 when replicated)
    weights: list[tuple[str, tuple[int, ...], int]] = [("embedding.word_embeddings.weight", (vocab_size, hidden), 0)]
    for layer in range(num_layers):
        prefix = f"decoder.layers.{layer}"
        weights += [
            (f"{prefix}.input_layernorm.weight", (hidden,), -1),
            (f"{prefix}.self_attention.linear_qkv.weight", (hidden + hidden // 2, hidden), 0),
            (f"{prefix}.self_attention.linear_proj.weight", (hidden, hidden), 1),
            (f"{prefix}.pre_mlp_layernorm.weight", (hidden,), -1),
        ]
        if layer % 2 == 0:
            weights += [
                (f"{prefix}.mlp.linear_fc1.weight", (2 * ffn_hidden, hidden), 0),
                (f"{prefix}.mlp.linear_fc2.weight", (hidden, ffn_hidden), 1),
            ]
        else:
            weights.append((f"{prefix}.mlp.router.weight", (num_experts, hidden), -1))
            for expert in range(num_experts):
                weights += [
                    (f"{prefix}.mlp.experts.{expert}.linear_fc1.weight", (2 * expert_ffn_hidden, hidden), 0),
                    (f"{prefix}.mlp.experts.{expert}.linear_fc2.weight", (hidden, expert_ffn_hidden), 1),
                ]
    weights.append(("output_layer.weight", (vocab_size, hidden), 0))
    add_bytes("args")
    local_numels = []
    for name, shape, split_dim in weights:
        chunk = list(shape)
        offsets = [0] * len(shape)
        if split_dim >= 0:
            chunk[split_dim] //= tp
            offsets[split_dim] = tp_rank * chunk[split_dim]
        add_shard(name, shape, tuple(offsets), tuple(chunk), torch.bfloat16)
        local_numels.append(math.prod(chunk))
    add_bytes("optimizer.param_groups")
    total = sum(local_numels)
    range_start, range_end = dp_rank * total // dp, (dp_rank + 1) * total // dp
    param_start = 0
    for (name, _, _), numel in zip(weights, local_numels):
        start, end = max(param_start, range_start), min(param_start + numel, range_end)
        if start < end:
            for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
                add_shard(f"optimizer.state.{state}.{name}", (numel,), (start - param_start,), (end - start,),
                          torch.float32)
        param_start += numel
    return items


def many_write_items(num_items: int, seed: int = 0) -> list[Any]:
    """``num_items`` WriteItems from repeated GPT plans (layer copies), for benchmarks at 10^6 items."""
    items: list[Any] = []
    base_seed = seed
    while len(items) < num_items:
        items += gpt_write_items(seed=base_seed)
        base_seed += 1
    return items[:num_items]
