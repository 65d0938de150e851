#include "eplb/eplb.h"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "common/check.h"
#include "common/checked_math.h"
#include "common/memory.h"

namespace trainfast::eplb {
namespace {

// Spawning threads costs tens of microseconds: only split work that is clearly larger than that.
int effective_threads(int num_threads, int64_t work) {
  constexpr int64_t kWorkPerThread = 16384;
  const int64_t useful = std::max<int64_t>(1, work / kWorkPerThread);
  return static_cast<int>(std::clamp<int64_t>(useful, 1, std::max(num_threads, 1)));
}

template <typename Acc>
Acc add_load(Acc a, Acc b) {
  if constexpr (std::is_integral_v<Acc>) {
    return static_cast<Acc>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));  // torch wraps
  } else {
    return a + b;
  }
}

// `take ? if_true : if_false` without a branch: the choices below are data-dependent coin flips,
// which the compiler would otherwise turn into mispredicted jumps.
template <typename T>
T select(bool take, T if_true, T if_false) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    const U mask = U{0} - static_cast<U>(take);
    return static_cast<T>((static_cast<U>(if_true) & mask) | (static_cast<U>(if_false) & ~mask));
  } else if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(select(take, std::bit_cast<uint32_t>(if_true), std::bit_cast<uint32_t>(if_false)));
  } else if constexpr (std::is_same_v<T, double>) {
    return std::bit_cast<double>(select(take, std::bit_cast<uint64_t>(if_true), std::bit_cast<uint64_t>(if_false)));
  } else {
    return take ? if_true : if_false;
  }
}

// Winner tree over n leaves (padded to a power of two with keys that never win): each node holds
// the better leaf of its subtree, the lower index winning ties, so the root is the first best leaf,
// like upstream's min()/max(). Updates touch one root path and select with conditional moves.
template <typename Key, bool kMin>
class Tournament {
 public:
  // Leaves n.. get `padding`, which must never beat a real key (ties go to the real, lower index).
  void reset(int64_t n, Key padding) {
    size_ = 1;
    while (size_ < n) size_ *= 2;
    key_.assign(size_, padding);
    tree_.resize(2 * size_);
  }
  Key& key(int64_t leaf) { return key_[leaf]; }
  void build() {
    for (int64_t i = 0; i < size_; ++i) tree_[size_ + i] = i;
    for (int64_t pos = size_ - 1; pos >= 1; --pos) {
      const int64_t a = tree_[2 * pos], b = tree_[2 * pos + 1];
      tree_[pos] = select(better(key_[b], key_[a]), b, a);
    }
  }
  // Replays the matches on leaf's root path, carrying the winner's key: sibling winners do not
  // depend on this update, so the only serial work per level is one compare.
  void update(int64_t leaf) {
    int64_t winner = leaf;
    Key winner_key = key_[leaf];
    for (int64_t pos = size_ + leaf; pos > 1; pos >>= 1) {
      const int64_t other = tree_[pos ^ 1];
      const Key other_key = key_[other];
      // The left subtree holds the lower indices: the right side wins only when strictly better.
      const unsigned other_is_left = static_cast<unsigned>(pos & 1);
      const unsigned other_better = better(other_key, winner_key);
      const unsigned winner_better = better(winner_key, other_key);
      const bool take_other = ((other_is_left & (winner_better ^ 1u)) | ((other_is_left ^ 1u) & other_better)) != 0;
      winner = select(take_other, other, winner);
      winner_key = select(take_other, other_key, winner_key);
      tree_[pos >> 1] = winner;
    }
  }
  int64_t top() const { return size_ == 1 ? 0 : tree_[1]; }

 private:
  static bool better(const Key& a, const Key& b) { return kMin ? a < b : b < a; }

  int64_t size_ = 1;
  std::vector<Key> key_;
  std::vector<int64_t> tree_;
};

// Order-preserving bits of a float (-0 counts as +0): a < b as floats iff key(a) < key(b).
uint32_t ordered_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Sort key of a pack: (full, load), full packs last.
template <typename Acc>
struct PackKey {
  using Type = std::pair<uint8_t, Acc>;
  static Type make(Acc load, bool full) { return {static_cast<uint8_t>(full), load}; }
  static Type padding() { return {2, Acc{}}; }
};

// The non-full packs by load: upstream's min() over the packs in index order keeps the first of
// equal loads.
template <typename Acc>
class PackHeap {
 public:
  void reset(int64_t num_packs, int64_t capacity) {
    capacity_ = capacity;
    count_.assign(num_packs, 0);
    load_.assign(num_packs, Acc{0});
    tree_.reset(num_packs, PackKey<Acc>::padding());
    for (int64_t p = 0; p < num_packs; ++p) tree_.key(p) = PackKey<Acc>::make(Acc{0}, false);
    tree_.build();
  }

  // Puts an item of load `value` into the lightest non-full pack; returns (pack, rank in pack).
  std::pair<int64_t, int64_t> add(Acc value) {
    const int64_t pack = tree_.top();
    const int64_t rank = count_[pack]++;
    load_[pack] = add_load(load_[pack], value);
    tree_.key(pack) = PackKey<Acc>::make(load_[pack], count_[pack] == capacity_);
    tree_.update(pack);
    return {pack, rank};
  }

 private:
  int64_t capacity_ = 0;
  std::vector<int64_t> count_;
  std::vector<Acc> load_;
  Tournament<typename PackKey<Acc>::Type, true> tree_;
};

// Experts keyed by load per replica: upstream's `(weight / logcnt).max(-1).indices`, which returns
// the first maximum.
template <typename Quotient>
class ReplicaHeap {
 public:
  template <typename Value>
  void reset(const Value* weight, int64_t num_log) {
    weight_q_.resize(num_log);
    count_.assign(num_log, 1);
    tree_.reset(num_log, -std::numeric_limits<Quotient>::infinity());
    for (int64_t e = 0; e < num_log; ++e) {
      weight_q_[e] = static_cast<Quotient>(weight[e]);
      tree_.key(e) = weight_q_[e];  // x / 1 == x
    }
    tree_.build();
  }

  // Adds a replica to the expert with the largest load per replica; returns (expert, its rank).
  std::pair<int64_t, int64_t> add() {
    const int64_t expert = tree_.top();
    const int64_t rank = count_[expert]++;
    tree_.key(expert) = weight_q_[expert] / static_cast<Quotient>(count_[expert]);
    tree_.update(expert);
    return {expert, rank};
  }

