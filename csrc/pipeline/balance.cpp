#include "pipeline/balance.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "pipeline/plan.h"

namespace trainfast::pipeline {
namespace {

struct Problem {
  std::span<const double> costs;
  int64_t n;
  double embedding;
  double loss;

  double cost(int64_t begin, int64_t end) const {
    double sum = begin == 0 ? embedding : 0.0;
    for (int64_t i = begin; i < end; ++i) sum += costs[i];
    return end == n ? sum + loss : sum;
  }

  // Last end e > begin with cost(begin, e) <= limit (costs grow with e), or begin if none.
  int64_t reach(int64_t begin, double limit, int64_t max_end) const {
    double sum = begin == 0 ? embedding : 0.0;
    int64_t end = begin;
    while (end < max_end) {
      const double next = sum + costs[end];
      const double total = end + 1 == n ? next + loss : next;
      if (total > limit) break;
      sum = next;
      ++end;
    }
    return end;
  }

  // Fewest chunks of cost <= limit covering all layers (greedy is optimal: costs are monotone in
  // both ends, also under rounding); a value above max_chunks means "does not fit".
  int64_t min_chunks(double limit, int64_t max_chunks) const {
    int64_t chunks = 0;
    for (int64_t begin = 0; begin < n;) {
      const int64_t end = reach(begin, limit, n);
      if (end == begin || ++chunks > max_chunks) return max_chunks + 1;
      begin = end;
    }
    return chunks;
  }
};

double stage_sum(const std::vector<double>& chunk_costs, int64_t pp, int64_t stage, int64_t replaced,
                 double replacement) {
  double sum = 0.0;
  for (int64_t c = stage; c < static_cast<int64_t>(chunk_costs.size()); c += pp) {
    sum += c == replaced ? replacement : chunk_costs[c];
  }
  return sum;
}

}  // namespace

double chunk_cost(std::span<const double> layer_costs, int64_t begin, int64_t end, double embedding_cost,
                  double loss_cost) {
  const Problem problem{layer_costs, static_cast<int64_t>(layer_costs.size()), embedding_cost, loss_cost};
  return problem.cost(begin, end);
}

BalancedSplit balanced_split(std::span<const double> layer_costs, int64_t pp, int64_t vpp,
                             double embedding_cost, double loss_cost) {
  check_pp_vpp(pp, vpp, "pp", "vpp");
  const auto n = static_cast<int64_t>(layer_costs.size());
  const int64_t num_chunks = pp * vpp;
  if (n < num_chunks) {
    throw std::invalid_argument("layer_costs has " + std::to_string(n) + " layers, fewer than pp * vpp = " +
                                std::to_string(num_chunks) + " chunks: every chunk needs at least one layer");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!(std::isfinite(layer_costs[i]) && layer_costs[i] >= 0)) {
      throw std::invalid_argument("layer_costs[" + std::to_string(i) +
                                  "] must be a finite non-negative number (got " + std::to_string(layer_costs[i]) + ")");
    }
  }
  TF_CHECK_ARG(std::isfinite(embedding_cost) && embedding_cost >= 0, "embedding_cost", embedding_cost,
               "must be a finite non-negative number");
  TF_CHECK_ARG(std::isfinite(loss_cost) && loss_cost >= 0, "loss_cost", loss_cost,
               "must be a finite non-negative number");
  // -0.0 would sort below +0.0 by bit pattern; it adds like +0.0 anyway
  const Problem problem{layer_costs, n, embedding_cost + 0.0, loss_cost + 0.0};

