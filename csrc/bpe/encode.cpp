#include "bpe/encode.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "bpe/unicode_tables.h"
#include "common/check.h"
#include "common/hash.h"

namespace trainfast::bpe {
namespace {

// Code point of the UTF-8 character starting at s[p] (p < n), and its byte length.
inline std::pair<char32_t, size_t> decode_at(const uint8_t* s, size_t n, size_t p) {
  const uint8_t b = s[p];
  size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  if (b >= 0x80 && b < 0xC0) return {0xFFFD, 1};  // stray continuation byte
  if (p + len > n) return {0xFFFD, 1};
  char32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[p + k] & 0x3F);
  return {cp, len};
}

// Code point of the UTF-8 character ending just before s[end] (end > 0).
inline char32_t decode_before(const uint8_t* s, size_t end) {
  size_t start = end - 1;
  while (start > 0 && end - start < 4 && (s[start] & 0xC0) == 0x80) --start;
  return decode_at(s, end, start).first;
}

inline bool is_letter(char32_t cp) {
  const auto c = unicode::char_class(cp);
  return c == unicode::kUpper || c == unicode::kLower || c == unicode::kLetterBoth;
}
inline bool is_space(char32_t cp) { return unicode::char_class(cp) == unicode::kSpace; }

// True when every supported pattern (gpt2, cl100k, o200k) must start a pre-token at byte p and the
// pre-tokens before p do not depend on the text from p on: "<non-space> <letter>" (cut before the
// space) or "<non-space>\n<letter>" (cut after the newline). Letters and \s as `regex` defines them.
inline bool regex_boundary(const uint8_t* s, size_t n, size_t p) {
  if (p < 2 || p + 1 >= n) return false;
  if (s[p] == ' ') return !is_space(decode_before(s, p)) && is_letter(decode_at(s, n, p + 1).first);
  return s[p - 1] == '\n' && is_letter(decode_at(s, n, p).first) && !is_space(decode_before(s, p - 1));
}

constexpr size_t kMaxCachedPiece = 1024;       // longer pre-tokens are rare and merged each time
constexpr size_t kMaxCacheEntries = size_t{1} << 20;
constexpr size_t kSmallPiece = 48;             // above: heap-based merging (O(n log n))
constexpr size_t kBlockBytes = size_t{1} << 20;  // text is pre-tokenized in blocks of about this

}  // namespace

// Pre-token -> ids cache (open addressing; keys and ids in arenas) plus merge scratch space.
struct EncodeWorkspace {
  struct Slot {
    uint64_t hash;
    uint64_t word;        // keys of up to 8 bytes, zero-padded (compared without the arena)
    uint32_t key_offset;
    uint32_t key_length;  // 0: empty slot
    uint32_t ids_offset;  // the id itself when ids_length == 1
    uint32_t ids_length;
  };
  std::vector<Slot> slots = std::vector<Slot>(4096);
  size_t num_entries = 0;
  std::vector<uint8_t> key_arena;
  std::vector<uint32_t> ids_arena;

  std::vector<size_t> ends;
  std::vector<uint32_t> parts, ranks, results;
  struct Node {
    uint32_t id;
    int32_t prev, next;
  };
  std::vector<Node> nodes;