  const std::vector<int64_t>& counts() const { return count_; }

 private:
  std::vector<Quotient> weight_q_;
  std::vector<int64_t> count_;
  Tournament<Quotient, false> tree_;
};

template <typename Value>
using QuotientOf = std::conditional_t<std::is_same_v<Value, double>, double, float>;

template <typename Value>
using AccOf = std::conditional_t<std::is_integral_v<Value>, int64_t, Value>;

// Descending by value, ties by lowest index (the native "stable" order): a stable LSD radix sort of
// the inverted keys, starting from index order. Byte passes that cannot reorder are skipped.
class DescendingSorter {
 public:
  void sort(const float* values, int64_t n, int64_t* order) {
    keys_.resize(n);
    next_keys_.resize(n);
    next_order_.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      keys_[i] = ~ordered_bits(values[i]);
      order[i] = i;
    }
    uint32_t* keys = keys_.data();
    uint32_t* next_keys = next_keys_.data();
    int64_t* current = order;
    int64_t* next = next_order_.data();
    for (int shift = 0; shift < 32; shift += 8) {
      std::array<int64_t, 256> start{};
      for (int64_t i = 0; i < n; ++i) ++start[(keys[i] >> shift) & 0xFF];
      if (std::find(start.begin(), start.end(), n) != start.end()) continue;  // one bucket: no-op
      int64_t sum = 0;
      for (auto& count : start) {
        const int64_t c = count;
        count = sum;
        sum += c;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = start[(keys[i] >> shift) & 0xFF]++;
        next_keys[at] = keys[i];
        next[at] = current[i];
      }
      std::swap(keys, next_keys);
      std::swap(current, next);
    }
    if (current != order) std::copy(current, current + n, order);
  }

 private:
  std::vector<uint32_t> keys_, next_keys_;
  std::vector<int64_t> next_order_;
};

// --- float fast paths: unique 64-bit keys, so each tournament match is one integer min/max and the
// winner's key itself travels up the tree (no index indirection, no tie logic).

// Pack key: full flag, then load, then pack index, so the minimum is the first lightest non-full
// pack (upstream's min() over packs in index order). Needs num_packs < 2^31.
constexpr uint64_t kPackIndexMask = (uint64_t{1} << 31) - 1;
// With kNonNegative the loads are sums of loads >= 0 starting at +0 (so never -0): their raw bits
// already order them.
template <bool kNonNegative>
inline uint64_t float_pack_key(float load, bool full, int64_t pack) {
  const uint32_t bits = kNonNegative ? std::bit_cast<uint32_t>(load) : ordered_bits(load);
  return (static_cast<uint64_t>(full) << 63) | (static_cast<uint64_t>(bits) << 31) | static_cast<uint64_t>(pack);
}

// Scratch of the interleaved packer, reused across rows of one thread.
struct FloatPackScratch {
  int64_t num_packs = -1;              // initial_tree is built for this many packs
  bool non_negative_keys = false;      // ... and this key encoding
  std::vector<uint64_t> initial_tree;  // the tree of empty packs, copied into each row's tree
  std::vector<uint64_t> tree;
  std::vector<int64_t> count;
  std::vector<float> load;
};

// Resets R rows' min-trees of empty packs (leaves padded to a power of two), their pack counts and
// loads; returns the leaf count.
template <int R, bool kNonNegative>
int64_t reset_pack_trees(int64_t num_packs, FloatPackScratch& scratch) {
  const int64_t size = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(num_packs)));
  if (scratch.num_packs != num_packs || scratch.non_negative_keys != kNonNegative) {
    scratch.num_packs = num_packs;
    scratch.non_negative_keys = kNonNegative;
    scratch.initial_tree.assign(2 * size, ~uint64_t{0});  // padding leaves never win
    for (int64_t p = 0; p < num_packs; ++p) scratch.initial_tree[size + p] = float_pack_key<kNonNegative>(0.0f, false, p);
    for (int64_t pos = size - 1; pos >= 1; --pos) {
      scratch.initial_tree[pos] = std::min(scratch.initial_tree[2 * pos], scratch.initial_tree[2 * pos + 1]);
    }
  }
  scratch.tree.resize(R * 2 * size);
  for (int r = 0; r < R; ++r) {
    std::copy(scratch.initial_tree.begin(), scratch.initial_tree.end(), scratch.tree.begin() + r * 2 * size);
  }
  scratch.count.assign(R * num_packs, 0);
  scratch.load.assign(R * num_packs, 0.0f);
  return size;
}

// One greedy step on one row's min-tree of packs: the lightest non-full pack (ties: lowest index)
// takes an item of `item_load`; its key is replayed up to the root. Returns (pack, rank in pack).
template <bool kNonNegative>
inline std::pair<int64_t, int64_t> add_to_lightest_pack(uint64_t* tree, int64_t size, int64_t* counts, float* loads,
                                                        float item_load, int64_t capacity) {
  const int64_t pack = static_cast<int64_t>(tree[1] & kPackIndexMask);  // size 1: tree[1] is the leaf
  const int64_t rank = counts[pack]++;
  const float load = loads[pack] + item_load;
  loads[pack] = load;
  uint64_t key = float_pack_key<kNonNegative>(load, rank + 1 == capacity, pack);
  int64_t pos = size + pack;
  tree[pos] = key;
  while (pos > 1) {
    key = std::min(key, tree[pos ^ 1]);
    pos >>= 1;
    tree[pos] = key;
  }
  return {pack, rank};
}

// Greedy balanced packing of R rows at once (row r at offset r * n of every array). Each item's
// step (pick the lightest pack, add the load, replay its root path) depends on the previous item
// of its row only, so the R rows' chains overlap in the CPU. Rows of `order` must be permutations
// of 0..n-1 (the caller checks them: check_order).
template <int R, bool kNonNegative>
void pack_rows_float(const float* weight, const int64_t* order, int64_t n, int64_t num_packs,
                     int64_t* pack_index, int64_t* rank_in_pack, FloatPackScratch& scratch) {
  const int64_t capacity = n / num_packs;
  const int64_t size = reset_pack_trees<R, kNonNegative>(num_packs, scratch);
  uint64_t* const trees = scratch.tree.data();
  int64_t* const counts = scratch.count.data();
  float* const loads = scratch.load.data();
  for (int64_t k = 0; k < n; ++k) {
    for (int r = 0; r < R; ++r) {
      const int64_t item = order[r * n + k];
      int64_t* const row_pack = pack_index + r * n;
      const auto [pack, rank] = add_to_lightest_pack<kNonNegative>(trees + r * 2 * size, size, counts + r * num_packs,
                                                                    loads + r * num_packs, weight[r * n + item], capacity);
      row_pack[item] = pack;
      rank_in_pack[r * n + item] = rank;
    }
  }
}

