#include "bpe/train.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "common/check.h"

namespace trainfast::bpe {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Open-addressing map from a (left, right) key to a dense pair index; pairs are never erased (a
// pair whose count drops to 0 keeps its slot), so no tombstones are needed.
class PairIndex {
 public:
  explicit PairIndex(size_t expected) {
    size_t capacity = 1024;
    while (capacity < expected * 2) capacity *= 2;
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, -1);
  }

  // Dense index of the pair, inserting it (as `next_index`) when absent; `inserted` says which.
  int32_t find_or_insert(uint64_t key, int32_t next_index, bool& inserted) {
    size_t slot = hash(key) & (keys_.size() - 1);
    while (true) {
      if (keys_[slot] == key) {
        inserted = false;
        return values_[slot];
      }
      if (keys_[slot] == kEmpty) break;
      slot = (slot + 1) & (keys_.size() - 1);
    }
    keys_[slot] = key;
    values_[slot] = next_index;
    inserted = true;
    if (++size_ * 2 > keys_.size()) grow();
    return next_index;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are < 2^31, so never a real key

  static size_t hash(uint64_t key) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return static_cast<size_t>(key);
  }

  void grow() {
    std::vector<uint64_t> old_keys(keys_.size() * 2, kEmpty);
    std::vector<int32_t> old_values(keys_.size() * 2, -1);
    old_keys.swap(keys_);
    old_values.swap(values_);
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] == kEmpty) continue;
      size_t slot = hash(old_keys[i]) & (keys_.size() - 1);
      while (keys_[slot] != kEmpty) slot = (slot + 1) & (keys_.size() - 1);
      keys_[slot] = old_keys[i];
      values_[slot] = old_values[i];
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  size_t size_ = 0;
};

struct HeapEntry {
  int64_t count;
  int32_t pair_idx;
};

class Trainer {
 public:
  Trainer(std::span<const uint8_t> word_bytes, std::span<const int64_t> word_offsets,
          std::span<const int64_t> word_counts, Interrupt* interrupt)
      : interrupt_(interrupt),
        pairs_(std::min<size_t>(word_bytes.size(), size_t{1} << 17)) {
    token_bytes_.reserve(256);
    for (int b = 0; b < 256; ++b) token_bytes_.emplace_back(1, static_cast<char>(b));
    load_words(word_bytes, word_offsets, word_counts);
    count_initial_pairs();
  }

