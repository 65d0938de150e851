#include "checkpoint/binning.h"

#include <algorithm>
#include <array>
#include <bit>
#include <functional>
#include <queue>
#include <set>
#include <utility>

#include "common/check.h"
#include "common/checked_math.h"
#include "common/memory.h"

namespace trainfast::checkpoint {
namespace {

// Ctrl-C checks in the long loops: every kPollEvery items (a check reads the clock).
constexpr size_t kPollEvery = size_t{1} << 16;
void poll(Interrupt* interrupt) {
  if (interrupt != nullptr) interrupt->check();
}

// Below this many bins a linear scan for the lightest bin beats a heap.
constexpr int64_t kLinearScanMaxBins = 32;
// Bound on refinement steps; each step strictly lowers the sum of squared bin loads, so this only
// guards against pathological inputs taking quadratic time.
constexpr int64_t kMaxRefineSteps = 100000;
// Refinement work budget (comparisons and element shifts): kRefineWorkPerItem * m * log2(m) for
// m = items + bins, at least kRefineMinWork (small inputs always refine to a local optimum).
constexpr int64_t kRefineWorkPerItem = 16;
constexpr int64_t kRefineMinWork = int64_t{1} << 24;

// Tensor items sorted by size, largest first, stable; sizes carried along so the greedy pass reads
// them sequentially instead of gathering from the input.
struct SortedItems {
  std::vector<int64_t> idx;
  std::vector<int64_t> size;
};

// Stable LSD radix sort by a 64-bit unsigned key; byte positions on which every key agrees are
// skipped (real sizes rarely use more than 5 of the 8 bytes).
void radix_sort_by_key(std::vector<int64_t>& idx, std::vector<uint64_t>& keys, Interrupt* interrupt) {
  const size_t n = idx.size();
  if (n < 2) return;
  uint64_t all_or = 0, all_and = ~uint64_t{0};
  for (uint64_t k : keys) {
    all_or |= k;
    all_and &= k;
  }
  const uint64_t varying = all_or ^ all_and;
  std::vector<int64_t> idx_tmp(n);
  std::vector<uint64_t> key_tmp(n);
  for (int shift = 0; shift < 64; shift += 8) {
    if (((varying >> shift) & 0xff) == 0) continue;
    poll(interrupt);
    std::array<size_t, 257> count{};
    for (uint64_t k : keys) ++count[((k >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (size_t i = 0; i < n; ++i) {
      const size_t dst = count[(keys[i] >> shift) & 0xff]++;
      idx_tmp[dst] = idx[i];
      key_tmp[dst] = keys[i];
    }
    idx.swap(idx_tmp);
    keys.swap(key_tmp);
  }
}

// Real plans repeat a few hundred shapes: when there are few distinct sizes, rank them and do one
// stable counting-sort pass. Returns false (and leaves `out` empty) when there are too many.
bool sort_few_distinct_sizes(const std::vector<int64_t>& idx, std::span<const int64_t> sizes,
                             SortedItems& out, Interrupt* interrupt) {
  constexpr size_t kMaxDistinct = 2048;
  constexpr size_t kSlots = 4 * kMaxDistinct;  // open addressing, power of two, load <= 1/4
  std::vector<int64_t> slot_size(kSlots, -1);   // sizes are >= 0, so -1 marks an empty slot
  std::vector<int32_t> slot_rank(kSlots, 0);
  std::vector<int64_t> distinct;
  auto slot_of = [&](int64_t size) {
    size_t h = static_cast<size_t>(static_cast<uint64_t>(size) * 0x9E3779B97F4A7C15ull >> 51);
    while (slot_size[h] != -1 && slot_size[h] != size) h = (h + 1) & (kSlots - 1);
    return h;
  };
  for (int64_t i : idx) {
    const size_t h = slot_of(sizes[i]);
    if (slot_size[h] == -1) {
      if (distinct.size() == kMaxDistinct) return false;
      slot_size[h] = sizes[i];
      distinct.push_back(sizes[i]);
    }
  }
  poll(interrupt);
  std::sort(distinct.begin(), distinct.end(), std::greater<int64_t>());
  for (size_t r = 0; r < distinct.size(); ++r) slot_rank[slot_of(distinct[r])] = static_cast<int32_t>(r);
  std::vector<int64_t> start(distinct.size() + 1, 0);
  for (int64_t i : idx) ++start[slot_rank[slot_of(sizes[i])] + 1];
  for (size_t r = 0; r < distinct.size(); ++r) start[r + 1] += start[r];
  poll(interrupt);
  out.idx.resize(idx.size());
  out.size.resize(idx.size());
  for (int64_t i : idx) {
    const int32_t rank = slot_rank[slot_of(sizes[i])];
    const int64_t dst = start[rank]++;
    out.idx[dst] = i;
    out.size[dst] = distinct[rank];
  }
  return true;
}

// Greedy longest-processing-time: each item (already in descending size order) goes to the bin with
// the smallest load, ties to the lowest bin index, exactly like upstream's heap of (load, bin).
void greedy_assign(const SortedItems& sorted, std::vector<int64_t>& bin_load,
                   std::vector<int64_t>& bin_idx, Interrupt* interrupt) {
  const int64_t num_bins = static_cast<int64_t>(bin_load.size());
  const size_t num_sorted = sorted.idx.size();
  if (num_bins <= kLinearScanMaxBins) {
    std::array<int64_t, kLinearScanMaxBins> load{};
    std::copy(bin_load.begin(), bin_load.end(), load.begin());
    for (size_t k = 0; k < num_sorted; ++k) {
      if (k % kPollEvery == 0) poll(interrupt);
      // Branch-free (conditional moves): which bin is lightest is unpredictable.
      int64_t best = 0;
      int64_t best_load = load[0];
      for (int64_t b = 1; b < num_bins; ++b) {
        const bool lighter = load[b] < best_load;
        best_load = lighter ? load[b] : best_load;
        best = lighter ? b : best;
      }
      bin_idx[sorted.idx[k]] = best;
      load[best] += sorted.size[k];
    }
    std::copy(load.begin(), load.begin() + num_bins, bin_load.begin());
    return;
  }
  using Entry = std::pair<int64_t, int64_t>;  // (load, bin)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64_t b = 0; b < num_bins; ++b) heap.emplace(bin_load[b], b);
  for (size_t k = 0; k < num_sorted; ++k) {
    if (k % kPollEvery == 0) poll(interrupt);
    auto [load, bin] = heap.top();
    heap.pop();
    bin_idx[sorted.idx[k]] = bin;
    bin_load[bin] = load + sorted.size[k];
    heap.emplace(bin_load[bin], bin);
  }
}

// One candidate change between the heaviest bin and another bin: move `from_item` out of the heavy
// bin, and `to_item` (or -1) back into it.
struct Change {
  int64_t new_pair_max;
  int64_t other_bin;
  int64_t from_item;
  int64_t to_item;
};

// ceil(log2(n + 1)) + 1: comparisons charged for one binary search over n entries.
int64_t search_cost(size_t n) { return std::bit_width(n) + 1; }

// Local search after the greedy pass. Per bin, items are kept sorted by (size, item index) so the best
// move/swap toward an even split of the pair is found by binary search. Each step takes the change
// with the lowest new pair maximum (ties: lowest other bin, then first found) and strictly lowers the
// sum of squared loads, so the maximum never rises above the greedy's. Cost is bounded: other bins are
// visited lightest first and skipped once even a perfect split could not beat the best change found,
// and all work (comparisons, element shifts) is charged against a budget of O((n + bins) log n), after
// which refining stops with the improvements made so far (deterministic: the budget counts work, not time).
void refine(std::span<const int64_t> sizes, std::vector<int64_t>& bin_load,
            std::vector<int64_t>& bin_idx, Interrupt* interrupt) {
  const int64_t num_bins = static_cast<int64_t>(bin_load.size());
  const size_t num_items = sizes.size();
  using SizedItem = std::pair<int64_t, int64_t>;  // (size, item)
  std::vector<std::vector<SizedItem>> members(num_bins);
  for (size_t i = 0; i < num_items; ++i) {
    members[bin_idx[i]].emplace_back(sizes[i], static_cast<int64_t>(i));
  }
  for (auto& m : members) std::sort(m.begin(), m.end());
  std::set<std::pair<int64_t, int64_t>> by_load;  // (load, bin)
  for (int64_t b = 0; b < num_bins; ++b) by_load.emplace(bin_load[b], b);

  const size_t scale = num_items + static_cast<size_t>(num_bins);
  int64_t budget = std::max<int64_t>(kRefineMinWork, kRefineWorkPerItem * static_cast<int64_t>(scale) *
                                                         search_cost(scale));
  for (int64_t step = 0; step < kMaxRefineSteps && budget > 0; ++step) {
    poll(interrupt);
    // The heaviest bin, lowest index among equals.
    const int64_t heavy_load = by_load.rbegin()->first;
    const int64_t heavy = by_load.lower_bound({heavy_load, -1})->second;
    const auto& heavy_items = members[heavy];
    Change best{heavy_load, -1, -1, -1};
    auto consider = [&](int64_t other, int64_t delta, int64_t from_item, int64_t to_item) {
      // Moving `delta` bytes from the heavy bin to `other`.
      const int64_t pair_max = std::max(heavy_load - delta, bin_load[other] + delta);
      if (pair_max < best.new_pair_max ||
          (best.other_bin >= 0 && pair_max == best.new_pair_max && other < best.other_bin)) {
        best = {pair_max, other, from_item, to_item};
      }
    };
    for (const auto& [other_load, other] : by_load) {
      const int64_t gap = heavy_load - other_load;
      if (gap <= 1) break;  // ascending loads: no later bin can take anything either
      // No change with a later (heavier) bin can beat a perfect split with this one.
      if (heavy_load - gap / 2 > best.new_pair_max) break;
      if (budget <= 0) break;  // out of work: apply the best change found so far, then stop
      const int64_t half = gap / 2;
      budget -= search_cost(heavy_items.size());
      // Best single move: the item whose size is closest to gap/2 with 0 < size < gap.
      auto it = std::lower_bound(heavy_items.begin(), heavy_items.end(), SizedItem{half, -1});
      for (auto cand : {it, it == heavy_items.begin() ? heavy_items.end() : std::prev(it)}) {
        if (cand != heavy_items.end() && cand->first > 0 && cand->first < gap) {
          consider(other, cand->first, cand->second, -1);
        }
      }
      // Best swap: a from heavy, b from other with 0 < a - b < gap and a - b closest to gap/2.
      const auto& other_items = members[other];
      if (other_items.empty()) continue;
      const int64_t per_search = search_cost(other_items.size());
      for (size_t k = 0; k < heavy_items.size(); ++k) {
        if (k > 0 && heavy_items[k].first == heavy_items[k - 1].first) continue;
        if (budget <= 0) break;
        budget -= per_search;
        const int64_t a = heavy_items[k].first;
        auto jt = std::lower_bound(other_items.begin(), other_items.end(), SizedItem{a - half, -1});
        for (auto cand : {jt, jt == other_items.begin() ? other_items.end() : std::prev(jt)}) {
          if (cand == other_items.end()) continue;
          const int64_t delta = a - cand->first;
          if (delta > 0 && delta < gap) consider(other, delta, heavy_items[k].second, cand->second);
        }
      }
    }
    if (best.other_bin < 0) return;

    by_load.erase({bin_load[heavy], heavy});
    by_load.erase({bin_load[best.other_bin], best.other_bin});
    auto take = [&](int64_t bin, int64_t item) {
      auto& m = members[bin];
      budget -= static_cast<int64_t>(m.size());  // the shift of erase
      m.erase(std::lower_bound(m.begin(), m.end(), SizedItem{sizes[item], item}));
      bin_load[bin] -= sizes[item];
    };
    auto put = [&](int64_t bin, int64_t item) {
      auto& m = members[bin];
      budget -= static_cast<int64_t>(m.size());  // the shift of insert
      m.insert(std::lower_bound(m.begin(), m.end(), SizedItem{sizes[item], item}),
               SizedItem{sizes[item], item});
      bin_load[bin] += sizes[item];
      bin_idx[item] = bin;
    };
    take(heavy, best.from_item);
    put(best.other_bin, best.from_item);
    if (best.to_item >= 0) {
      take(best.other_bin, best.to_item);
      put(heavy, best.to_item);
    }
    by_load.emplace(bin_load[heavy], heavy);
    by_load.emplace(bin_load[best.other_bin], best.other_bin);
  }
}

}  // namespace

namespace {

SortedItems sort_tensor_items(std::span<const uint8_t> is_bytes, std::span<const int64_t> sizes,
                              Interrupt* interrupt) {
  std::vector<int64_t> idx;
  idx.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!is_bytes[i]) idx.push_back(static_cast<int64_t>(i));
  }
  SortedItems sorted;
  poll(interrupt);
  if (sort_few_distinct_sizes(idx, sizes, sorted, interrupt)) return sorted;
  // Ascending order of (max - size) is descending size; the radix sort keeps input order on ties.
  std::vector<uint64_t> keys(idx.size());
  for (size_t k = 0; k < idx.size(); ++k) keys[k] = ~static_cast<uint64_t>(sizes[idx[k]]);
  radix_sort_by_key(idx, keys, interrupt);
  sorted.size.resize(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) sorted.size[k] = static_cast<int64_t>(~keys[k]);
  sorted.idx = std::move(idx);
  return sorted;
}

}  // namespace

BinPlan assign_bins(std::span<const uint8_t> is_bytes, std::span<const int64_t> sizes,
                    int64_t num_bins, Balance balance, Interrupt* interrupt) {
  TF_CHECK_ARG(num_bins > 0, "bins", num_bins, "must be a positive integer");
  TF_CHECK_ARG(is_bytes.size() == sizes.size(), "sizes", sizes.size(),
               "must have one entry per item, like is_bytes");
  // bin_bytes and bin_offsets; the Python lists of split_by_size_and_type check their own cost.
  check_output_fits("assign_bins: the per-bin tables", num_bins, 2 * sizeof(int64_t));
  const int64_t num_items = static_cast<int64_t>(sizes.size());
  const bool count_bytes = balance == Balance::kRefined;
  int64_t total = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    if (static_cast<size_t>(i) % kPollEvery == 0) poll(interrupt);
    TF_CHECK_ARG(sizes[i] >= 0, "sizes", sizes[i], "must be non-negative");
    if (!is_bytes[i] || count_bytes) {
      const auto sum = checked_add(total, sizes[i]);
      TF_CHECK_ARG(sum.has_value(), "sizes", "sum > 2^63-1", "must sum to a value that fits in int64");
      total = *sum;
    }
  }

