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

// When single and pair moves are stuck, shift boundaries i..j together by one layer (d = +1 or -1):
// chunk i-1 and chunk j change length, the chunks between slide, so load moves between stages that
// are not neighbours. For each i the move with the cheapest most expensive changed stage is taken if
// that stage is cheaper than the most expensive one it changes (so the search still ends).
bool chain_moves(const Problem& problem, double limit, int64_t pp, std::vector<int64_t>& bounds,
                 std::vector<double>& chunk_costs, std::vector<double>& stage_costs, Interrupt* interrupt) {
  const auto num_chunks = static_cast<int64_t>(chunk_costs.size());
  bool moved = false;
  std::vector<double> trial;  // new costs of chunks i-1 .. j
  std::vector<char> seen(pp);
  for (int64_t i = 1; i < num_chunks; ++i) {
    if (interrupt != nullptr) interrupt->check();
    double best = std::numeric_limits<double>::infinity();
    int64_t best_d = 0, best_j = -1;
    std::vector<double> best_trial;
    for (int64_t d : {int64_t{-1}, int64_t{1}}) {
      if (bounds[i] + d <= bounds[i - 1]) continue;
      trial.assign(1, problem.cost(bounds[i - 1], bounds[i] + d));
      if (trial[0] > limit) continue;
      for (int64_t j = i; j < num_chunks && j <= i + pp; ++j) {
        if (j > i) {  // chunk j-1 now slides whole
          const double slid = problem.cost(bounds[j - 1] + d, bounds[j] + d);
          if (slid > limit) break;
          trial.resize(j - i);
          trial.push_back(slid);
        }
        if (bounds[j] + d >= bounds[j + 1]) continue;
        trial.resize(j - i + 1);
        const double last = problem.cost(bounds[j] + d, bounds[j + 1]);
        if (last > limit) continue;
        trial.push_back(last);
        double old_max = 0, new_max = 0;
        std::fill(seen.begin(), seen.end(), 0);
        for (int64_t c = i - 1; c <= j; ++c) {
          const int64_t stage = c % pp;
          if (seen[stage]) continue;
          seen[stage] = 1;
          double sum = 0.0;
          for (int64_t k = stage; k < num_chunks; k += pp) sum += (k >= i - 1 && k <= j) ? trial[k - (i - 1)] : chunk_costs[k];
          old_max = std::max(old_max, stage_costs[stage]);
          new_max = std::max(new_max, sum);
        }
        if (new_max < old_max && new_max < best) {
          best = new_max;
          best_d = d;
          best_j = j;
          best_trial = trial;
        }
      }
    }
    if (best_j < 0) continue;
    for (int64_t c = i; c <= best_j; ++c) bounds[c] += best_d;
    for (int64_t c = i - 1; c <= best_j; ++c) chunk_costs[c] = best_trial[c - (i - 1)];
    for (int64_t c = i - 1; c <= best_j; ++c) stage_costs[c % pp] = stage_sum(chunk_costs, pp, c % pp, -1, 0.0);
    moved = true;
  }
  return moved;
}

}  // namespace