  std::vector<Merge> run(const TrainOptions& options) {
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
      const int32_t new_token = static_cast<int32_t>(token_bytes_.size());
      TF_CHECK_ARG(new_token < INT32_MAX, "vocab_size", options.num_merges, "is too large");
      merges.push_back({pair_left_[best], pair_right_[best]});
      token_bytes_.push_back(token_bytes_[pair_left_[best]] + token_bytes_[pair_right_[best]]);
      apply_merge(best, new_token, static_cast<int32_t>(merge_idx));
    }
    if (options.on_progress) options.on_progress(static_cast<int64_t>(merges.size()));
    return merges;
  }

 private:
  void poll_interrupt() {
    if (interrupt_ != nullptr) interrupt_->check();
  }

  void load_words(std::span<const uint8_t> word_bytes, std::span<const int64_t> word_offsets,
                  std::span<const int64_t> word_counts) {
    TF_CHECK_ARG(word_offsets.size() == word_counts.size() + 1, "word_offsets", word_offsets.size(),
                 "must have one more entry than word_counts");
    TF_CHECK_ARG(word_offsets.empty() || word_offsets.front() == 0, "word_offsets",
                 word_offsets.front(), "must start at 0");
    TF_CHECK_ARG(word_offsets.empty() ||
                     word_offsets.back() == static_cast<int64_t>(word_bytes.size()),
                 "word_offsets", word_offsets.back(), "must end at len(word_bytes)");
    for (size_t i = 0; i < word_counts.size(); ++i) {
      const int64_t begin = word_offsets[i], end = word_offsets[i + 1];
      TF_CHECK_ARG(begin <= end, "word_offsets", end, "must be non-decreasing");
      TF_CHECK_ARG(word_counts[i] >= 1, "word_counts", word_counts[i], "must be >= 1");
      if (end - begin < 2) continue;  // a single byte has no pair and never changes
      TF_CHECK_ARG(end - begin < INT32_MAX, "word length", end - begin, "must be < 2^31");
      word_start_.push_back(static_cast<int64_t>(symbols_.size()));
      word_len_.push_back(static_cast<int32_t>(end - begin));
      word_count_.push_back(word_counts[i]);
      for (int64_t k = begin; k < end; ++k) symbols_.push_back(word_bytes[k]);
    }
    TF_CHECK_ARG(word_count_.size() < static_cast<size_t>(INT32_MAX), "number of words",
                 word_count_.size(), "must be < 2^31");
    word_stamp_.assign(word_count_.size(), -1);
  }

  void count_initial_pairs() {
    int64_t total = 0;  // bounds every pair count for the whole run (pair weight only shrinks)
    for (size_t w = 0; w < word_count_.size(); ++w) {
      if ((w & 0xffff) == 0) poll_interrupt();
      const int32_t* sym = symbols_.data() + word_start_[w];
      const int64_t count = word_count_[w];
      int64_t weight = 0;
      TF_CHECK_ARG(!__builtin_mul_overflow(count, int64_t{word_len_[w] - 1}, &weight) &&
                       !__builtin_add_overflow(total, weight, &total),
                   "word_counts", count, "sum to more than 2^63-1 pairs");
      for (int32_t i = 0; i + 1 < word_len_[w]; ++i) {
        const int32_t pair_idx = pair_of(sym[i], sym[i + 1]);
        pair_count_[pair_idx] += count;
        add_word(pair_idx, static_cast<int32_t>(w));
      }
    }
    heap_.reserve(pair_count_.size());
    for (size_t p = 0; p < pair_count_.size(); ++p) {
      if (pair_count_[p] > 0) heap_.push_back({pair_count_[p], static_cast<int32_t>(p)});
    }
    std::make_heap(heap_.begin(), heap_.end(), HeapLess{this});
    touched_stamp_.assign(pair_count_.size(), -1);
  }

  int32_t pair_of(int32_t left, int32_t right) {
    bool inserted = false;
    const int32_t idx = pairs_.find_or_insert(pair_key(left, right),
                                              static_cast<int32_t>(pair_count_.size()), inserted);
    if (inserted) {
      pair_count_.push_back(0);
      pair_left_.push_back(left);
      pair_right_.push_back(right);
      pair_words_.emplace_back();
      touched_stamp_.push_back(-1);
    }
    return idx;
  }

  void add_word(int32_t pair_idx, int32_t word_idx) {
    auto& words = pair_words_[pair_idx];
    if (words.empty() || words.back() != word_idx) words.push_back(word_idx);
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

  void change(int32_t left, int32_t right, int64_t delta, int32_t word_idx, int32_t merge_idx) {
    const int32_t pair_idx = pair_of(left, right);
    pair_count_[pair_idx] += delta;
    if (delta > 0) {
      add_word(pair_idx, word_idx);
      if (touched_stamp_[pair_idx] != merge_idx) {
        touched_stamp_[pair_idx] = merge_idx;
        touched_.push_back(pair_idx);
      }
    }
  }

  void apply_merge(int32_t best, int32_t new_token, int32_t merge_idx) {
    const int32_t a = pair_left_[best], b = pair_right_[best];
    std::vector<int32_t> words = std::move(pair_words_[best]);
    pair_words_[best] = {};
    touched_.clear();
    for (size_t k = 0; k < words.size(); ++k) {
      if ((k & 0xffff) == 0xffff) poll_interrupt();  // the first merges touch most words
      const int32_t w = words[k];
      if (word_stamp_[w] == merge_idx) continue;  // listed twice
      word_stamp_[w] = merge_idx;
      merge_word(w, a, b, new_token, merge_idx);
    }
    pair_count_[best] = 0;
    const HeapLess less{this};
    for (const int32_t pair_idx : touched_) {
      if (pair_count_[pair_idx] > 0) {
        heap_.push_back({pair_count_[pair_idx], pair_idx});
        std::push_heap(heap_.begin(), heap_.end(), less);
      }
    }
  }

  // Left-to-right, non-overlapping merge in place, with local pair-count updates: for each
  // occurrence, the pairs with its neighbours move from the old symbols to the new token.
  void merge_word(int32_t w, int32_t a, int32_t b, int32_t new_token, int32_t merge_idx) {
    int32_t* sym = symbols_.data() + word_start_[w];
    const int32_t len = word_len_[w];
    const int64_t count = word_count_[w];
    int32_t out = 0;
    int32_t i = 0;
    bool merged_any = false;
    while (i < len) {
      if (i + 1 < len && sym[i] == a && sym[i + 1] == b) {
        merged_any = true;
        if (out > 0) {
          const int32_t prev = sym[out - 1];
          change(prev, a, -count, w, merge_idx);
          change(prev, new_token, count, w, merge_idx);
        }
        if (i + 2 < len) {
          const int32_t next = sym[i + 2];
          change(b, next, -count, w, merge_idx);
          change(new_token, next, count, w, merge_idx);
        }
        sym[out++] = new_token;
        i += 2;
      } else {
        sym[out++] = sym[i++];
      }
    }
    if (merged_any) word_len_[w] = out;
  }

  Interrupt* interrupt_;
  std::vector<std::string> token_bytes_;
  std::vector<int32_t> symbols_;
  std::vector<int64_t> word_start_;
  std::vector<int32_t> word_len_;
  std::vector<int64_t> word_count_;
  std::vector<int32_t> word_stamp_;

  PairIndex pairs_;
  std::vector<int64_t> pair_count_;
  std::vector<int32_t> pair_left_;
  std::vector<int32_t> pair_right_;
  std::vector<std::vector<int32_t>> pair_words_;
  std::vector<int32_t> touched_stamp_;
  std::vector<int32_t> touched_;
  std::vector<HeapEntry> heap_;
};

}  // namespace

std::vector<Merge> train_merges(std::span<const uint8_t> word_bytes,
                                std::span<const int64_t> word_offsets,
                                std::span<const int64_t> word_counts, const TrainOptions& options) {
  TF_CHECK_ARG(options.num_merges >= 0, "num_merges", options.num_merges, "must be >= 0");
  Trainer trainer(word_bytes, word_offsets, word_counts, options.interrupt);
  return trainer.run(options);
}

}  // namespace trainfast::bpe
