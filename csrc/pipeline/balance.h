// Cost-balanced pipeline layouts: split layers into pp * vpp contiguous chunks (chunk c on pipeline
// rank c % pp) minimising the most expensive chunk exactly, then lowering the most expensive stage.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/parallel.h"

namespace trainfast::pipeline {

struct BalancedSplit {
  std::vector<int64_t> boundaries;  // [pp * vpp + 1]: chunk c is layers [boundaries[c], boundaries[c+1])
  std::vector<double> chunk_costs;  // [pp * vpp]
  std::vector<double> stage_costs;  // [pp]: sum of the stage's chunk costs in virtual-stage order
  double max_chunk_cost = 0;        // the exact optimum
  double max_stage_cost = 0;
};

// A chunk's cost is its layers' costs added left to right in double precision, starting with
// embedding_cost on the chunk holding layer 0 and ending with loss_cost on the one holding the last
// layer. max_chunk_cost is the exact minimum over all splits (every chunk >= 1 layer); among the
// splits reaching it, a deterministic local search lowers the maximum stage cost. `interrupt`
// (polled from the calling thread) stops long searches with Interrupted.
BalancedSplit balanced_split(std::span<const double> layer_costs, int64_t pp, int64_t vpp,
                             double embedding_cost, double loss_cost, Interrupt* interrupt = nullptr);

}  // namespace trainfast::pipeline