  // Pointer to the cached ids of the key and their count, or {nullptr, 0}.
  std::pair<const uint32_t*, size_t> find(const uint8_t* key, size_t n, uint64_t h, uint64_t word) const {
    const size_t mask = slots.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& slot = slots[i];
      if (slot.key_length == 0) return {nullptr, 0};
      if (slot.hash == h && slot.key_length == n && slot.word == word &&
          (n <= 8 || std::memcmp(key_arena.data() + slot.key_offset, key, n) == 0)) {
        if (slot.ids_length == 1) return {&slot.ids_offset, 1};
        return {ids_arena.data() + slot.ids_offset, slot.ids_length};
      }
    }
  }

  void insert(const uint8_t* key, size_t n, uint64_t h, uint64_t word, const uint32_t* ids, size_t num_ids) {
    if (num_entries >= kMaxCacheEntries || key_arena.size() + n > 0xFFFFFFFFu ||
        ids_arena.size() + num_ids > 0xFFFFFFFFu) {
      clear();
    }
    if (2 * (num_entries + 1) > slots.size()) grow();
    const size_t mask = slots.size() - 1;
    size_t i = h & mask;
    while (slots[i].key_length != 0) i = (i + 1) & mask;
    Slot slot{h, word, 0, static_cast<uint32_t>(n), 0, static_cast<uint32_t>(num_ids)};
    if (n > 8) {
      slot.key_offset = static_cast<uint32_t>(key_arena.size());
      key_arena.insert(key_arena.end(), key, key + n);
    }
    if (num_ids == 1) {
      slot.ids_offset = ids[0];
    } else {
      slot.ids_offset = static_cast<uint32_t>(ids_arena.size());
      ids_arena.insert(ids_arena.end(), ids, ids + num_ids);
    }
    slots[i] = slot;
    ++num_entries;
  }

  void grow() {
    std::vector<Slot> old(slots.size() * 2);
    old.swap(slots);
    const size_t mask = slots.size() - 1;
    for (const Slot& slot : old) {
      if (slot.key_length == 0) continue;
      size_t i = slot.hash & mask;
      while (slots[i].key_length != 0) i = (i + 1) & mask;
      slots[i] = slot;
    }
  }

  void clear() {
    slots.assign(4096, Slot{});
    num_entries = 0;
    key_arena.clear();
    ids_arena.clear();
  }
};

