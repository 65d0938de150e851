#include "bpe/train.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "common/hash.h"

namespace trainfast::bpe {
namespace {

constexpr int32_t kNone = -1;

// One symbol of a word. The words are doubly linked lists laid out one after another in a single
// array, so merging an occurrence touches only the symbols next to it.
struct Symbol {
  int32_t token;  // kNone once merged into its left neighbour
  int32_t prev;   // kNone at the start of the word
  int32_t next;   // kNone at the end of the word
  int32_t word;
};

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Open-addressing map from a (left, right) key to a dense pair index; pairs are never erased, so
// no tombstones are needed.
class PairIndex {
 public:
  PairIndex() { reset(1024); }

  int32_t find(uint64_t key) const {
    for (size_t slot = mix64(key) & mask_;; slot = (slot + 1) & mask_) {
      if (keys_[slot] == key) return values_[slot];
      if (keys_[slot] == kEmpty) return kNone;
    }
  }

  // `key` must be absent.
  void insert(uint64_t key, int32_t value) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    place(key, value);
    ++size_;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are < 2^31, so never a real key

  void reset(size_t capacity) {
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, kNone);
    mask_ = capacity - 1;
  }

  void place(uint64_t key, int32_t value) {
    size_t slot = mix64(key) & mask_;
    while (keys_[slot] != kEmpty) slot = (slot + 1) & mask_;
    keys_[slot] = key;
    values_[slot] = value;
  }

  void grow() {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<int32_t> old_values = std::move(values_);
    reset(old_keys.size() * 2);
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != kEmpty) place(old_keys[i], old_values[i]);
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

struct HeapEntry {
  int64_t count;
  int32_t pair_idx;
};

// A pair first seen in the current merge (it holds the new token), before it gets a pair index.
struct NewPair {
  int32_t left;
  int32_t right;
  int64_t count;
  int64_t num_occurrences;
};

struct Occurrence {
  int32_t new_pair;  // index into the current merge's NewPair list
  int32_t position;  // of the pair's left symbol
};

constexpr size_t kPrefetchDistance = 8;

// Merge loop. Every pair keeps the positions of its left symbol in every word where it occurs
// (ascending, so left-to-right order within a word holds); a position whose symbols have since
// changed is skipped when visited. A pair only gains occurrences in the merge that creates its
// newer token, so each pair's position list is written once, contiguously, into one arena.
class Trainer {
 public:
  explicit Trainer(Interrupt* interrupt) : interrupt_(interrupt) {
    token_bytes_.reserve(256);
    for (int b = 0; b < 256; ++b) token_bytes_.emplace_back(1, static_cast<char>(b));
    token_state_.resize(256);
  }

  // word_at(i) gives word i as {data, size, count}.
  template <class WordAt>
  void load(size_t num_words, size_t total_bytes, const WordAt& word_at) {
    symbols_.reserve(total_bytes);
    int64_t total_weight = 0;  // bounds every pair count for the whole run (pair weight only shrinks)
    for (size_t i = 0; i < num_words; ++i) {
      if ((i & 0xffff) == 0xffff) poll_interrupt();
      const auto [data, size, count] = word_at(i);
      TF_CHECK_ARG(count >= 1, "word_counts", count, "must be >= 1");
      if (size < 2) continue;  // a single byte has no pair and never changes
      int64_t weight = 0;
      TF_CHECK_ARG(!__builtin_mul_overflow(count, static_cast<int64_t>(size) - 1, &weight) &&
                       !__builtin_add_overflow(total_weight, weight, &total_weight),
                   "word_counts", count, "sum to more than 2^63-1 pairs");
      TF_CHECK_ARG(symbols_.size() + size < static_cast<size_t>(INT32_MAX), "total bytes of the words",
                   symbols_.size() + size, "must be < 2^31");
      const int32_t word_idx = static_cast<int32_t>(word_count_.size());
      const int32_t base = static_cast<int32_t>(symbols_.size());
      const int32_t last = static_cast<int32_t>(size) - 1;
      for (int32_t k = 0; k <= last; ++k) {
        symbols_.push_back({data[k], k == 0 ? kNone : base + k - 1, k == last ? kNone : base + k + 1,
                            word_idx});
      }
      word_count_.push_back(count);
    }
  }