// Where place_rows writes one (layer, node) row's slots.
struct RowSlots {
  const int32_t* mlog2log;  // the node's logical experts by node-local id
  int64_t* phy2log;         // the node's slots
  int64_t* phy_rank;
  int64_t* log2phy;         // the layer's [E, width] map (pre-filled with -1)
  int64_t width;
  int64_t first_slot;       // layer slot of the node's first slot
};

// place()'s plain greedy on R rows at once (see pack_rows_float; loads >= 0), writing each replica
// straight into its slot pack * capacity + rank. Rows of `order` must be permutations of 0..n-1
// (the caller checks them: check_order).
template <int R>
void place_rows(const float* loads, const int64_t* order, const int32_t* phy2mlog, const int32_t* phy_rank,
                int64_t n, int64_t num_packs, const RowSlots* rows, FloatPackScratch& scratch) {
  const int64_t capacity = n / num_packs;
  const int64_t size = reset_pack_trees<R, true>(num_packs, scratch);
  uint64_t* const trees = scratch.tree.data();
  int64_t* const counts = scratch.count.data();
  float* const pack_loads = scratch.load.data();
  for (int64_t k = 0; k < n; ++k) {
    for (int r = 0; r < R; ++r) {
      const int64_t item = order[r * n + k];
      const auto [pack, rank] = add_to_lightest_pack<true>(trees + r * 2 * size, size, counts + r * num_packs,
                                                            pack_loads + r * num_packs, loads[r * n + item], capacity);
      const int64_t slot = pack * capacity + rank;
      const int64_t expert = rows[r].mlog2log[phy2mlog[r * n + item]], replica = phy_rank[r * n + item];
      rows[r].phy2log[slot] = expert;
      rows[r].phy_rank[slot] = replica;
      rows[r].log2phy[expert * rows[r].width + replica] = rows[r].first_slot + slot;
    }
  }
}

// Experts keyed by (load per replica, lowest index): the maximum is upstream's
// `(weight / logcnt).max(-1).indices` (first maximum). Quotients are float32 divisions.
// kNonNegative: loads are >= 0 (or -0), whose bits with the sign bit set already order them.
template <bool kNonNegative>
class FloatReplicaHeap {
 public:
  template <typename Value>
  void reset(const Value* weight, int64_t num_log) {
    size_ = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(num_log)));
    weight_q_.resize(num_log);
    count_.assign(num_log, 1);
    tree_.resize(2 * size_);
    for (int64_t e = 0; e < num_log; ++e) {
      weight_q_[e] = static_cast<float>(weight[e]);
      tree_[size_ + e] = key(weight_q_[e], e);  // x / 1 == x
    }
    std::fill(tree_.begin() + size_ + num_log, tree_.end(), uint64_t{0});  // padding never wins
    for (int64_t pos = size_ - 1; pos >= 1; --pos) tree_[pos] = std::max(tree_[2 * pos], tree_[2 * pos + 1]);
  }

  // Adds a replica to the expert with the largest load per replica; returns (expert, its rank).
  std::pair<int64_t, int64_t> add() {
    const int64_t expert = static_cast<int64_t>(kIndexMask - (tree_[1] & kIndexMask));
    const int64_t rank = count_[expert]++;
    uint64_t k = key(weight_q_[expert] / static_cast<float>(count_[expert]), expert);
    int64_t pos = size_ + expert;
    tree_[pos] = k;
    while (pos > 1) {
      k = std::max(k, tree_[pos ^ 1]);
      pos >>= 1;
      tree_[pos] = k;
    }
    return {expert, rank};
  }

  const std::vector<int64_t>& counts() const { return count_; }

 private:
  static constexpr uint64_t kIndexMask = 0xFFFFFFFFu;
  // Loads are finite and >= 0 here (checked), so real keys are > 0, the padding.
  static uint64_t key(float quotient, int64_t expert) {
    const uint32_t bits = kNonNegative ? (std::bit_cast<uint32_t>(quotient) | 0x80000000u) : ordered_bits(quotient);
    return (static_cast<uint64_t>(bits) << 32) | (kIndexMask - static_cast<uint64_t>(expert));
  }

  int64_t size_ = 1;
  std::vector<float> weight_q_;
  std::vector<int64_t> count_;
  std::vector<uint64_t> tree_;
};

template <typename Value>
void pack_row(const Value* weight, const int64_t* order, int64_t n, int64_t num_packs,
              int64_t* pack_index, int64_t* rank_in_pack, PackHeap<AccOf<Value>>& heap) {
  heap.reset(num_packs, n / num_packs);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t item = order[k];
    const auto [pack, rank] = heap.add(static_cast<AccOf<Value>>(weight[item]));
    pack_index[item] = pack;
    rank_in_pack[item] = rank;
  }
}

// Greedy packing that skips packs already holding a replica of the same expert while another
// non-full pack does not; then swaps remaining duplicates away (each swap removes one duplicate
// and creates none), choosing the partner whose load differs least.
void pack_row_distinct(const float* weight, const int32_t* expert_of, int64_t num_experts,
                       const int64_t* order, int64_t n, int64_t num_packs, int64_t* pack_index,
                       int64_t* rank_in_pack, std::vector<int32_t>& held) {
  const int64_t capacity = n / num_packs;
  std::vector<float> load(num_packs, 0.0f);
  std::vector<int64_t> count(num_packs, 0);
  held.assign(num_experts * num_packs, 0);  // replicas of expert e on pack p
  for (int64_t k = 0; k < n; ++k) {
    const int64_t item = order[k], expert = expert_of[item];
    int64_t best = -1, best_any = -1;
    for (int64_t p = 0; p < num_packs; ++p) {
      if (count[p] == capacity) continue;
      if (best_any < 0 || load[p] < load[best_any]) best_any = p;
      if (held[expert * num_packs + p] == 0 && (best < 0 || load[p] < load[best])) best = p;
    }
    const int64_t pack = best >= 0 ? best : best_any;
    pack_index[item] = pack;
    rank_in_pack[item] = count[pack]++;
    load[pack] += weight[item];
    ++held[expert * num_packs + pack];
  }
  for (int64_t a = 0; a < n; ++a) {
    const int64_t g = pack_index[a], e = expert_of[a];
    if (held[e * num_packs + g] < 2) continue;
    int64_t partner = -1;
    float best_cost = std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < n; ++b) {
      const int64_t h = pack_index[b], f = expert_of[b];
      if (h == g || f == e || held[e * num_packs + h] > 0 || held[f * num_packs + g] > 0) continue;
      const float cost = std::abs(weight[a] - weight[b]);
      if (partner < 0 || cost < best_cost) {
        partner = b;
        best_cost = cost;
      }
    }
    if (partner < 0) continue;  // no swap removes this duplicate
    const int64_t h = pack_index[partner], f = expert_of[partner];
    --held[e * num_packs + g];
    ++held[e * num_packs + h];
    --held[f * num_packs + h];
    ++held[f * num_packs + g];
    std::swap(pack_index[a], pack_index[partner]);
    std::swap(rank_in_pack[a], rank_in_pack[partner]);
  }
}