BalancedSplit balanced_split(std::span<const double> layer_costs, int64_t pp, int64_t vpp,
                             double embedding_cost, double loss_cost, Interrupt* interrupt) {
  auto poll = [interrupt] {
    if (interrupt != nullptr) interrupt->check();
  };
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
    poll();
    const uint64_t mid = lo + (hi - lo) / 2;
    if (problem.min_chunks(std::bit_cast<double>(mid), num_chunks) <= num_chunks) hi = mid;
    else lo = mid + 1;
  }
  const double limit = std::bit_cast<double>(lo);

  // earliest[c]: first layer chunk c may start at so chunks c.. still fit under the limit.
  std::vector<int64_t> earliest(num_chunks + 1);
  earliest[num_chunks] = n;
  for (int64_t c = num_chunks - 1; c >= 1; --c) {
    poll();
    const int64_t end = earliest[c + 1];
    // chunks before c need a layer each; cost(i, end) shrinks as i grows: find the smallest i that fits
    int64_t a = c, b = end - 1;
    if (b > n - (num_chunks - c)) b = n - (num_chunks - c);
    while (a < b) {
      const int64_t m = a + (b - a) / 2;
      if (problem.cost(m, end) <= limit) b = m;
      else a = m + 1;
    }
    earliest[c] = a;
  }
  earliest[0] = 0;

  // First split: each chunk aims at what keeps its stage on track for total / pp (the stage's earlier
  // chunks' error is made up by its later ones), within the window that keeps the rest feasible.
  double total = embedding_cost + 0.0;
  for (int64_t i = 0; i < n; ++i) total += layer_costs[i];
  const double ideal = (total + problem.loss) / static_cast<double>(pp);
  std::vector<int64_t> bounds(num_chunks + 1);
  bounds[0] = 0;
  bounds[num_chunks] = n;
  std::vector<double> stage_so_far(pp, 0.0);
  for (int64_t c = 1; c < num_chunks; ++c) {
    poll();
    const int64_t stage = (c - 1) % pp, v = (c - 1) / pp, begin = bounds[c - 1];
    const double target = static_cast<double>(v + 1) * ideal / static_cast<double>(vpp) - stage_so_far[stage];
    const int64_t low = std::max(earliest[c], begin + 1);
    const int64_t high = std::min(problem.reach(begin, limit, n), n - (num_chunks - c));
    double sum = begin == 0 ? problem.embedding : 0.0;  // cost(begin, end) for growing end
    for (int64_t i = begin; i < low; ++i) sum += layer_costs[i];
    int64_t best_end = low;
    double best_error = std::numeric_limits<double>::infinity(), best_cost = 0;
    for (int64_t end = low; end <= high; ++end) {
      if (end > low) sum += layer_costs[end - 1];
      const double chunk = end == n ? sum + problem.loss : sum;
      const double error = std::abs(chunk - target);
      if (error < best_error) {
        best_error = error;
        best_end = end;
        best_cost = chunk;
      }
    }
    bounds[c] = best_end;
    stage_so_far[stage] += best_cost;
  }

  std::vector<double> chunk_costs(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) chunk_costs[c] = problem.cost(bounds[c], bounds[c + 1]);
  std::vector<double> stage_costs(pp);
  for (int64_t s = 0; s < pp; ++s) stage_costs[s] = stage_sum(chunk_costs, pp, s, -1, 0.0);

  // Local search over moves of boundary k (anywhere between its neighbours) and of boundaries k and
  // k+1 together (each by up to kPairStep, which trades small cost differences). A move is taken when
  // every chunk stays under the limit and the most expensive stage among those it changes gets
  // cheaper; among those, the one with the cheapest most expensive stage around k wins (first on a
  // tie). Every move shrinks the descending-sorted stage costs, so the search ends.
  constexpr int64_t kMaxWindow = 256, kPairStep = 2, kMaxPasses = 1000;
  struct Move {
    int64_t b1, b2;
    double costs[3];
  };
  for (int64_t pass = 0; pp > 1 && pass < kMaxPasses; ++pass) {
    bool moved = false;
    for (int64_t k = 1; k < num_chunks; ++k) {
      poll();
      const bool has_next = k + 1 < num_chunks;
      const int64_t b0 = bounds[k - 1], b1 = bounds[k], b2 = bounds[k + 1];
      const int64_t b3 = has_next ? bounds[k + 2] : n;
      const int64_t stages[3] = {(k - 1) % pp, k % pp, (k + 1) % pp};
      const int num_around = has_next ? 3 : 2;
      double best_score = std::numeric_limits<double>::infinity();
      Move best{-1, -1, {0, 0, 0}};
      auto consider = [&](int64_t nb1, int64_t nb2) {
        if (!(b0 < nb1 && nb1 < nb2 && (has_next ? nb2 < b3 : nb2 == n))) return;
        const bool left_changed = nb1 != b1, next_changed = nb2 != b2;
        Move move{nb1, nb2, {chunk_costs[k - 1], 0.0, has_next ? chunk_costs[k + 1] : 0.0}};
        if (left_changed && (move.costs[0] = problem.cost(b0, nb1)) > limit) return;
        if ((move.costs[1] = problem.cost(nb1, nb2)) > limit) return;
        if (next_changed && (move.costs[2] = problem.cost(nb2, b3)) > limit) return;
        double old_changed = 0, new_changed = 0, score = 0;
        for (int i = 0; i < num_around; ++i) {
          const int64_t stage = stages[i];
          double sum = 0.0;
          for (int64_t c = stage; c < num_chunks; c += pp) {
            sum += (c >= k - 1 && c <= k + 1 && c - (k - 1) < num_around) ? move.costs[c - (k - 1)] : chunk_costs[c];
          }
          score = std::max(score, sum);
          const bool changed = (i == 0 && left_changed) || i == 1 || (i == 2 && next_changed);
          if (changed) {
            old_changed = std::max(old_changed, stage_costs[stage]);
            new_changed = std::max(new_changed, sum);
          }
        }
        if (new_changed < old_changed && score < best_score) {
          best_score = score;
          best = move;
        }
      };
      for (int64_t nb1 = std::max(b0 + 1, b1 - kMaxWindow); nb1 <= std::min(b2 - 1, b1 + kMaxWindow); ++nb1) {
        if (nb1 != b1) consider(nb1, b2);
      }
      for (int64_t d1 = -kPairStep; has_next && d1 <= kPairStep; ++d1) {
        for (int64_t d2 = -kPairStep; d2 <= kPairStep; ++d2) {
          if (d2 != 0) consider(b1 + d1, b2 + d2);
        }
      }
      if (best.b1 < 0) continue;
      bounds[k] = best.b1;
      if (has_next) bounds[k + 1] = best.b2;
      for (int i = 0; i < num_around; ++i) chunk_costs[k - 1 + i] = best.costs[i];
      for (int i = 0; i < num_around; ++i) stage_costs[stages[i]] = stage_sum(chunk_costs, pp, stages[i], -1, 0.0);
      moved = true;
    }
    if (!moved) moved = chain_moves(problem, limit, pp, bounds, chunk_costs, stage_costs, interrupt);
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
