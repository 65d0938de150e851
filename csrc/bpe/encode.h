// BPE encoding with a trained vocabulary: special tokens are split out (leftmost, longest first),
// the rest is pre-tokenized with a native scanner, and each pre-token's bytes are merged by
// repeatedly joining the leftmost adjacent pair of lowest merge rank (GPT-2 / tiktoken / CS336).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bpe/pretokenize.h"
#include "common/parallel.h"

namespace trainfast::bpe {

// Per-thread scratch space and the pre-token -> ids cache (defined in encode.cpp).
struct EncodeWorkspace;

class BpeEncoder {
 public:
  // `tokens[k]` is the byte string of id `ids[k]` (ids distinct, in [0, 2^31)); all 256 single
  // bytes must be present. Merge `r` (rank r) joins ids merge_left[r] and merge_right[r] into
  // merge_result[r]; a repeated pair keeps its lowest rank. `special_tokens[k]` has id
  // `special_ids[k]`. Throws std::invalid_argument on inconsistent input.
  BpeEncoder(std::span<const std::string_view> tokens, std::span<const int64_t> ids,
             std::span<const int64_t> merge_left, std::span<const int64_t> merge_right,
             std::span<const int64_t> merge_result, std::span<const std::string_view> special_tokens,
             std::span<const int64_t> special_ids, Pattern pattern);
  ~BpeEncoder();
  BpeEncoder(const BpeEncoder&) = delete;
  BpeEncoder& operator=(const BpeEncoder&) = delete;

  // Appends the ids of `text` (UTF-8; encoded surrogates allowed) to `out`. Thread-safe.
  void encode(std::string_view text, std::vector<uint32_t>& out, Interrupt* interrupt = nullptr) const;
  // Ids of each text; texts are spread over up to num_threads threads (result independent of it).
  std::vector<std::vector<uint32_t>> encode_batch(std::span<const std::string_view> texts, int num_threads,
                                                  Interrupt* interrupt = nullptr) const;
  // Ids of one pre-token's bytes (no pre-tokenization, no special tokens); for custom patterns.
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out, Interrupt* interrupt = nullptr) const;

  // Concatenated bytes of the ids; throws std::invalid_argument naming the first unknown id.
  std::string decode(std::span<const int64_t> ids, Interrupt* interrupt = nullptr) const;
  // The largest n <= text.size() such that text[0:n) encodes, followed by anything, exactly as
  // its own encoding followed by the encoding of the rest (0 when no such cut is known).
  size_t safe_cut(std::string_view text, Interrupt* interrupt = nullptr) const;

  // Ids below this bound are dense enough for tables indexed by id: a stray id of 10^8 in a 50k
  // vocab would cost gigabytes, so a vocab with an id past it keeps its ids sorted instead.
  static int64_t dense_id_bound(size_t num_tokens) { return 4 * static_cast<int64_t>(num_tokens) + 65536; }
  static bool ids_are_dense(int64_t max_id, size_t num_tokens) { return max_id < dense_id_bound(num_tokens); }

 private:
  struct Lease;
  std::unique_ptr<EncodeWorkspace> acquire() const;
  void release(std::unique_ptr<EncodeWorkspace> workspace) const;
  void encode_with(std::string_view text, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                   Interrupt* interrupt) const;
  void encode_pretoken(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                       Interrupt* interrupt) const;
  void merge_small(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws) const;
  void merge_large(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                   Interrupt* interrupt) const;
  // {rank, result id} of the pair, rank == kNoRank when the pair is not a merge.
  struct PairValue {
    uint32_t rank;
    uint32_t result;
  };
  PairValue lookup_pair(uint32_t left, uint32_t right) const;

  static constexpr uint32_t kNoRank = 0xFFFFFFFFu;
  struct PairSlot {
    uint64_t key;
    uint32_t rank;
    uint32_t result;
  };
  std::vector<PairSlot> pair_slots_;
  uint64_t pair_mask_ = 0;
  uint32_t byte_id_[256] = {};
  // The bytes of token `id`, or false for an id not in the vocab.
  bool find_token(int64_t id, std::string_view* token) const;
  // Token bytes by id (for decode): token_bytes_[offset, offset + length). Dense vocabs index
  // offset/length by id (offset -1: unknown id); sparse ones list them by ascending id.
  std::string token_bytes_;
  std::vector<int64_t> id_to_token_offset_;
  std::vector<uint32_t> id_to_token_length_;
  std::vector<int64_t> sparse_ids_;
  std::vector<int64_t> sparse_offset_;
  std::vector<uint32_t> sparse_length_;
  SpecialTokenMatcher specials_;
  std::unordered_map<std::string, uint32_t> special_id_;
  Pattern pattern_;

  mutable std::mutex pool_mutex_;
  mutable std::vector<std::unique_ptr<EncodeWorkspace>> pool_;
};

}  // namespace trainfast::bpe