// Swaps replicas between the heaviest GPU and another while that lowers the pair's maximum.
// Swapped items exchange (gpu, rank), so every other slot keeps its place.
void refine_row(const float* load_of, const int32_t* expert_of, int64_t n, int64_t num_packs,
                int64_t* pack_index, int64_t* rank_in_pack, bool avoid_duplicates) {
  const int64_t per_pack = n / num_packs;
  std::vector<int64_t> members(n);
  std::vector<double> load(num_packs, 0.0);
  for (int64_t item = 0; item < n; ++item) {
    members[pack_index[item] * per_pack + rank_in_pack[item]] = item;
    load[pack_index[item]] += load_of[item];
  }
  auto holds_other = [&](int64_t pack, int64_t expert, int64_t except) {
    for (int64_t r = 0; r < per_pack; ++r) {
      const int64_t item = members[pack * per_pack + r];
      if (item != except && expert_of[item] == expert) return true;
    }
    return false;
  };
  const int64_t max_iterations = 8 * n + 64;
  for (int64_t iteration = 0; iteration < max_iterations; ++iteration) {
    const int64_t heavy = std::max_element(load.begin(), load.end()) - load.begin();
    double best_max = load[heavy] - 1e-9 * std::abs(load[heavy]);  // demand a real gain
    int64_t best_a = -1, best_b = -1, best_pack = -1;
    for (int64_t pack = 0; pack < num_packs; ++pack) {
      if (pack == heavy || load[pack] >= load[heavy]) continue;
      for (int64_t i = 0; i < per_pack; ++i) {
        const int64_t a = members[heavy * per_pack + i];
        for (int64_t j = 0; j < per_pack; ++j) {
          const int64_t b = members[pack * per_pack + j];
          const double delta = static_cast<double>(load_of[a]) - load_of[b];
          if (delta <= 0) continue;
          const double new_max = std::max(load[heavy] - delta, load[pack] + delta);
          if (new_max >= best_max) continue;
          if (avoid_duplicates && expert_of[a] != expert_of[b] &&
              (holds_other(pack, expert_of[a], b) || holds_other(heavy, expert_of[b], a))) {
            continue;
          }
          best_max = new_max;
          best_a = a;
          best_b = b;
          best_pack = pack;
        }
      }
    }
    if (best_a < 0) break;
    const double delta = static_cast<double>(load_of[best_a]) - load_of[best_b];
    load[heavy] -= delta;
    load[best_pack] += delta;
    std::swap(pack_index[best_a], pack_index[best_b]);
    std::swap(rank_in_pack[best_a], rank_in_pack[best_b]);
    members[pack_index[best_a] * per_pack + rank_in_pack[best_a]] = best_a;
    members[pack_index[best_b] * per_pack + rank_in_pack[best_b]] = best_b;
  }
}

}  // namespace

void check_shape(const Shape& s) {
  TF_CHECK_ARG(s.num_layers > 0, "weight", s.num_layers, "must have at least one layer (rows)");
  TF_CHECK_ARG(s.num_logical > 0, "weight", s.num_logical, "must have at least one expert (columns)");
  TF_CHECK_ARG(s.num_groups > 0, "num_groups", s.num_groups, "must be positive");
  TF_CHECK_ARG(s.num_nodes > 0, "num_nodes", s.num_nodes, "must be positive");
  TF_CHECK_ARG(s.num_gpus > 0, "num_gpus", s.num_gpus, "must be positive");
  TF_CHECK_ARG(s.num_physical > 0, "num_replicas", s.num_physical, "must be positive");
  TF_CHECK_ARG(s.num_logical % s.num_groups == 0, "num_groups", s.num_groups,
               "must divide the number of logical experts");
  TF_CHECK_ARG(s.num_groups % s.num_nodes == 0, "num_nodes", s.num_nodes, "must divide num_groups");
  TF_CHECK_ARG(s.num_gpus % s.num_nodes == 0, "num_gpus", s.num_gpus, "must be a multiple of num_nodes");
  TF_CHECK_ARG(s.num_physical % s.num_gpus == 0, "num_replicas", s.num_physical,
               "must be a multiple of num_gpus");
  TF_CHECK_ARG(s.num_physical >= s.num_logical, "num_replicas", s.num_physical,
               "must be >= the number of logical experts");
  // First: past it, a product too large can only come from the weight's rows.
  TF_CHECK_ARG(s.num_physical < (int64_t{1} << 31), "num_replicas", s.num_physical, "must be < 2^31");
  TF_CHECK_ARG(checked_mul(s.num_layers, s.num_physical).has_value() &&
                   checked_mul(s.num_layers, s.num_logical).has_value(),
               "weight", s.num_layers, "is too large");
  // phy2log and the working copies: about 6 int64 per physical slot (log2phy, whose width is
  // known only after replication, is checked where it is sized).
  check_output_fits("rebalance_experts: the placement of num_layers x num_replicas slots",
                    s.num_layers * s.num_physical, 6 * sizeof(int64_t));
}