BpeEncoder::BpeEncoder(std::span<const std::string_view> tokens, std::span<const int64_t> ids,
                       std::span<const int64_t> merge_left, std::span<const int64_t> merge_right,
                       std::span<const int64_t> merge_result, std::span<const std::string_view> special_tokens,
                       std::span<const int64_t> special_ids, Pattern pattern)
    : pattern_(pattern) {
  TF_CHECK_ARG(tokens.size() == ids.size(), "ids", ids.size(), "must have one id per vocab token");
  TF_CHECK_ARG(merge_left.size() == merge_right.size() && merge_left.size() == merge_result.size(),
               "merges", merge_right.size(), "left/right/result arrays must have equal lengths");
  TF_CHECK_ARG(special_tokens.size() == special_ids.size(), "special_ids", special_ids.size(),
               "must have one id per special token");
  TF_CHECK_ARG(pattern == Pattern::kGpt2 || pattern == Pattern::kCl100k || pattern == Pattern::kO200k,
               "pattern", static_cast<int>(pattern), "must be 0 (gpt2), 1 (cl100k) or 2 (o200k)");
  int64_t max_id = -1;
  for (size_t k = 0; k < ids.size(); ++k) {
    TF_CHECK_ARG(ids[k] >= 0 && ids[k] < (int64_t{1} << 31), "vocab id", ids[k], "must be in [0, 2^31)");
    TF_CHECK_ARG(!tokens[k].empty(), "vocab token of id", ids[k], "must be non-empty bytes");
    max_id = std::max(max_id, ids[k]);
  }
  std::vector<int64_t> offsets(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    offsets[k] = static_cast<int64_t>(token_bytes_.size());
    token_bytes_.append(tokens[k]);
  }
  if (ids_are_dense(max_id, ids.size())) {
    id_to_token_offset_.assign(static_cast<size_t>(max_id + 1), -1);
    id_to_token_length_.assign(static_cast<size_t>(max_id + 1), 0);
    for (size_t k = 0; k < ids.size(); ++k) {
      const auto id = static_cast<size_t>(ids[k]);
      TF_CHECK_ARG(id_to_token_offset_[id] < 0, "vocab id", ids[k], "must be unique");
      id_to_token_offset_[id] = offsets[k];
      id_to_token_length_[id] = static_cast<uint32_t>(tokens[k].size());
    }
  } else {
    std::vector<size_t> by_id(ids.size());
    std::iota(by_id.begin(), by_id.end(), size_t{0});
    std::sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return ids[a] < ids[b]; });
    for (size_t j = 0; j < by_id.size(); ++j) {
      const size_t k = by_id[j];
      TF_CHECK_ARG(j == 0 || ids[by_id[j - 1]] != ids[k], "vocab id", ids[k], "must be unique");
      sparse_ids_.push_back(ids[k]);
      sparse_offset_.push_back(offsets[k]);
      sparse_length_.push_back(static_cast<uint32_t>(tokens[k].size()));
    }
  }
  bool have_byte[256] = {};
  for (size_t k = 0; k < ids.size(); ++k) {
    if (tokens[k].size() == 1) {
      const auto b = static_cast<uint8_t>(tokens[k][0]);
      // A one-byte special token may repeat its byte (train_bpe's vocab); the later id wins, as in
      // Python's reverse map, and text never reaches it: specials are split off first.
      const bool is_special = std::find(special_tokens.begin(), special_tokens.end(), tokens[k]) != special_tokens.end();
      TF_CHECK_ARG(!have_byte[b] || is_special, "vocab byte token", static_cast<int>(b), "must appear only once");
      have_byte[b] = true;
      byte_id_[b] = static_cast<uint32_t>(ids[k]);
    }
  }
  for (int b = 0; b < 256; ++b) {
    TF_CHECK_ARG(have_byte[b], "vocab", "a table without byte " + std::to_string(b),
                 "must contain all 256 single-byte tokens");
  }
  auto token_of = [&](int64_t id) {
    std::string_view token;
    find_token(id, &token);
    return token;
  };
  auto known = [&](int64_t id) {
    std::string_view token;
    return find_token(id, &token);
  };

  const size_t num_merges = merge_left.size();
  TF_CHECK_ARG(num_merges < kNoRank, "merges", num_merges, "must number fewer than 2^32 - 1");
  size_t capacity = 16;
  while (capacity < 2 * num_merges) capacity *= 2;
  pair_slots_.assign(capacity, PairSlot{~uint64_t{0}, kNoRank, 0});
  pair_mask_ = capacity - 1;
  for (size_t r = 0; r < num_merges; ++r) {
    const int64_t left = merge_left[r], right = merge_right[r], result = merge_result[r];
    if (!known(left) || !known(right) || !known(result)) {
      throw std::invalid_argument("merges[" + std::to_string(r) + "] refers to an unknown token id (" +
                                  std::to_string(left) + ", " + std::to_string(right) + " -> " +
                                  std::to_string(result) + ")");
    }
    const std::string_view l = token_of(left), rt = token_of(right), res = token_of(result);
    if (res.size() != l.size() + rt.size() || res.substr(0, l.size()) != l || res.substr(l.size()) != rt) {
      throw std::invalid_argument("merges[" + std::to_string(r) + "]: token " + std::to_string(result) +
                                  " is not the concatenation of tokens " + std::to_string(left) + " and " +
                                  std::to_string(right));
    }
    const uint64_t key = (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right);
    for (uint64_t i = mix64(key) & pair_mask_;; i = (i + 1) & pair_mask_) {
      PairSlot& slot = pair_slots_[i];
      if (slot.key == key) break;  // a repeated pair keeps its first (lowest) rank
      if (slot.key == ~uint64_t{0}) {
        slot = {key, static_cast<uint32_t>(r), static_cast<uint32_t>(result)};
        break;
      }
    }
  }

  std::vector<std::string> special_strings;
  for (size_t k = 0; k < special_tokens.size(); ++k) {
    const std::string token(special_tokens[k]);
    TF_CHECK_ARG(!token.empty(), "special token index", k, "must be non-empty");
    TF_CHECK_ARG(known(special_ids[k]) && token_of(special_ids[k]) == token, "special token id", special_ids[k],
                 "must be a vocab id whose bytes are the special token");
    TF_CHECK_ARG(special_id_.emplace(token, static_cast<uint32_t>(special_ids[k])).second, "special token index", k,
                 "must not repeat an earlier special token");
    special_strings.push_back(token);
  }
  specials_ = SpecialTokenMatcher(std::move(special_strings));
}

BpeEncoder::~BpeEncoder() = default;

bool BpeEncoder::find_token(int64_t id, std::string_view* token) const {
  int64_t offset;
  uint32_t length;
  if (id >= 0 && static_cast<uint64_t>(id) < id_to_token_offset_.size()) {
    offset = id_to_token_offset_[static_cast<size_t>(id)];
    length = id_to_token_length_[static_cast<size_t>(id)];
    if (offset < 0) return false;
  } else {
    const auto it = std::lower_bound(sparse_ids_.begin(), sparse_ids_.end(), id);
    if (it == sparse_ids_.end() || *it != id) return false;
    const auto k = static_cast<size_t>(it - sparse_ids_.begin());
    offset = sparse_offset_[k];
    length = sparse_length_[k];
  }
  *token = std::string_view(token_bytes_).substr(static_cast<size_t>(offset), length);
  return true;
}

