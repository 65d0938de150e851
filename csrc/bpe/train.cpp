#include "bpe/train.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "common/check.h"

namespace trainfast::bpe {
namespace {

constexpr int32_t kNone = -1;

// One symbol of a word. The words are doubly linked lists laid out one after another in a single
// array, so merging an occurrence touches only the symbols next to it.
// A symbol's token is the left token of the pair it starts (the last symbol's is never needed).
struct Symbol {
  int32_t prev;  // kNone at the start of the word
  int32_t next;  // kNone at the end of the word
  int32_t pair;  // index of the pair (token, next token); kNone at the end or once merged away
  int32_t word;
};

struct Pair {
  int64_t count;
  int32_t left;
  int32_t right;
};

struct HeapEntry {
  int64_t count;
  int32_t pair_idx;
};

struct Occurrence {
  int32_t pair_idx;
  int32_t position;  // of the pair's left symbol
};

// A new token's pairs with its neighbours, created once per merge and neighbour token.
struct NewPairSlots {
  int32_t left_stamp = kNone;  // merge that made (token, new)
  int32_t left_pair = kNone;
  int32_t right_stamp = kNone;  // merge that made (new, token)
  int32_t right_pair = kNone;
};

constexpr size_t kPrefetchDistance = 8;
constexpr int kInitialThresholdShift = 10;  // the heap starts with pairs within 2^10 of the top count

// Merge loop. Every pair keeps the positions of its left symbol in every word where it occurs
// (ascending, so left-to-right order holds within a word); a listed position whose symbol now
// starts another pair is skipped when visited. A pair only gains occurrences in the merge that
// creates its newer token, so each pair's position list is written once, contiguously, into one
// arena. Each symbol knows the pair it starts, so no pair is ever looked up by its tokens.
class Trainer {
 public:
  explicit Trainer(Interrupt* interrupt) : interrupt_(interrupt) {
    token_bytes_.reserve(256);
    for (int b = 0; b < 256; ++b) token_bytes_.emplace_back(1, static_cast<char>(b));
    new_pair_slots_.resize(256);
  }

  // word_at(i) gives word i as {data, size, count}.
  template <class WordAt>
  void load(size_t num_words, size_t total_bytes, const WordAt& word_at) {
    // Symbols are linked by 32-bit positions (half the memory of 64-bit ones); 2 GiB of distinct
    // pre-tokens is far past what real corpora reach (their distinct words repeat).
    TF_CHECK_ARG(total_bytes < static_cast<size_t>(INT32_MAX), "word_counts", total_bytes,
                 "must hold < 2^31 - 1 bytes of distinct pre-tokens (of 2+ bytes) in all");
    symbols_.reserve(total_bytes);
    std::vector<int32_t> byte_pair(256 * 256, kNone);  // pair index by left * 256 + right
    for (size_t i = 0; i < num_words; ++i) {
      if ((i & 0xffff) == 0xffff) poll_interrupt();
      const auto [data, size, count] = word_at(i);
      TF_CHECK_ARG(count >= 1, "word_counts", count, "must be >= 1");
      if (size < 2) continue;  // a single byte has no pair and never changes
      const int32_t word_idx = static_cast<int32_t>(word_count_.size());
      const int32_t base = static_cast<int32_t>(symbols_.size());
      const int32_t last = static_cast<int32_t>(size) - 1;
      for (int32_t k = 0; k < last; ++k) {
        int32_t& idx = byte_pair[data[k] * 256 + data[k + 1]];
        if (idx == kNone) idx = add_pair(data[k], data[k + 1]);
        // Every later pair count is at most one byte pair's: each occurrence of a merged pair
        // covers its own boundary between two adjacent bytes. So this check bounds the whole run.
        if (__builtin_add_overflow(pairs_[idx].count, count, &pairs_[idx].count)) {
          throw std::invalid_argument("word_counts: the byte pair (" + std::to_string(data[k]) + ", " +
                                      std::to_string(data[k + 1]) +
                                      ") occurs more than 2^63-1 times, counting each word's count");
        }
        ++pair_end_[idx];  // number of occurrences, for now
        symbols_.push_back({k == 0 ? kNone : base + k - 1, base + k + 1, idx, word_idx});
      }
      symbols_.push_back({base + last - 1, kNone, kNone, word_idx});
      word_count_.push_back(count);
    }
  }