  std::vector<Merge> run(const TrainOptions& options) {
    count_initial_pairs();
    std::vector<Merge> merges;
    merges.reserve(static_cast<size_t>(std::min<int64_t>(options.num_merges, 1 << 20)));
    auto last_report = std::chrono::steady_clock::now();
    for (int64_t merge_idx = 0; merge_idx < options.num_merges; ++merge_idx) {
      poll_interrupt();
      if (options.on_progress) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last_report >= std::chrono::milliseconds(100)) {
          last_report = now;
          options.on_progress(merge_idx);
        }
      }
      const int32_t best = pop_best();
      if (best < 0) break;
      TF_CHECK_ARG(token_bytes_.size() < static_cast<size_t>(INT32_MAX), "vocab_size",
                   options.num_merges, "is too large");
      const int32_t new_token = static_cast<int32_t>(token_bytes_.size());
      merges.push_back({pair_left_[best], pair_right_[best]});
      token_bytes_.push_back(token_bytes_[pair_left_[best]] + token_bytes_[pair_right_[best]]);
      token_state_.emplace_back();
      apply_merge(best, new_token, static_cast<int32_t>(merge_idx));
    }
    if (options.on_progress) options.on_progress(static_cast<int64_t>(merges.size()));
    return merges;
  }

 private:
  // Per-token scratch for one merge, keyed by the neighbour token; valid when its stamp is the
  // current merge index.
  struct TokenState {
    int32_t left_stamp = kNone;   // (token, a) looked up
    int32_t left_pair = kNone;
    int32_t right_stamp = kNone;  // (b, token) looked up
    int32_t right_pair = kNone;
    int32_t new_left_stamp = kNone;  // (token, new) created
    int32_t new_left = kNone;
    int32_t new_right_stamp = kNone;  // (new, token) created
    int32_t new_right = kNone;
  };

  void poll_interrupt() {
    if (interrupt_ != nullptr) interrupt_->check();
  }

  int32_t add_pair(int32_t left, int32_t right, int64_t count) {
    const int32_t idx = static_cast<int32_t>(pair_count_.size());
    TF_CHECK_ARG(idx < INT32_MAX, "number of distinct pairs", idx, "must be < 2^31");
    pair_left_.push_back(left);
    pair_right_.push_back(right);
    pair_count_.push_back(count);
    pair_begin_.push_back(0);
    pair_end_.push_back(0);
    return idx;
  }

  int32_t find_pair(int32_t left, int32_t right) const {
    const int32_t idx = (left < 256 && right < 256) ? byte_pair_[left * 256 + right]
                                                     : pairs_.find(pair_key(left, right));
    if (idx == kNone) throw std::logic_error("bpe: a pair of the word table has no index");
    return idx;
  }

  void count_initial_pairs() {
    byte_pair_.assign(256 * 256, kNone);
    std::vector<int32_t> pair_at(symbols_.size(), kNone);  // pair starting at each position
    std::vector<int64_t> num_occurrences;
    for (size_t p = 0; p < symbols_.size(); ++p) {
      if ((p & 0xfffff) == 0xfffff) poll_interrupt();
      const Symbol& s = symbols_[p];
      if (s.next == kNone) continue;
      int32_t& idx = byte_pair_[s.token * 256 + symbols_[p + 1].token];
      if (idx == kNone) {
        idx = add_pair(s.token, symbols_[p + 1].token, 0);
        num_occurrences.push_back(0);
      }
      pair_count_[idx] += word_count_[s.word];
      ++num_occurrences[idx];
      pair_at[p] = idx;
    }
    int64_t offset = 0;
    for (size_t idx = 0; idx < pair_count_.size(); ++idx) {
      pair_begin_[idx] = pair_end_[idx] = offset;
      offset += num_occurrences[idx];
    }
    arena_.resize(static_cast<size_t>(offset));
    for (size_t p = 0; p < symbols_.size(); ++p) {
      if (pair_at[p] != kNone) arena_[pair_end_[pair_at[p]]++] = static_cast<int32_t>(p);
    }
    heap_.reserve(pair_count_.size());
    for (size_t idx = 0; idx < pair_count_.size(); ++idx) {
      heap_.push_back({pair_count_[idx], static_cast<int32_t>(idx)});
    }
    std::make_heap(heap_.begin(), heap_.end(), HeapLess{this});
  }

  // Unsigned lexicographic comparison of two tokens' bytes.
  int compare_tokens(int32_t a, int32_t b) const {
    if (a == b) return 0;
    const std::string& x = token_bytes_[a];
    const std::string& y = token_bytes_[b];
    const int c = std::memcmp(x.data(), y.data(), std::min(x.size(), y.size()));
    if (c != 0) return c;
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }

  struct HeapLess {
    const Trainer* trainer;
    bool operator()(const HeapEntry& a, const HeapEntry& b) const {
      if (a.count != b.count) return a.count < b.count;
      const Trainer& t = *trainer;
      const int left = t.compare_tokens(t.pair_left_[a.pair_idx], t.pair_left_[b.pair_idx]);
      if (left != 0) return left < 0;
      return t.compare_tokens(t.pair_right_[a.pair_idx], t.pair_right_[b.pair_idx]) < 0;
    }
  };