BpeEncoder::PairValue BpeEncoder::lookup_pair(uint32_t left, uint32_t right) const {
  const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
  for (uint64_t i = mix64(key) & pair_mask_;; i = (i + 1) & pair_mask_) {
    const PairSlot& slot = pair_slots_[i];
    if (slot.key == key) return {slot.rank, slot.result};
    if (slot.key == ~uint64_t{0}) return {kNoRank, 0};
  }
}

std::unique_ptr<EncodeWorkspace> BpeEncoder::acquire() const {
  {
    std::lock_guard<std::mutex> lock(pool_mutex_);
    if (!pool_.empty()) {
      auto ws = std::move(pool_.back());
      pool_.pop_back();
      return ws;
    }
  }
  return std::make_unique<EncodeWorkspace>();
}

void BpeEncoder::release(std::unique_ptr<EncodeWorkspace> workspace) const {
  std::lock_guard<std::mutex> lock(pool_mutex_);
  if (pool_.size() < 64) pool_.push_back(std::move(workspace));
}

struct BpeEncoder::Lease {
  const BpeEncoder& encoder;
  std::unique_ptr<EncodeWorkspace> ws;
  explicit Lease(const BpeEncoder& e) : encoder(e), ws(e.acquire()) {}
  ~Lease() { encoder.release(std::move(ws)); }
};

void BpeEncoder::merge_small(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws) const {
  auto& parts = ws.parts;
  auto& ranks = ws.ranks;
  auto& results = ws.results;
  parts.resize(n);
  ranks.resize(n - 1);
  results.resize(n - 1);
  for (size_t i = 0; i < n; ++i) parts[i] = byte_id_[s[i]];
  for (size_t i = 0; i + 1 < n; ++i) {
    const PairValue v = lookup_pair(parts[i], parts[i + 1]);
    ranks[i] = v.rank;
    results[i] = v.result;
  }
  size_t m = n;
  while (m > 1) {
    size_t best = 0;
    uint32_t best_rank = ranks[0];
    for (size_t i = 1; i + 1 < m; ++i) {
      if (ranks[i] < best_rank) {
        best_rank = ranks[i];
        best = i;
      }
    }
    if (best_rank == kNoRank) break;
    parts[best] = results[best];
    // Drop part best + 1 and pair best; the pairs on both sides of the merged token change.
    std::memmove(&parts[best + 1], &parts[best + 2], (m - best - 2) * sizeof(uint32_t));
    std::memmove(&ranks[best], &ranks[best + 1], (m - best - 2) * sizeof(uint32_t));
    std::memmove(&results[best], &results[best + 1], (m - best - 2) * sizeof(uint32_t));
    --m;
    if (best > 0) {
      const PairValue v = lookup_pair(parts[best - 1], parts[best]);
      ranks[best - 1] = v.rank;
      results[best - 1] = v.result;
    }
    if (best + 1 < m) {
      const PairValue v = lookup_pair(parts[best], parts[best + 1]);
      ranks[best] = v.rank;
      results[best] = v.result;
    }
  }
  out.insert(out.end(), parts.begin(), parts.begin() + static_cast<std::ptrdiff_t>(m));
}