void check_loads(std::span<const float> weight, int64_t num_layers, int64_t num_logical) {
  TF_CHECK_ARG(static_cast<int64_t>(weight.size()) == num_layers * num_logical, "weight", weight.size(),
               "must hold num_layers * num_logical_experts loads");
  // A branch-free pass (it vectorizes); only a bad load pays for the search below.
  const float* data = weight.data();
  unsigned bad = 0;
  for (size_t i = 0; i < weight.size(); ++i) {
    bad |= static_cast<unsigned>(!((data[i] >= 0.0f) & (data[i] <= std::numeric_limits<float>::max())));
  }
  if (bad == 0) return;
  for (size_t i = 0; i < weight.size(); ++i) {
    const float value = weight[i];
    if (!(value >= 0.0f) || std::isinf(value)) {
      const int64_t layer = static_cast<int64_t>(i) / num_logical;
      const int64_t expert = static_cast<int64_t>(i) % num_logical;
      throw std::invalid_argument("weight[" + std::to_string(layer) + ", " + std::to_string(expert) +
                                  "] (layer " + std::to_string(layer) + ", expert " +
                                  std::to_string(expert) +
                                  ") must be a finite, non-negative load (got " +
                                  detail::format_value(value) + ")");
    }
  }
}

template <typename Int>
bool int_loads(std::span<const Int> weight, int64_t num_layers, int64_t num_logical, int64_t num_groups,
               std::span<float> out, std::span<float> group_loads) {
  TF_CHECK_ARG(num_layers > 0 && num_logical > 0 && static_cast<int64_t>(weight.size()) == num_layers * num_logical,
               "weight", weight.size(), "must hold num_layers * num_logical_experts loads");
  TF_CHECK_ARG(out.size() == weight.size(), "out", out.size(), "must match weight");
  const Int* in = weight.data();
  float* converted = out.data();
  bool small = false;
  if constexpr (sizeof(Int) == 8) {
    uint64_t bits = 0;
    for (size_t i = 0; i < weight.size(); ++i) bits |= static_cast<uint64_t>(in[i]);
    small = (bits >> 52) == 0;  // all in [0, 2^52)
  }
  if (small) {
    // Vectorizable: x in [0, 2^52) is exact as the double 2^52 + x minus 2^52, and rounding that
    // double to float rounds x once, like a direct conversion.
    for (size_t i = 0; i < weight.size(); ++i) {
      const double exact = std::bit_cast<double>(static_cast<uint64_t>(in[i]) | 0x4330000000000000ull) - 0x1p52;
      converted[i] = static_cast<float>(exact);
    }
  } else {
    for (size_t i = 0; i < weight.size(); ++i) converted[i] = static_cast<float>(in[i]);
  }
  check_loads(out, num_layers, num_logical);
  if (num_groups <= 0) return false;
  TF_CHECK_ARG(num_logical % num_groups == 0, "num_groups", num_groups, "must divide the number of logical experts");
  TF_CHECK_ARG(static_cast<int64_t>(group_loads.size()) == num_layers * num_groups, "group_loads",
               group_loads.size(), "must have num_layers * num_groups elements");
  // Every partial sum of loads >= 0 is at most the group's total: integral totals <= 2^24 are
  // float32-exact, so every summation order (torch's vectorized one included) gives this value.
  // Loads up to 2^24 are exact in float32 too, so the integer total is the float32 sum.
  constexpr int64_t kExactLimit = int64_t{1} << 24;
  const int64_t group_size = num_logical / num_groups;
  for (int64_t g = 0; g < num_layers * num_groups; ++g) {
    const Int* member = weight.data() + g * group_size;
    uint64_t total = 0, bits = 0;  // loads are >= 0 here (checked above)
    for (int64_t m = 0; m < group_size; ++m) {
      total += static_cast<uint64_t>(member[m]);
      bits |= static_cast<uint64_t>(member[m]);
    }
    // All loads < 2^25 (so the total did not wrap) and their total <= 2^24.
    if ((bits >> 25) != 0 || total > static_cast<uint64_t>(kExactLimit)) return false;
    group_loads[g] = static_cast<float>(total);
  }
  return true;
}

void check_order(std::span<const int64_t> order, int64_t num_rows, int64_t n, const char* name) {
  TF_CHECK_ARG(static_cast<int64_t>(order.size()) == num_rows * n, name,
               static_cast<int64_t>(order.size()), "has the wrong number of elements");
  std::vector<int64_t> seen(n, -1);
  for (int64_t row = 0; row < num_rows; ++row) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t item = order[row * n + k];
      TF_CHECK_ARG(item >= 0 && item < n && seen[item] != row, name, item,
                   "must hold a permutation of each row's indices");
      seen[item] = row;
    }
  }
}