  std::vector<Merge> run(const TrainOptions& options) {
    index_initial_pairs();
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
      const Pair pair = pairs_[best];
      merges.push_back({pair.left, pair.right});
      token_bytes_.push_back(token_bytes_[pair.left] + token_bytes_[pair.right]);
      new_pair_slots_.emplace_back();
      apply_merge(best, new_token, static_cast<int32_t>(merge_idx));
    }
    if (options.on_progress) options.on_progress(static_cast<int64_t>(merges.size()));
    return merges;
  }

 private:
  void poll_interrupt() {
    if (interrupt_ != nullptr) interrupt_->check();
  }

  int32_t add_pair(int32_t left, int32_t right) {
    TF_CHECK_ARG(pairs_.size() < static_cast<size_t>(INT32_MAX), "number of distinct pairs",
                 pairs_.size(), "must be < 2^31");
    pairs_.push_back({0, left, right});
    pair_begin_.push_back(0);
    pair_end_.push_back(0);
    return static_cast<int32_t>(pairs_.size() - 1);
  }

  // Lists every pair's positions (counted by load()) and fills the heap.
  void index_initial_pairs() {
    int64_t offset = 0;
    for (size_t idx = 0; idx < pairs_.size(); ++idx) {
      const int64_t num_occurrences = pair_end_[idx];
      pair_begin_[idx] = pair_end_[idx] = offset;
      offset += num_occurrences;
    }
    arena_.resize(static_cast<size_t>(offset));
    for (size_t p = 0; p < symbols_.size(); ++p) {
      const int32_t idx = symbols_[p].pair;
      if (idx != kNone) arena_[pair_end_[idx]++] = static_cast<int32_t>(p);
    }
    int64_t max_count = 0;
    for (const Pair& pair : pairs_) max_count = std::max(max_count, pair.count);
    heap_threshold_ = std::max<int64_t>(1, max_count >> kInitialThresholdShift);
    for (size_t idx = 0; idx < pairs_.size(); ++idx) {
      if (pairs_[idx].count >= heap_threshold_) {
        heap_.push_back({pairs_[idx].count, static_cast<int32_t>(idx)});
      } else {
        deferred_.push_back(static_cast<int32_t>(idx));
      }
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
      const Pair& x = t.pairs_[a.pair_idx];
      const Pair& y = t.pairs_[b.pair_idx];
      const int left = t.compare_tokens(x.left, y.left);
      if (left != 0) return left < 0;
      return t.compare_tokens(x.right, y.right) < 0;
    }
  };

  // Existing pairs only lose count (every new pair contains the newest token), so a heap entry
  // is an upper bound: a stale top is re-pushed with its current count until the top is exact.
  // Pairs counted below heap_threshold_ wait in deferred_ (most pairs are rare and never merged,
  // and a smaller heap is much faster); an exact top at or above the threshold beats them all.
  int32_t pop_best() {
    const HeapLess less{this};
    while (true) {
      while (!heap_.empty()) {
        const HeapEntry top = heap_.front();
        std::pop_heap(heap_.begin(), heap_.end(), less);
        heap_.pop_back();
        const int64_t current = pairs_[top.pair_idx].count;
        if (current == top.count && current >= heap_threshold_) return top.pair_idx;
        push_pair(top.pair_idx, current);
      }
      if (deferred_.empty()) return -1;
      lower_threshold();
    }
  }

  void push_pair(int32_t pair_idx, int64_t count) {
    if (count <= 0) return;  // merged, or no longer occurs
    if (count < heap_threshold_) {
      deferred_.push_back(pair_idx);
      return;
    }
    heap_.push_back({count, pair_idx});
    std::push_heap(heap_.begin(), heap_.end(), HeapLess{this});
  }

  // The heap ran empty: halve the threshold below the largest deferred count and move the pairs
  // now at or above it into the heap.
  void lower_threshold() {
    int64_t max_count = 0;
    for (const int32_t idx : deferred_) max_count = std::max(max_count, pairs_[idx].count);
    heap_threshold_ = std::max<int64_t>(1, max_count / 2);
    size_t kept = 0;
    for (const int32_t idx : deferred_) {
      const int64_t count = pairs_[idx].count;
      if (count >= heap_threshold_) {
        heap_.push_back({count, idx});
      } else if (count > 0) {
        deferred_[kept++] = idx;
      }
    }
    deferred_.resize(kept);
    std::make_heap(heap_.begin(), heap_.end(), HeapLess{this});
  }