void BpeEncoder::merge_large(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                             Interrupt* interrupt) const {
  // Nodes link by 32-bit positions (half the memory of 64-bit ones for the common large piece).
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::length_error("a pre-token of " + std::to_string(n) + " bytes is too long to encode (at most 2^31 - 1)");
  }
  auto& nodes = ws.nodes;
  nodes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    nodes[i] = {byte_id_[s[i]], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
  }
  // Min-heap of (rank, position of the pair's left node): leftmost lowest rank first. An entry is
  // stale when its pair changed; ranks identify pairs, so re-checking the rank detects that.
  using Entry = std::pair<uint32_t, int32_t>;
  std::vector<Entry> first_pairs;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (interrupt != nullptr && (i & 0xFFFFF) == 0xFFFFF) interrupt->check();
    const PairValue v = lookup_pair(nodes[i].id, nodes[i + 1].id);
    if (v.rank != kNoRank) first_pairs.emplace_back(v.rank, static_cast<int32_t>(i));
  }
  // Heapified at once (linear; a push per pair took a third of a second for 8M, deaf to Ctrl-C).
  // Entries are totally ordered, so the pop order does not depend on how the heap was built.
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap(std::greater<Entry>(), std::move(first_pairs));
  std::vector<uint8_t> alive(n, 1);
  // One pre-token can be a whole file's worth of letters: poll for Ctrl-C inside it.
  for (uint64_t num_popped = 0; !heap.empty(); ++num_popped) {
    if (interrupt != nullptr && num_popped % (uint64_t{1} << 16) == 0) interrupt->check();
    const auto [rank, pos] = heap.top();
    heap.pop();
    if (!alive[static_cast<size_t>(pos)]) continue;
    EncodeWorkspace::Node& node = nodes[static_cast<size_t>(pos)];
    if (node.next < 0) continue;
    const PairValue v = lookup_pair(node.id, nodes[static_cast<size_t>(node.next)].id);
    if (v.rank != rank) continue;
    const int32_t removed = node.next;
    node.id = v.result;
    node.next = nodes[static_cast<size_t>(removed)].next;
    if (node.next >= 0) nodes[static_cast<size_t>(node.next)].prev = pos;
    alive[static_cast<size_t>(removed)] = 0;
    if (node.prev >= 0) {
      const PairValue left = lookup_pair(nodes[static_cast<size_t>(node.prev)].id, node.id);
      if (left.rank != kNoRank) heap.emplace(left.rank, node.prev);
    }
    if (node.next >= 0) {
      const PairValue right = lookup_pair(node.id, nodes[static_cast<size_t>(node.next)].id);
      if (right.rank != kNoRank) heap.emplace(right.rank, pos);
    }
  }
  for (int32_t i = 0; i >= 0; i = nodes[static_cast<size_t>(i)].next) out.push_back(nodes[static_cast<size_t>(i)].id);
}

void BpeEncoder::encode_pretoken(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                                 Interrupt* interrupt) const {
  if (n == 1) {
    out.push_back(byte_id_[s[0]]);
    return;
  }
  if (n > kMaxCachedPiece) {
    merge_large(s, n, out, ws, interrupt);
    return;
  }
  uint64_t word = 0;
  std::memcpy(&word, s, std::min<size_t>(n, 8));
  const uint64_t h = n <= 8 ? mix64(word ^ (n * 0x9E3779B97F4A7C15ull)) : hash_bytes(s, n);
  const auto [cached, num_cached] = ws.find(s, n, h, word);
  if (cached != nullptr) {
    out.insert(out.end(), cached, cached + num_cached);
    return;
  }
  const size_t before = out.size();
  if (n <= kSmallPiece) {
    merge_small(s, n, out, ws);
  } else {
    merge_large(s, n, out, ws, interrupt);
  }
  ws.insert(s, n, h, word, out.data() + before, out.size() - before);
}

void BpeEncoder::encode_piece(std::string_view piece, std::vector<uint32_t>& out, Interrupt* interrupt) const {
  if (piece.empty()) return;
  Lease lease(*this);
  encode_pretoken(reinterpret_cast<const uint8_t*>(piece.data()), piece.size(), out, *lease.ws, interrupt);
}

void BpeEncoder::encode_with(std::string_view text, std::vector<uint32_t>& out, EncodeWorkspace& ws,
                             Interrupt* interrupt) const {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  out.reserve(out.size() + n / 3 + 1);  // English averages over 4 bytes per token: rarely regrows
  SpecialTokenFinder finder(specials_, text);
  size_t i = 0;
  while (i <= n) {
    const auto [special_start, special_length] = specials_.empty() ? std::pair<size_t, size_t>{n, 0}
                                                                   : finder.find(i, interrupt);
    // The special-free segment [i, special_start) goes in blocks cut where pre-tokens must break.
    while (i < special_start) {
      size_t block_end = special_start;
      if (special_start - i > 2 * kBlockBytes) {
        block_end = i + kBlockBytes;
        while (block_end < special_start && !regex_boundary(s + i, special_start - i, block_end - i) &&
               !is_safe_cut(pattern_, s + i, block_end - i, special_start - i)) {
          ++block_end;
          if (interrupt != nullptr && (block_end & 0xFFFFF) == 0) interrupt->check();
        }
      }
      // Text without a safe cut is one block however long: Ctrl-C is polled inside it too.
      ws.ends.clear();
      pretokenize(text.substr(i, block_end - i), pattern_, ws.ends, interrupt);
      size_t begin = 0;
      for (size_t k = 0; k < ws.ends.size(); ++k) {
        if (interrupt != nullptr && (k & 0xFFF) == 0xFFF) interrupt->check();
        encode_pretoken(s + i + begin, ws.ends[k] - begin, out, ws, interrupt);
        begin = ws.ends[k];
      }
      i = block_end;
      if (interrupt != nullptr) interrupt->check();
    }
    if (special_length == 0) break;
    out.push_back(special_id_.find(std::string(text.substr(special_start, special_length)))->second);
    i = special_start + special_length;
  }
}