Replication replicate(std::span<const float> weight, const Shape& shape,
                      std::span<const float> group_loads, std::span<const int64_t> group_order,
                      int num_threads, Interrupt* interrupt) {
  check_shape(shape);
  const int64_t L = shape.num_layers, E = shape.num_logical, G = shape.num_groups,
                N = shape.num_nodes;
  TF_CHECK_ARG(static_cast<int64_t>(weight.size()) == L * E, "weight", weight.size(),
               "must hold num_layers * num_logical_experts loads");
  check_loads(weight, L, E);
  const bool native_groups = group_loads.empty();
  TF_CHECK_ARG(group_order.empty() == native_groups, "group_order", group_order.size(),
               "must be given together with group_loads");
  const int64_t groups_per_node = shape.groups_per_node();
  if (!native_groups) {
    TF_CHECK_ARG(static_cast<int64_t>(group_loads.size()) == L * G, "group_loads", group_loads.size(),
                 "must have num_layers * num_groups elements");
    TF_CHECK_ARG(groups_per_node == 1 || static_cast<int64_t>(group_order.size()) == L * G, "group_order",
                 group_order.size(), "must have num_layers * num_groups elements");
    // Checked up front, once, so the packers need not check each item.
    if (groups_per_node > 1) check_order(group_order, L, G, "group_order");
  }

  const int64_t group_size = shape.group_size(), epn = shape.logical_per_node(),
                ppn = shape.physical_per_node();
  Replication out;
  out.shape = shape;
  out.log2mlog.resize(L * E);
  out.mlog2log.resize(L * E);
  out.phy2mlog.resize(L * N * ppn);
  out.phy_rank.resize(L * N * ppn);
  out.mlog_count.resize(L * E);
  out.replica_loads.resize(L * N * ppn);

  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> loads(G);
    std::vector<int64_t> order(G), group_node(G), group_rank(G);
    FloatPackScratch pack_scratch;
    DescendingSorter sorter;
    // Rows (layer, node) replicate kBatch at a time: their heaps' update chains overlap in the CPU.
    constexpr int64_t kBatch = 4;
    std::array<FloatReplicaHeap<true>, kBatch> heaps;
    std::vector<float> block_mlog_loads((end - begin) * E);  // row-major: row (layer - begin) * N + node
    for (int64_t layer = begin; layer < end; ++layer) {
      const float* w = weight.data() + layer * E;
      if (groups_per_node == 1) {
        std::iota(group_node.begin(), group_node.end(), int64_t{0});
        std::fill(group_rank.begin(), group_rank.end(), 0);
      } else {
        const float* group_load = nullptr;
        const int64_t* group_desc = nullptr;
        if (native_groups) {
          for (int64_t g = 0; g < G; ++g) {
            float sum = 0.0f;
            for (int64_t m = 0; m < group_size; ++m) sum += w[g * group_size + m];
            loads[g] = sum;
          }
          sorter.sort(loads.data(), G, order.data());
          group_load = loads.data();
          group_desc = order.data();
        } else {
          group_load = group_loads.data() + layer * G;
          group_desc = group_order.data() + layer * G;
        }
        pack_rows_float<1, false>(group_load, group_desc, G, N, group_node.data(), group_rank.data(), pack_scratch);
      }
      int32_t* log2mlog = out.log2mlog.data() + layer * E;
      int32_t* mlog2log = out.mlog2log.data() + layer * E;
      float* layer_mlog_loads = block_mlog_loads.data() + (layer - begin) * E;
      for (int64_t g = 0, e = 0; g < G; ++g) {
        const int64_t first = (group_node[g] * groups_per_node + group_rank[g]) * group_size;
        std::copy(w + g * group_size, w + (g + 1) * group_size, layer_mlog_loads + first);
        for (int64_t member = 0; member < group_size; ++member, ++e) {
          log2mlog[e] = static_cast<int32_t>(first + member);
          mlog2log[first + member] = static_cast<int32_t>(e);
        }
      }
    }
    const int64_t num_rows = (end - begin) * N;
    for (int64_t first = 0; first < num_rows; first += kBatch) {
      const int64_t batch = std::min(kBatch, num_rows - first);
      const int64_t row0 = begin * N + first;  // global row of the batch's first row
      int32_t* phy2mlogs = out.phy2mlog.data() + row0 * ppn;
      int32_t* phy_ranks = out.phy_rank.data() + row0 * ppn;
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t m = 0; m < epn; ++m) {
          phy2mlogs[b * ppn + m] = static_cast<int32_t>(m);
          phy_ranks[b * ppn + m] = 0;
        }
        heaps[b].reset(block_mlog_loads.data() + (first + b) * epn, epn);
      }
      for (int64_t slot = epn; slot < ppn; ++slot) {
        for (int64_t b = 0; b < batch; ++b) {
          const auto [expert, rank] = heaps[b].add();
          phy2mlogs[b * ppn + slot] = static_cast<int32_t>(expert);
          phy_ranks[b * ppn + slot] = static_cast<int32_t>(rank);
        }
      }
      for (int64_t b = 0; b < batch; ++b) {
        const float* mlog_loads = block_mlog_loads.data() + (first + b) * epn;
        const int32_t* phy2mlog = phy2mlogs + b * ppn;
        // Upstream's weight / logcnt in float32; x / 1 == x, so only replicated experts divide.
        const int64_t* counts = heaps[b].counts().data();
        int32_t* count = out.mlog_count.data() + (row0 + b) * epn;
        for (int64_t m = 0; m < epn; ++m) count[m] = static_cast<int32_t>(counts[m]);
        float* replica_load = out.replica_loads.data() + (row0 + b) * ppn;
        std::copy(mlog_loads, mlog_loads + epn, replica_load);
        for (int64_t slot = epn; slot < ppn; ++slot) {
          const int64_t m = phy2mlog[slot];
          replica_load[m] = mlog_loads[m] / static_cast<float>(counts[m]);
        }
        for (int64_t slot = epn; slot < ppn; ++slot) replica_load[slot] = replica_load[phy2mlog[slot]];
      }
    }
  };
  const int threads = effective_threads(num_threads, L * shape.num_physical);
  parallel_for(L, std::max<int64_t>(1, (L + 4 * threads - 1) / (4 * threads)), threads, body, interrupt);
  return out;
}

