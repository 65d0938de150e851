// Checkpoint write-item binning: Megatron's / torch DCP's `_split_by_size_and_type` on plain arrays.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/parallel.h"

namespace trainfast::checkpoint {

enum class Balance {
  kUpstream,  // bit-identical to upstream: bytes round-robin (sizes ignored), tensors greedy LPT
  kRefined,   // byte sizes counted, then moves/swaps out of the heaviest bin until none helps
              // or a work budget of O((n + bins) log n) is spent; upstream's own plan is refined
              // too (when byte sizes make the bins differ) and the lighter maximum kept, so the
              // result is never heavier than upstream's
};

struct BinPlan {
  std::vector<int64_t> bin_idx;      // [num_items] bin of each item
  std::vector<int64_t> order;        // [num_items] item indices grouped by bin: byte items in input order, then tensors by size
  std::vector<int64_t> bin_offsets;  // [num_bins + 1] bin b is order[bin_offsets[b]:bin_offsets[b+1]]
  std::vector<int64_t> bin_bytes;    // [num_bins] counted bytes per bin
};

// is_bytes[i] != 0 marks a BYTE_IO item; sizes[i] >= 0 is its size in bytes (ignored for byte items
// under kUpstream). Throws std::invalid_argument on bad input; nothing is returned half-done.
// `interrupt` (polled from the calling thread) stops long plans with Interrupted.
BinPlan assign_bins(std::span<const uint8_t> is_bytes, std::span<const int64_t> sizes,
                    int64_t num_bins, Balance balance = Balance::kUpstream, Interrupt* interrupt = nullptr);

}  // namespace trainfast::checkpoint