void BpeEncoder::encode(std::string_view text, std::vector<uint32_t>& out, Interrupt* interrupt) const {
  Lease lease(*this);
  encode_with(text, out, *lease.ws, interrupt);
}

std::vector<std::vector<uint32_t>> BpeEncoder::encode_batch(std::span<const std::string_view> texts,
                                                            int num_threads, Interrupt* interrupt) const {
  std::vector<std::vector<uint32_t>> results(texts.size());
  const auto num_texts = static_cast<int64_t>(texts.size());
  const int threads = std::max(1, num_threads);
  const int64_t block = std::clamp<int64_t>(num_texts / (int64_t{threads} * 8), 1, 64);
  parallel_for(num_texts, block, threads, [&](int64_t begin, int64_t end) {
    Lease lease(*this);
    for (int64_t k = begin; k < end; ++k) {
      if (interrupt != nullptr && interrupt->stop_requested()) return;
      // Polls inside long texts too (only the calling thread asks Python; workers read the flag).
      encode_with(texts[static_cast<size_t>(k)], results[static_cast<size_t>(k)], *lease.ws, interrupt);
    }
  }, interrupt);
  return results;
}

std::string BpeEncoder::decode(std::span<const int64_t> ids, Interrupt* interrupt) const {
  size_t total = 0;
  std::string_view token;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();
    if (!find_token(ids[k], &token)) {
      throw std::invalid_argument("ids[" + std::to_string(k) + "] = " + std::to_string(ids[k]) +
                                  " is not a token id of this vocabulary");
    }
    total += token.size();
  }
  std::string out;
  out.reserve(total);
  for (size_t k = 0; k < ids.size(); ++k) {
    if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();
    find_token(ids[k], &token);
    out.append(token);
  }
  return out;
}

size_t BpeEncoder::safe_cut(std::string_view text, Interrupt* interrupt) const {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  const size_t reach = specials_.empty() ? 0 : specials_.max_length() - 1;
  if (n < reach + 3) return 0;
  // Text without letters (numbers, CSV) has no regex_boundary; a pre-token-safe cut serves too.
  auto pattern_safe = [&](size_t p) { return regex_boundary(s, n, p) || is_safe_cut(pattern_, s, p, n); };
  // Every special token starting before the cut must end inside the text (n - reach).
  size_t p = n - reach - 1;
  // Backwards, past at most a few special-token occurrences: each straddling() reads a long
  // token's whole reach.
  int num_occurrences = 0;
  for (uint64_t steps = 1; p >= 2 && num_occurrences < 64; ++steps) {
    if (interrupt != nullptr && (steps & 0xFFFFF) == 0) interrupt->check();
    if (!pattern_safe(p)) {
      --p;
      continue;
    }
    // Inside a special token's occurrence no point is safe: its start is the next one to try.
    const size_t first_start = specials_.empty() ? p : specials_.straddling(text, p).first;
    if (first_start == p) return p;
    p = first_start;
    ++num_occurrences;
  }
  if (p < 2) return 0;
  // Text densely covered by special tokens: one forward pass keeps the last safe point up to p.
  SpecialTokenCover cover(specials_, text);
  size_t last_safe = 0;
  for (size_t q = 2; q <= p; ++q) {
    if (interrupt != nullptr && (q & 0xFFFFF) == 0) interrupt->check();
    if (pattern_safe(q) && cover.covered_until(q, interrupt) == q) last_safe = q;
  }
  return last_safe;
}

}  // namespace trainfast::bpe
