// Gradient-bucket planning: Megatron's DDP / distributed-optimizer buffer layout, bucket groups and
// per-rank shard ranges, on plain arrays. O(params + ranks * buckets) time and memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/parallel.h"

namespace trainfast::buckets {

struct LayoutOptions {
  std::optional<int64_t> bucket_size;  // nullopt: one bucket per buffer
  int64_t data_parallel_world_size = 1;
  bool use_distributed_optimizer = true;  // false: Megatron's default (unpadded) layout
  bool pad_buckets_for_high_nccl_busbw = false;
};

struct Layout {
  std::vector<int64_t> param_start;                // [num_params] model order
  std::vector<int64_t> param_end;                  // [num_params]
  std::vector<int64_t> bucket_id;                  // [num_params]
  std::vector<int64_t> bucket_indices;             // [num_buckets * 2] (start, end) pairs
  std::vector<int64_t> per_bucket_numel_unpadded;  // [num_buckets]
  int64_t numel = 0;
  int64_t numel_unpadded = 0;
};

// numels[i] >= 0 is param i's element count (model order); shared_embedding is empty or has one
// flag per param. Params are laid out in reverse (backprop) order as Megatron does.
Layout plan_layout(std::span<const int64_t> numels, std::span<const uint8_t> shared_embedding,
                   const LayoutOptions& options, Interrupt* interrupt = nullptr);

// Megatron's `_pad`: ceil(value / divisor) * divisor with the quotient rounded to a float as
// Python's division rounds it (equal to exact integer rounding below 2**53, not always above).
int64_t pad_to_divisor(int64_t value, int64_t divisor);

// lcm(dp, 128) or lcm(dp, 128, 2**16): the bucket-end divisor of the distributed optimizer.
int64_t bucket_end_divisor(int64_t data_parallel_world_size, bool pad_for_high_nccl_busbw);


using Int64Buffer = UninitializedBuffer<int64_t>;

// A param's part of one rank's shard, as DistributedOptimizer._build_model_gbuf_param_range_map
// gives it: the param spans buffer offsets [param_start, param_end), the shard [world_start,
// world_end). Megatron's four ranges are gbuf_local [local_start, local_end), gbuf_world (the same
// plus world_start), gbuf_world_in_bucket (that minus the bucket's offset) and param
// [param_offset, param_offset + local_end - local_start). Offsets are in (-2^62, 2^62).
struct ParamShardRange {
  int64_t local_start, local_end;  // within the shard
  int64_t param_offset;            // where the part starts within the param
  bool owned() const { return local_end > local_start; }  // false: no overlap, no entry
};

inline ParamShardRange param_shard_range(int64_t world_start, int64_t world_end, int64_t param_start,
                                         int64_t param_end) {
  return {std::max<int64_t>(0, param_start - world_start), std::min(world_end, param_end) - world_start,
          std::max<int64_t>(0, world_start - param_start)};
}

struct ShardRanges {
  // One row per (rank, bucket, owned param), ordered by rank, bucket, then layout order.
  Int64Buffer rank, bucket, param;  // [n]; param indexes the input arrays
  Int64Buffer gbuf_world;            // [n * 2]
  Int64Buffer gbuf_world_in_bucket;  // [n * 2]
  Int64Buffer gbuf_local;            // [n * 2]
  Int64Buffer param_range;           // [n * 2]
};

// Shard ranges of ranks [rank_begin, rank_end) of a layout given as arrays. Layout order is the
// arrays' order, or their reverse when `reverse_order` (plan_layout's model-order output). Every
// bucket's padded size must divide by data_parallel_world_size.
ShardRanges shard_ranges(std::span<const int64_t> param_start, std::span<const int64_t> param_end,
                         std::span<const int64_t> bucket_id, std::span<const int64_t> bucket_indices,
                         int64_t data_parallel_world_size, int64_t rank_begin, int64_t rank_end,
                         bool reverse_order, int num_threads, Interrupt* interrupt = nullptr);

struct BucketGroups {
  std::vector<int64_t> group_offsets;  // [num_groups + 1]
  std::vector<int64_t> members;        // [num_members * 2] (buffer, bucket) pairs in group order
};

// Megatron's partition_buckets on counts: buffer b has num_buckets[b] buckets; is_uint8[b] marks an
// fp8 (uint8-storage) buffer. At most one uint8 buffer.
BucketGroups partition_buckets(std::span<const uint8_t> is_uint8, std::span<const int64_t> num_buckets,
                               bool force_single_bucket_group,
                               bool reduce_scatter_with_fp32_accumulation);

}  // namespace trainfast::buckets
