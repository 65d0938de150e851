// DeepSeek's expert-parallel load balancer (deepseek-ai/EPLB `eplb.py`) on plain arrays.
//
// The hierarchical policy runs in two stages so that a caller can supply the two descending orders
// upstream takes from torch's (non-stable) sort: `replicate` needs the order of the group loads,
// `place` the order of the per-replica loads that `replicate` produced. Passing empty orders sorts
// natively (ties by lowest index), which is the torch-independent "stable" mode.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/parallel.h"

namespace trainfast::eplb {

template <typename T>
using Buffer = ::trainfast::UninitializedBuffer<T>;

// A hierarchical problem; the global policy is num_groups = num_nodes = 1.
struct Shape {
  int64_t num_layers = 0;
  int64_t num_logical = 0;   // logical experts per layer
  int64_t num_physical = 0;  // physical slots per layer (replicas)
  int64_t num_groups = 1;
  int64_t num_nodes = 1;
  int64_t num_gpus = 1;

  int64_t group_size() const { return num_logical / num_groups; }
  int64_t groups_per_node() const { return num_groups / num_nodes; }
  int64_t logical_per_node() const { return num_logical / num_nodes; }
  int64_t physical_per_node() const { return num_physical / num_nodes; }
  int64_t gpus_per_node() const { return num_gpus / num_nodes; }
  int64_t slots_per_gpu() const { return num_physical / num_gpus; }
};

// Throws std::invalid_argument naming the first bad argument (upstream's asserts plus positivity).
void check_shape(const Shape& shape);

// Throws std::invalid_argument naming weight[layer, expert] when a load is NaN, infinite or < 0.
void check_loads(std::span<const float> weight, int64_t num_layers, int64_t num_logical);

// Integer loads [L, E] as float32 (IEEE round-to-nearest, like torch's .float()), checked like
// check_loads. When num_groups > 0 and every group's float32 sum is exact whatever the order of
// additions (integral loads, each group's total <= 2^24), also writes those sums into group_loads
// [L, num_groups] (then equal to torch's sum bit for bit) and returns true.
template <typename Int>
bool int_loads(std::span<const Int> weight, int64_t num_layers, int64_t num_logical, int64_t num_groups,
               std::span<float> out, std::span<float> group_loads);

// Result of stage 1: groups packed onto nodes, then replicas chosen within each node.
// "mlog" numbers logical experts node-major (node, arrival rank of the group, member).
struct Replication {
  Shape shape;
  // 32-bit internally (check_shape bounds the sizes): half the memory traffic of int64.
  Buffer<int32_t> log2mlog;          // [L, E]
  Buffer<int32_t> mlog2log;          // [L, E]
  Buffer<int32_t> phy2mlog;          // [L * N, P / N] node-local logical id of each replica
  Buffer<int32_t> phy_rank;          // [L * N, P / N] replica rank
  Buffer<int32_t> mlog_count;        // [L * N, E / N] replicas per node-local expert
  Buffer<float> replica_loads;       // [L * N, P / N] float32 load / count of each replica
};

// weight [L, E] float32. group_loads [L, G] and group_order [L, G] (each row a descending order of
// group_loads) come from torch in the bit-identical mode; both empty: float32 sequential sums and a
// native order with ties by lowest index.
Replication replicate(std::span<const float> weight, const Shape& shape,
                      std::span<const float> group_loads, std::span<const int64_t> group_order,
                      int num_threads, Interrupt* interrupt = nullptr);

struct PlaceOptions {
  bool refine = false;                // swap replicas out of the heaviest GPU of each node
  bool avoid_gpu_duplicates = false;  // prefer GPUs not yet holding a replica of the same expert
};

struct Placement {
  Buffer<int64_t> phy2log;   // [L, P]
  Buffer<int64_t> phy_rank;  // [L, P]
  Buffer<int64_t> logcnt;    // [L, E]
  Buffer<int64_t> log2phy;   // [L, E, max_count], -1 padded
  int64_t max_count = 0;
};

// Stage 2: each node's replicas onto its GPUs. replica_order [L * N, P / N] is a descending order of
// replication.replica_loads per row (from torch), or empty for the native order.
Placement place(const Replication& replication, std::span<const int64_t> replica_order,
                const PlaceOptions& options, int num_threads, Interrupt* interrupt = nullptr);

// Upstream's helpers on [rows, n] arrays. `order` holds each row's descending order (always
// required). Pack loads accumulate in Value's type (int64 wraps like torch).
template <typename Value>
void balanced_packing(std::span<const Value> weight, int64_t num_rows, int64_t num_items,
                      std::span<const int64_t> order, int64_t num_packs, std::span<int64_t> pack_index,
                      std::span<int64_t> rank_in_pack, int num_threads, Interrupt* interrupt = nullptr);

// Per-replica loads are compared as Quotient (float for float32 and integer weights, as torch's
// true division; double for float64).
template <typename Value>
void replicate_experts(std::span<const Value> weight, int64_t num_rows, int64_t num_log, int64_t num_phy,
                       std::span<int64_t> phy2log, std::span<int64_t> rank, std::span<int64_t> logcnt,
                       int num_threads, Interrupt* interrupt = nullptr);

// Checks that every row of order [num_rows, n] is a permutation of 0..n-1 ("name" for errors).
void check_order(std::span<const int64_t> order, int64_t num_rows, int64_t n, const char* name);

// For each of num_matrices square [n, n] matrices laid out back to back in `weight`, the
// permutation assignment[i] (the column given to row i) with the largest sum of weight[i, column]
// (Hungarian method, shortest augmenting paths, O(n^3) per matrix; minimum-cost ties to the lowest
// column). Entries must lie in [0, 2^40). The minimal-migration option matches GPUs with it.
void max_weight_assignment(std::span<const int64_t> weight, int64_t num_matrices, int64_t n,
                           std::span<int64_t> assignment, int num_threads, Interrupt* interrupt = nullptr);

}  // namespace trainfast::eplb