Placement place(const Replication& rep, std::span<const int64_t> replica_order,
                const PlaceOptions& options, int num_threads, Interrupt* interrupt) {
  const Shape& shape = rep.shape;
  const int64_t L = shape.num_layers, E = shape.num_logical, P = shape.num_physical,
                N = shape.num_nodes;
  const int64_t epn = shape.logical_per_node(), ppn = shape.physical_per_node(),
                gpn = shape.gpus_per_node(), spg = shape.slots_per_gpu();
  const bool native_order = replica_order.empty();
  if (!native_order && spg > 1) {
    TF_CHECK_ARG(static_cast<int64_t>(replica_order.size()) == L * N * ppn, "replica_order",
                 static_cast<int64_t>(replica_order.size()), "has the wrong number of elements");
    // Checked here, in row order, rather than by the workers: then the error names the first bad
    // row's value whatever the thread count.
    check_order(replica_order, L * N, ppn, "replica_order");
  }

  Placement out;
  out.phy2log.resize(L * P);
  out.phy_rank.resize(L * P);
  out.logcnt.resize(L * E);
  // log2phy's width is known before placing (counts come from stage 1), so each layer fills its
  // rows while that layer's slots are still in cache.
  out.max_count = *std::max_element(rep.mlog_count.begin(), rep.mlog_count.end());
  const int64_t width = out.max_count;
  // Up to num_replicas - num_logical + 1 wide: a hot expert can make it far larger than phy2log.
  const std::optional<int64_t> log2phy_size = checked_mul(L * E, width);
  TF_CHECK_ARG(log2phy_size.has_value(), "num_replicas", P, "makes log2phy too large");
  check_output_fits("rebalance_experts: log2phy (num_layers x num_logical x the largest replica count)",
                    *log2phy_size, sizeof(int64_t));
  out.log2phy.resize(*log2phy_size);

  // Rows (layer, node) are packed kBatch at a time, interleaved (see pack_rows_float).
  constexpr int kBatch = 4;
  const bool plain = spg > 1 && !options.refine && !options.avoid_gpu_duplicates;
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<int64_t> gpu(kBatch * ppn), rank(kBatch * ppn), order(kBatch * ppn);
    std::vector<int32_t> holds;
    FloatPackScratch scratch;
    DescendingSorter sorter;
    for (int64_t first_row = begin * N; first_row < end * N; first_row += kBatch) {
      const int64_t batch = std::min<int64_t>(kBatch, end * N - first_row);
      const float* replica_loads = rep.replica_loads.data() + first_row * ppn;
      const int32_t* phy2mlogs = rep.phy2mlog.data() + first_row * ppn;
      const int32_t* phy_ranks = rep.phy_rank.data() + first_row * ppn;
      std::array<RowSlots, kBatch> rows;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t layer = (first_row + b) / N, node = (first_row + b) % N;
        rows[b] = {rep.mlog2log.data() + layer * E + node * epn, out.phy2log.data() + layer * P + node * ppn,
                   out.phy_rank.data() + layer * P + node * ppn, out.log2phy.data() + layer * E * width, width,
                   node * ppn};
        if (node == 0) std::fill(rows[b].log2phy, rows[b].log2phy + E * width, int64_t{-1});
      }
      const int64_t* desc = nullptr;
      if (spg > 1) {
        if (native_order) {
          for (int64_t b = 0; b < batch; ++b) sorter.sort(replica_loads + b * ppn, ppn, order.data() + b * ppn);
          desc = order.data();
        } else {
          desc = replica_order.data() + first_row * ppn;
        }
      }
      if (plain) {
        if (batch == kBatch) {
          place_rows<kBatch>(replica_loads, desc, phy2mlogs, phy_ranks, ppn, gpn, rows.data(), scratch);
        } else {
          for (int64_t b = 0; b < batch; ++b) {
            place_rows<1>(replica_loads + b * ppn, desc + b * ppn, phy2mlogs + b * ppn, phy_ranks + b * ppn, ppn,
                          gpn, rows.data() + b, scratch);
          }
        }
        continue;
      }
      if (spg == 1) {
        for (int64_t b = 0; b < batch; ++b) {
          std::iota(gpu.begin() + b * ppn, gpu.begin() + (b + 1) * ppn, int64_t{0});
        }
        std::fill(rank.begin(), rank.end(), 0);
      } else {
        for (int64_t b = 0; b < batch; ++b) {
          if (options.avoid_gpu_duplicates) {
            pack_row_distinct(replica_loads + b * ppn, phy2mlogs + b * ppn, epn, desc + b * ppn, ppn, gpn,
                              gpu.data() + b * ppn, rank.data() + b * ppn, holds);
          } else {
            pack_rows_float<1, true>(replica_loads + b * ppn, desc + b * ppn, ppn, gpn, gpu.data() + b * ppn,
                                     rank.data() + b * ppn, scratch);
          }
          if (options.refine) {
            refine_row(replica_loads + b * ppn, phy2mlogs + b * ppn, ppn, gpn, gpu.data() + b * ppn,
                       rank.data() + b * ppn, options.avoid_gpu_duplicates);
          }
        }
      }
      for (int64_t b = 0; b < batch; ++b) {
        const int32_t* phy2mlog = phy2mlogs + b * ppn;
        const int32_t* phy_rank = phy_ranks + b * ppn;
        const int64_t* row_gpu = gpu.data() + b * ppn;
        const int64_t* row_rank = rank.data() + b * ppn;
        for (int64_t p = 0; p < ppn; ++p) {
          const int64_t slot = row_gpu[p] * spg + row_rank[p];
          const int64_t expert = rows[b].mlog2log[phy2mlog[p]];
          rows[b].phy2log[slot] = expert;
          rows[b].phy_rank[slot] = phy_rank[p];
          rows[b].log2phy[expert * width + phy_rank[p]] = rows[b].first_slot + slot;
        }
      }
    }
    for (int64_t layer = begin; layer < end; ++layer) {
      const int32_t* log2mlog = rep.log2mlog.data() + layer * E;
      const int32_t* counts = rep.mlog_count.data() + layer * E;  // rows of this layer's nodes
      int64_t* logcnt = out.logcnt.data() + layer * E;
      for (int64_t e = 0; e < E; ++e) logcnt[e] = counts[log2mlog[e]];
    }
  };
  const int threads = effective_threads(num_threads, L * P * (options.refine ? 8 : 1));
  parallel_for(L, std::max<int64_t>(1, (L + 4 * threads - 1) / (4 * threads)), threads, body, interrupt);

  return out;
}

template <typename Value>
void balanced_packing(std::span<const Value> weight, int64_t num_rows, int64_t num_items,
                      std::span<const int64_t> order, int64_t num_packs, std::span<int64_t> pack_index,
                      std::span<int64_t> rank_in_pack, int num_threads, Interrupt* interrupt) {
  TF_CHECK_ARG(num_packs > 0, "num_packs", num_packs, "must be positive");
  TF_CHECK_ARG(num_packs < (int64_t{1} << 31), "num_packs", num_packs, "must be < 2^31");  // the float path's pack ids
  TF_CHECK_ARG(num_items % num_packs == 0, "num_packs", num_packs, "must divide the number of items");
  TF_CHECK_ARG(static_cast<int64_t>(weight.size()) == num_rows * num_items, "weight", weight.size(),
               "has the wrong number of elements");
  TF_CHECK_ARG(pack_index.size() == weight.size() && rank_in_pack.size() == weight.size(), "pack_index",
               pack_index.size(), "must match weight");
  check_order(order, num_rows, num_items, "order");
  auto body = [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<Value, float>) {
      FloatPackScratch scratch;
      for (int64_t row = begin; row < end; ++row) {
        if (interrupt != nullptr) interrupt->check();  // a block is a quarter of a thread's rows
        pack_rows_float<1, false>(weight.data() + row * num_items, order.data() + row * num_items, num_items, num_packs,
                           pack_index.data() + row * num_items, rank_in_pack.data() + row * num_items, scratch);
      }
    } else {
      PackHeap<AccOf<Value>> heap;
      for (int64_t row = begin; row < end; ++row) {
        if (interrupt != nullptr) interrupt->check();
        pack_row(weight.data() + row * num_items, order.data() + row * num_items, num_items, num_packs,
                 pack_index.data() + row * num_items, rank_in_pack.data() + row * num_items, heap);
      }
    }
  };
  const int threads = effective_threads(num_threads, num_rows * num_items);
  parallel_for(num_rows, std::max<int64_t>(1, num_rows / (4 * threads)), threads, body, interrupt);
}

