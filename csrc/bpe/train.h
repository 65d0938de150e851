// BPE merge loop with CS336 `train_bpe` semantics over pre-token counts.
//
// Token ids here are "merge space": 0..255 are the single bytes, 256 + k is the token made by merge
// k (special tokens are not part of training; the Python layer places them in the vocab).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/parallel.h"

namespace trainfast::bpe {

struct Merge {
  int32_t left;
  int32_t right;
};

struct TrainOptions {
  int64_t num_merges = 0;  // stop after this many merges, or earlier when no pair is left
  Interrupt* interrupt = nullptr;
  // Called from the calling thread with the number of merges done, at most every ~0.1 s and once
  // at the end.
  std::function<void(int64_t)> on_progress;
};

// Words are given as one byte buffer: word i is word_bytes[word_offsets[i], word_offsets[i + 1]),
// occurring word_counts[i] times (each >= 1). Pair counts are the sum of count x occurrences with
// overlapping occurrences counted; each step merges the pair with the highest count, ties to the
// greatest (left bytes, right bytes) compared as unsigned bytes; merges apply left to right,
// non-overlapping. Throws std::invalid_argument on bad input, or if a byte pair's count over all
// words (each occurrence weighted by its word's count) passes 2^63-1 (later pair counts never
// exceed one byte pair's, so they cannot overflow).
std::vector<Merge> train_merges(std::span<const uint8_t> word_bytes,
                                std::span<const int64_t> word_offsets,
                                std::span<const int64_t> word_counts, const TrainOptions& options);

// The same over a table of words (e.g. a pre-token counter's output): word i is words[i], occurring
// word_counts[i] times. `release_words`, when given, is called once the words have been read (the
// caller may free them there: the merge loop keeps its own copy, so peak memory stays lower).
std::vector<Merge> train_merges(std::span<const std::string> words,
                                std::span<const int64_t> word_counts, const TrainOptions& options,
                                const std::function<void()>& release_words = {});

}  // namespace trainfast::bpe