  // Binary search on the bit pattern of the limit: non-negative doubles order like their bits.
  uint64_t lo = 0, hi = std::bit_cast<uint64_t>(std::numeric_limits<double>::infinity());
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (problem.min_chunks(std::bit_cast<double>(mid), num_chunks) <= num_chunks) hi = mid;
    else lo = mid + 1;
  }
  const double limit = std::bit_cast<double>(lo);

  // earliest[c]: first layer chunk c may start at so chunks c.. still fit under the limit.
  std::vector<int64_t> earliest(num_chunks + 1);
  earliest[num_chunks] = n;
  for (int64_t c = num_chunks - 1; c >= 1; --c) {
    const int64_t end = earliest[c + 1];
    int64_t a = 0, b = end - 1;  // cost(i, end) shrinks as i grows; find the smallest i that fits
    if (b > n - (num_chunks - c)) b = n - (num_chunks - c);
    while (a < b) {
      const int64_t m = a + (b - a) / 2;
      if (problem.cost(m, end) <= limit) b = m;
      else a = m + 1;
    }
    earliest[c] = a;
  }
  earliest[0] = 0;

  // Start from chunks near equal cost: aim boundary c at prefix cost c/K of the total, clamped to
  // positions that keep this chunk under the limit and the rest feasible.
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + layer_costs[i];
  const double total = prefix[n];
  std::vector<int64_t> bounds(num_chunks + 1);
  bounds[0] = 0;
  bounds[num_chunks] = n;
  int64_t cursor = 0;
  for (int64_t c = 1; c < num_chunks; ++c) {
    const double target = total * static_cast<double>(c) / static_cast<double>(num_chunks);
    while (cursor < n && prefix[cursor + 1] <= target) ++cursor;
    int64_t want = cursor;
    if (cursor < n && target - prefix[cursor] > prefix[cursor + 1] - target) want = cursor + 1;
    const int64_t low = std::max(earliest[c], bounds[c - 1] + 1);
    const int64_t high = std::min(problem.reach(bounds[c - 1], limit, n), n - (num_chunks - c));
    bounds[c] = std::min(std::max(want, low), high);
  }

  std::vector<double> chunk_costs(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) chunk_costs[c] = problem.cost(bounds[c], bounds[c + 1]);
  std::vector<double> stage_costs(pp);
  for (int64_t s = 0; s < pp; ++s) stage_costs[s] = stage_sum(chunk_costs, pp, s, -1, 0.0);

  // Local search: move one boundary when that lowers the larger of its two stages' costs while
  // both chunks stay under the limit. Each move shrinks the sorted stage-cost vector, so it ends.
  constexpr int64_t kMaxWindow = 256, kMaxPasses = 1000;
  for (int64_t pass = 0; pp > 1 && pass < kMaxPasses; ++pass) {
    bool moved = false;
    for (int64_t k = 1; k < num_chunks; ++k) {
      const int64_t left_stage = (k - 1) % pp, right_stage = k % pp;
      const int64_t begin = bounds[k - 1], end = bounds[k + 1];
      const double current = std::max(stage_costs[left_stage], stage_costs[right_stage]);
      const int64_t lo_pos = std::max(begin + 1, bounds[k] - kMaxWindow);
      const int64_t hi_pos = std::min(end - 1, bounds[k] + kMaxWindow);
      int64_t best_pos = -1;
      double best = current, best_left = 0, best_right = 0, best_left_stage = 0, best_right_stage = 0;
      for (int64_t pos = lo_pos; pos <= hi_pos; ++pos) {
        if (pos == bounds[k]) continue;
        const double left = problem.cost(begin, pos);
        if (left > limit) break;  // grows with pos
        const double right = problem.cost(pos, end);
        if (right > limit) continue;
        const double ls = stage_sum(chunk_costs, pp, left_stage, k - 1, left);
        const double rs = stage_sum(chunk_costs, pp, right_stage, k, right);
        const double worst = std::max(ls, rs);
        if (worst < best) {
          best = worst;
          best_pos = pos;
          best_left = left;
          best_right = right;
          best_left_stage = ls;
          best_right_stage = rs;
        }
      }
      if (best_pos >= 0) {
        bounds[k] = best_pos;
        chunk_costs[k - 1] = best_left;
        chunk_costs[k] = best_right;
        stage_costs[left_stage] = best_left_stage;
        stage_costs[right_stage] = best_right_stage;
        moved = true;
      }
    }
    if (!moved) break;
  }

  BalancedSplit out;
  out.boundaries = std::move(bounds);
  out.chunk_costs = std::move(chunk_costs);
  out.stage_costs = std::move(stage_costs);
  double worst_chunk = 0;  // equals the limit: a smaller maximum would have been feasible
  for (double c : out.chunk_costs) worst_chunk = std::max(worst_chunk, c);
  out.max_chunk_cost = worst_chunk;
  double worst_stage = 0;
  for (double s : out.stage_costs) worst_stage = std::max(worst_stage, s);
  out.max_stage_cost = worst_stage;
  return out;
}

}  // namespace trainfast::pipeline