template <typename Value>
void replicate_experts(std::span<const Value> weight, int64_t num_rows, int64_t num_log, int64_t num_phy,
                       std::span<int64_t> phy2log, std::span<int64_t> rank, std::span<int64_t> logcnt,
                       int num_threads, Interrupt* interrupt) {
  TF_CHECK_ARG(num_log > 0, "weight", num_log, "must have at least one expert (columns)");
  TF_CHECK_ARG(num_phy >= num_log, "num_phy", num_phy, "must be >= the number of logical experts");
  TF_CHECK_ARG(static_cast<int64_t>(weight.size()) == num_rows * num_log, "weight", weight.size(),
               "has the wrong number of elements");
  TF_CHECK_ARG(static_cast<int64_t>(phy2log.size()) == num_rows * num_phy &&
                   rank.size() == phy2log.size() && logcnt.size() == weight.size(),
               "phy2log", phy2log.size(), "has the wrong number of elements");
  auto body = [&](int64_t begin, int64_t end) {
    std::conditional_t<std::is_same_v<QuotientOf<Value>, float>, FloatReplicaHeap<false>, ReplicaHeap<double>> heap;
    for (int64_t row = begin; row < end; ++row) {
      if (interrupt != nullptr) interrupt->check();  // a block is a quarter of a thread's rows
      int64_t* row_phy2log = phy2log.data() + row * num_phy;
      int64_t* row_rank = rank.data() + row * num_phy;
      for (int64_t e = 0; e < num_log; ++e) {
        row_phy2log[e] = e;
        row_rank[e] = 0;
      }
      heap.reset(weight.data() + row * num_log, num_log);
      for (int64_t slot = num_log; slot < num_phy; ++slot) {
        const auto [expert, expert_rank] = heap.add();
        row_phy2log[slot] = expert;
        row_rank[slot] = expert_rank;
      }
      std::copy(heap.counts().begin(), heap.counts().end(), logcnt.data() + row * num_log);
    }
  };
  const int threads = effective_threads(num_threads, num_rows * num_phy);
  parallel_for(num_rows, std::max<int64_t>(1, num_rows / (4 * threads)), threads, body, interrupt);
}

#define TF_EPLB_INSTANTIATE(T)                                                                       \
  template void balanced_packing<T>(std::span<const T>, int64_t, int64_t, std::span<const int64_t>, \
                                    int64_t, std::span<int64_t>, std::span<int64_t>, int, Interrupt*); \
  template void replicate_experts<T>(std::span<const T>, int64_t, int64_t, int64_t,                 \
                                     std::span<int64_t>, std::span<int64_t>, std::span<int64_t>, int,  \
                                     Interrupt*);
template bool int_loads<int64_t>(std::span<const int64_t>, int64_t, int64_t, int64_t, std::span<float>,
                                  std::span<float>);
template bool int_loads<int32_t>(std::span<const int32_t>, int64_t, int64_t, int64_t, std::span<float>,
                                  std::span<float>);
TF_EPLB_INSTANTIATE(float)
TF_EPLB_INSTANTIATE(double)
TF_EPLB_INSTANTIATE(int64_t)
#undef TF_EPLB_INSTANTIATE

namespace {

// One matrix: minimum cost (max - weight) assignment with row and column potentials; rows are
// added one at a time, each by a Dijkstra search over the columns. Arrays are 1-based, column 0
// being the row just added.
void assign_one(const int64_t* weight, int64_t n, int64_t* assignment, Interrupt* interrupt) {
  constexpr int64_t kUnreachable = std::numeric_limits<int64_t>::max() / 4;
  const int64_t max_weight = std::max<int64_t>(0, n == 0 ? 0 : *std::max_element(weight, weight + n * n));
  std::vector<int64_t> row_potential(n + 1, 0), col_potential(n + 1, 0), col_owner(n + 1, 0),
      prev_col(n + 1, 0), slack(n + 1);
  std::vector<uint8_t> visited(n + 1);
  for (int64_t row = 1; row <= n; ++row) {
    if (interrupt != nullptr) interrupt->check();  // a large matrix takes O(n^2) per row
    col_owner[0] = row;
    int64_t col = 0;
    std::fill(slack.begin(), slack.end(), kUnreachable);
    std::fill(visited.begin(), visited.end(), 0);
    while (col_owner[col] != 0) {
      visited[col] = 1;
      const int64_t owner = col_owner[col];
      const int64_t* costs_of_owner = weight + (owner - 1) * n;
      int64_t delta = kUnreachable, next_col = 0;
      for (int64_t j = 1; j <= n; ++j) {
        if (visited[j]) continue;
        const int64_t reduced = (max_weight - costs_of_owner[j - 1]) - row_potential[owner] - col_potential[j];
        if (reduced < slack[j]) {
          slack[j] = reduced;
          prev_col[j] = col;
        }
        if (slack[j] < delta) {
          delta = slack[j];
          next_col = j;
        }
      }
      for (int64_t j = 0; j <= n; ++j) {
        if (visited[j]) {
          row_potential[col_owner[j]] += delta;
          col_potential[j] -= delta;
        } else {
          slack[j] -= delta;
        }
      }
      col = next_col;
    }
    while (col != 0) {  // flip the augmenting path
      col_owner[col] = col_owner[prev_col[col]];
      col = prev_col[col];
    }
  }
  for (int64_t j = 1; j <= n; ++j) assignment[col_owner[j] - 1] = j - 1;
}

}  // namespace

void max_weight_assignment(std::span<const int64_t> weight, int64_t num_matrices, int64_t n,
                           std::span<int64_t> assignment, int num_threads, Interrupt* interrupt) {
  TF_CHECK_ARG(num_matrices >= 0, "num_matrices", num_matrices, "must be >= 0");
  TF_CHECK_ARG(n >= 0 && n <= (int64_t{1} << 20), "n", n, "must be in [0, 2^20]");
  const std::optional<int64_t> cells = checked_mul(num_matrices, n * n);
  TF_CHECK_ARG(cells.has_value() && static_cast<int64_t>(weight.size()) == *cells, "weight",
               static_cast<int64_t>(weight.size()), "must hold num_matrices * n * n entries");
  TF_CHECK_ARG(static_cast<int64_t>(assignment.size()) == num_matrices * n, "assignment",
               static_cast<int64_t>(assignment.size()), "must hold num_matrices * n entries");
  // Bounded so that potentials (at most n times the largest cost) stay far inside int64.
  for (const int64_t w : weight) {
    TF_CHECK_ARG(w >= 0 && w < (int64_t{1} << 40), "weight", w, "must be in [0, 2^40)");
  }
  const int threads = effective_threads(num_threads, checked_mul(*cells, n).value_or(INT64_MAX));
  parallel_for(num_matrices, 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      assign_one(weight.data() + m * n * n, n, assignment.data() + m * n, interrupt);
    }
  }, interrupt);
}

}  // namespace trainfast::eplb