  // Existing pairs only lose count (every new pair contains the newest token), so a heap entry
  // is an upper bound: a stale top is re-pushed with its current count until the top is exact.
  int32_t pop_best() {
    const HeapLess less{this};
    while (!heap_.empty()) {
      const HeapEntry top = heap_.front();
      std::pop_heap(heap_.begin(), heap_.end(), less);
      heap_.pop_back();
      const int64_t current = pair_count_[top.pair_idx];
      if (current == top.count) return top.pair_idx;
      if (current > 0) {
        heap_.push_back({current, top.pair_idx});
        std::push_heap(heap_.begin(), heap_.end(), less);
      }
    }
    return -1;
  }

  // Pair (x, a) (left neighbour x of a merged occurrence), looked up once per merge and x.
  int32_t pair_with_left(int32_t x, int32_t a, int32_t merge_idx) {
    TokenState& state = token_state_[x];
    if (state.left_stamp != merge_idx) {
      state.left_stamp = merge_idx;
      state.left_pair = find_pair(x, a);
    }
    return state.left_pair;
  }

  // Pair (b, y) (right neighbour y of a merged occurrence).
  int32_t pair_with_right(int32_t b, int32_t y, int32_t merge_idx) {
    TokenState& state = token_state_[y];
    if (state.right_stamp != merge_idx) {
      state.right_stamp = merge_idx;
      state.right_pair = find_pair(b, y);
    }
    return state.right_pair;
  }

  // New pair (x, new_token).
  int32_t new_pair_with_left(int32_t x, int32_t new_token, int32_t merge_idx) {
    TokenState& state = token_state_[x];
    if (state.new_left_stamp != merge_idx) {
      state.new_left_stamp = merge_idx;
      state.new_left = static_cast<int32_t>(new_pairs_.size());
      new_pairs_.push_back({x, new_token, 0, 0});
    }
    return state.new_left;
  }

  // New pair (new_token, y).
  int32_t new_pair_with_right(int32_t new_token, int32_t y, int32_t merge_idx) {
    TokenState& state = token_state_[y];
    if (state.new_right_stamp != merge_idx) {
      state.new_right_stamp = merge_idx;
      state.new_right = static_cast<int32_t>(new_pairs_.size());
      new_pairs_.push_back({new_token, y, 0, 0});
    }
    return state.new_right;
  }

  void add_occurrence(int32_t new_pair, int32_t position, int64_t count) {
    new_pairs_[new_pair].count += count;
    ++new_pairs_[new_pair].num_occurrences;
    occurrences_.push_back({new_pair, position});
  }

  void apply_merge(int32_t best, int32_t new_token, int32_t merge_idx) {
    const int32_t a = pair_left_[best], b = pair_right_[best];
    const int64_t begin = pair_begin_[best], end = pair_end_[best];
    new_pairs_.clear();
    occurrences_.clear();
    const int32_t* positions = arena_.data();
    Symbol* sym = symbols_.data();
    for (int64_t k = begin; k < end; ++k) {
      if (((k - begin) & 0xffff) == 0xffff) poll_interrupt();  // the first merges touch most words
      if (k + static_cast<int64_t>(2 * kPrefetchDistance) < end) {  // each visit is a cache miss
        __builtin_prefetch(sym + positions[k + 2 * kPrefetchDistance]);
        __builtin_prefetch(word_count_.data() + sym[positions[k + kPrefetchDistance]].word);
      }
      const int32_t p = positions[k];
      Symbol& s = sym[p];
      if (s.token != a) continue;  // merged away since it was listed
      const int32_t n = s.next;
      if (n == kNone || sym[n].token != b) continue;
      const int64_t count = word_count_[s.word];
      if (s.prev != kNone) {
        const int32_t x = sym[s.prev].token;
        if (x == new_token) {
          new_pairs_[new_pair_with_right(new_token, a, merge_idx)].count -= count;  // (new, a) just made
        } else {
          pair_count_[pair_with_left(x, a, merge_idx)] -= count;
        }
        add_occurrence(new_pair_with_left(x, new_token, merge_idx), s.prev, count);
      }
      const int32_t m = sym[n].next;
      if (m != kNone) {
        const int32_t y = sym[m].token;  // never the new token: positions are visited in order
        pair_count_[pair_with_right(b, y, merge_idx)] -= count;
        add_occurrence(new_pair_with_right(new_token, y, merge_idx), p, count);
        sym[m].prev = p;
      }
      s.token = new_token;
      s.next = m;
      sym[n].token = kNone;
    }
    pair_count_[best] = 0;
    register_new_pairs();
  }