  BinPlan plan;
  plan.bin_idx.assign(num_items, 0);
  plan.bin_bytes.assign(num_bins, 0);
  if (num_bins == 1) {
    plan.order.resize(num_items);
    for (int64_t i = 0; i < num_items; ++i) plan.order[i] = i;
    plan.bin_offsets = {0, num_items};
    plan.bin_bytes[0] = total;
    return plan;
  }

  int64_t num_byte_items = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    if (is_bytes[i]) {
      plan.bin_idx[i] = num_byte_items++ % num_bins;
      if (count_bytes) plan.bin_bytes[plan.bin_idx[i]] += sizes[i];
    }
  }
  const SortedItems tensors = sort_tensor_items(is_bytes, sizes, interrupt);
  // Equal byte loads in every bin (no byte items, or no sizes known) shift all loads alike, which
  // neither packing nor refining can tell apart: then upstream's plan is the byte-aware one.
  const bool bytes_differ = count_bytes && std::ranges::min(plan.bin_bytes) != std::ranges::max(plan.bin_bytes);
  if (bytes_differ) {
    // Upstream's own plan (tensors packed as if byte items weighed nothing), refined as well: packing
    // on top of the byte loads can end in a local optimum above it, and this mode promises never to
    // be heavier than upstream. The lighter maximum wins; on a tie the byte-aware plan.
    std::vector<int64_t> upstream_idx = plan.bin_idx;
    std::vector<int64_t> upstream_load(num_bins, 0);
    greedy_assign(tensors, upstream_load, upstream_idx, interrupt);
    for (int64_t i = 0; i < num_items; ++i) {
      if (is_bytes[i]) upstream_load[upstream_idx[i]] += sizes[i];
    }
    refine(sizes, upstream_load, upstream_idx, interrupt);
    greedy_assign(tensors, plan.bin_bytes, plan.bin_idx, interrupt);
    refine(sizes, plan.bin_bytes, plan.bin_idx, interrupt);
    if (std::ranges::max(upstream_load) < std::ranges::max(plan.bin_bytes)) {
      plan.bin_idx = std::move(upstream_idx);
      plan.bin_bytes = std::move(upstream_load);
    }
  } else {
    greedy_assign(tensors, plan.bin_bytes, plan.bin_idx, interrupt);
    if (balance == Balance::kRefined) refine(sizes, plan.bin_bytes, plan.bin_idx, interrupt);
  }
  poll(interrupt);

  // Each bin: its byte items in input order, then its tensors in descending-size (assignment) order.
  plan.bin_offsets.assign(num_bins + 1, 0);
  for (int64_t i = 0; i < num_items; ++i) ++plan.bin_offsets[plan.bin_idx[i] + 1];
  for (int64_t b = 0; b < num_bins; ++b) plan.bin_offsets[b + 1] += plan.bin_offsets[b];
  std::vector<int64_t> cursor(plan.bin_offsets.begin(), plan.bin_offsets.end() - 1);
  plan.order.resize(num_items);
  for (int64_t i = 0; i < num_items; ++i) {
    if (is_bytes[i]) plan.order[cursor[plan.bin_idx[i]]++] = i;
  }
  for (int64_t i : tensors.idx) plan.order[cursor[plan.bin_idx[i]]++] = i;
  return plan;
}

}  // namespace trainfast::checkpoint