  // Pair (x, new_token), made on first use in this merge.
  int32_t new_pair_with_left(int32_t x, int32_t new_token, int32_t merge_idx) {
    NewPairSlots& slots = new_pair_slots_[x];
    if (slots.left_stamp != merge_idx) {
      slots.left_stamp = merge_idx;
      slots.left_pair = add_pair(x, new_token);
    }
    return slots.left_pair;
  }

  // Pair (new_token, y).
  int32_t new_pair_with_right(int32_t new_token, int32_t y, int32_t merge_idx) {
    NewPairSlots& slots = new_pair_slots_[y];
    if (slots.right_stamp != merge_idx) {
      slots.right_stamp = merge_idx;
      slots.right_pair = add_pair(new_token, y);
    }
    return slots.right_pair;
  }

  void apply_merge(int32_t best, int32_t new_token, int32_t merge_idx) {
    const int64_t begin = pair_begin_[best], end = pair_end_[best];
    const int32_t first_new_pair = static_cast<int32_t>(pairs_.size());
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
      if (s.pair != best) continue;  // changed since it was listed
      const int32_t n = s.next;
      const int64_t count = word_count_[s.word];
      if (s.prev != kNone) {  // (x, a) becomes (x, new)
        Symbol& left = sym[s.prev];
        Pair& old_pair = pairs_[left.pair];
        old_pair.count -= count;
        left.pair = new_pair_with_left(old_pair.left, new_token, merge_idx);
        pairs_[left.pair].count += count;
        occurrences_.push_back({left.pair, s.prev});
      }
      const int32_t m = sym[n].next;
      if (m != kNone) {  // (b, y) becomes (new, y)
        Pair& old_pair = pairs_[sym[n].pair];
        old_pair.count -= count;
        s.pair = new_pair_with_right(new_token, old_pair.right, merge_idx);
        pairs_[s.pair].count += count;
        occurrences_.push_back({s.pair, p});
        sym[m].prev = p;
      } else {
        s.pair = kNone;
      }
      s.next = m;
      sym[n].pair = kNone;
    }
    pairs_[best].count = 0;
    register_new_pairs(first_new_pair);
  }

  // Gives the merge's new pairs their (ascending) position lists in the arena and a heap entry.
  // A new pair left at count 0 no longer occurs and can never occur again.
  void register_new_pairs(int32_t first_new_pair) {
    const int32_t num_pairs = static_cast<int32_t>(pairs_.size());
    for (const Occurrence& occ : occurrences_) ++pair_end_[occ.pair_idx];  // counts, for now
    int64_t offset = static_cast<int64_t>(arena_.size());
    for (int32_t idx = first_new_pair; idx < num_pairs; ++idx) {
      const int64_t count = pairs_[idx].count;
      const int64_t num_occurrences = count > 0 ? pair_end_[idx] : 0;
      pair_begin_[idx] = pair_end_[idx] = offset;
      offset += num_occurrences;
      push_pair(idx, count);
    }
    arena_.resize(static_cast<size_t>(offset));
    for (const Occurrence& occ : occurrences_) {
      if (pairs_[occ.pair_idx].count > 0) arena_[pair_end_[occ.pair_idx]++] = occ.position;
    }
  }

  Interrupt* interrupt_;
  std::vector<std::string> token_bytes_;
  std::vector<NewPairSlots> new_pair_slots_;  // by neighbour token, for the current merge
  std::vector<Symbol> symbols_;
  std::vector<int64_t> word_count_;

  std::vector<Pair> pairs_;
  std::vector<int64_t> pair_begin_;  // the pair's positions are arena_[begin, end)
  std::vector<int64_t> pair_end_;
  std::vector<int32_t> arena_;
  std::vector<HeapEntry> heap_;
  int64_t heap_threshold_ = 1;
  std::vector<int32_t> deferred_;  // pairs counted below heap_threshold_ when last seen
  std::vector<Occurrence> occurrences_;
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