  // Gives the merge's new pairs that still occur an index, their (ascending) positions an arena
  // range, and a heap entry. A new pair left at count 0 no longer occurs and can never reappear.
  void register_new_pairs() {
    std::vector<int32_t>& pair_of_new = scratch_;
    pair_of_new.assign(new_pairs_.size(), kNone);
    int64_t offset = static_cast<int64_t>(arena_.size());
    const HeapLess less{this};
    for (size_t j = 0; j < new_pairs_.size(); ++j) {
      const NewPair& np = new_pairs_[j];
      if (np.count <= 0) continue;
      const int32_t idx = add_pair(np.left, np.right, np.count);
      pairs_.insert(pair_key(np.left, np.right), idx);
      pair_begin_[idx] = pair_end_[idx] = offset;
      offset += np.num_occurrences;
      pair_of_new[j] = idx;
      heap_.push_back({np.count, idx});
      std::push_heap(heap_.begin(), heap_.end(), less);
    }
    arena_.resize(static_cast<size_t>(offset));
    for (const Occurrence& occ : occurrences_) {
      const int32_t idx = pair_of_new[occ.new_pair];
      if (idx != kNone) arena_[pair_end_[idx]++] = occ.position;
    }
  }

  Interrupt* interrupt_;
  std::vector<std::string> token_bytes_;
  std::vector<TokenState> token_state_;
  std::vector<Symbol> symbols_;
  std::vector<int64_t> word_count_;

  std::vector<int32_t> byte_pair_;  // pair index of two single bytes, by left * 256 + right
  PairIndex pairs_;                 // pair index of every other pair
  std::vector<int32_t> pair_left_;
  std::vector<int32_t> pair_right_;
  std::vector<int64_t> pair_count_;
  std::vector<int64_t> pair_begin_;  // the pair's positions are arena_[begin, end)
  std::vector<int64_t> pair_end_;
  std::vector<int32_t> arena_;
  std::vector<HeapEntry> heap_;

  std::vector<NewPair> new_pairs_;
  std::vector<Occurrence> occurrences_;
  std::vector<int32_t> scratch_;
};

struct WordView {
  const uint8_t* data;
  size_t size;
  int64_t count;
};

}  // namespace

std::vector<Merge> train_merges(std::span<const uint8_t> word_bytes,
                                std::span<const int64_t> word_offsets,
                                std::span<const int64_t> word_counts, const TrainOptions& options) {
  TF_CHECK_ARG(options.num_merges >= 0, "num_merges", options.num_merges, "must be >= 0");
  TF_CHECK_ARG(word_offsets.size() == word_counts.size() + 1, "word_offsets", word_offsets.size(),
               "must have one more entry than word_counts");
  TF_CHECK_ARG(word_offsets.front() == 0, "word_offsets", word_offsets.front(), "must start at 0");
  TF_CHECK_ARG(word_offsets.back() == static_cast<int64_t>(word_bytes.size()), "word_offsets",
               word_offsets.back(), "must end at len(word_bytes)");
  size_t total_bytes = 0;
  for (size_t i = 0; i < word_counts.size(); ++i) {
    const int64_t size = word_offsets[i + 1] - word_offsets[i];
    TF_CHECK_ARG(size >= 0, "word_offsets", word_offsets[i + 1], "must be non-decreasing");
    total_bytes += size >= 2 ? static_cast<size_t>(size) : 0;
  }
  Trainer trainer(options.interrupt);
  trainer.load(word_counts.size(), total_bytes, [&](size_t i) {
    return WordView{word_bytes.data() + word_offsets[i],
                    static_cast<size_t>(word_offsets[i + 1] - word_offsets[i]), word_counts[i]};
  });
  return trainer.run(options);
}

std::vector<Merge> train_merges(std::span<const std::string> words,
                                std::span<const int64_t> word_counts, const TrainOptions& options,
                                const std::function<void()>& release_words) {
  TF_CHECK_ARG(options.num_merges >= 0, "num_merges", options.num_merges, "must be >= 0");
  TF_CHECK_ARG(words.size() == word_counts.size(), "word_counts", word_counts.size(),
               "must have one count per word");
  size_t total_bytes = 0;
  for (const std::string& word : words) total_bytes += word.size() >= 2 ? word.size() : 0;
  Trainer trainer(options.interrupt);
  trainer.load(words.size(), total_bytes, [&](size_t i) {
    return WordView{reinterpret_cast<const uint8_t*>(words[i].data()), words[i].size(),
                    word_counts[i]};
  });
  if (release_words) release_words();
  return trainer.run(options);
}

}  // namespace trainfast::bpe
