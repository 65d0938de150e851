// BPE pre-tokenization: hand-written scanners equal to `regex.findall` with the GPT-2, cl100k and
// o200k patterns, special-token splitting, Python-text-mode UTF-8 decoding, and multithreaded
// counting of pre-tokens over files or in-memory documents.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/check.h"
#include "common/parallel.h"

namespace trainfast::bpe {

enum class Pattern : int {
  kGpt2 = 0,    // '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kCl100k = 1,  // tiktoken cl100k_base
  kO200k = 2,   // tiktoken o200k_base
};

enum class Utf8Errors : int { kStrict = 0, kReplace = 1, kIgnore = 2 };

// Appends to `ends` the end byte offset of every pre-token of `text`, as `regex.findall` would cut
// it (the pre-tokens tile the text). `text` is UTF-8, where encoded surrogates are allowed (a
// Python str encoded with "surrogatepass"); behaviour on other invalid bytes is unspecified but safe.
void pretokenize(std::string_view text, Pattern pattern, std::vector<size_t>& ends, Interrupt* interrupt = nullptr);

// Splits text at special tokens first, as `regex.split` with the escaped tokens joined longest
// first: leftmost occurrence wins, and the longest token at that position.
class SpecialTokenMatcher {
 public:
  // Tokens longer than this are also matched by an automaton (below): one walk per position costs
  // up to the token's length, so text full of near misses of a 400 KB token took minutes per MB.
  static constexpr size_t kLongToken = 64;

  SpecialTokenMatcher() = default;
  // Throws std::invalid_argument on an empty token; duplicates are ignored.
  explicit SpecialTokenMatcher(std::vector<std::string> special_tokens);

  bool empty() const { return max_length_ == 0; }
  size_t max_length() const { return max_length_; }
  // Leftmost occurrence at or after `from`: {start, length}; {text.size(), 0} when none. Polls
  // `interrupt` as it goes. A caller that moves forward through one text uses SpecialTokenFinder,
  // which keeps what it has read between calls.
  std::pair<size_t, size_t> find(std::string_view text, size_t from, Interrupt* interrupt = nullptr) const;
  // The occurrences of any token that cover both byte p - 1 and byte p: {the first one's start,
  // the last end of any of them}; {p, p} when there is none. No cut between them is safe, so a
  // caller looking for one moves past them at once.
  std::pair<size_t, size_t> straddling(std::string_view text, size_t p) const;

 private:
  friend class SpecialTokenFinder;

  // The tokens as a byte trie with each chain of single-child nodes folded into one edge (a radix
  // tree): each position is matched by one walk, however many tokens there are (trying each token
  // in turn cost seconds per 10 MB with 2000 tokens of one prefix), and a long token's bytes are
  // compared by memcmp, not byte by byte.
  struct Node {
    uint32_t first_edge = 0;  // its edges: [first_edge, first_edge + num_edges), by first byte
    uint32_t num_edges = 0;
    bool is_token = false;    // a token ends here
  };
  struct Edge {
    uint32_t label_begin;     // its bytes: labels_[label_begin, label_begin + label_length)
    uint32_t label_length;
    uint32_t node;
  };
  // The edge out of `node` whose label starts with `byte`, or nullptr.
  const Edge* edge(uint32_t node, uint8_t byte) const;
  // Calls on_token(end) for each token that s[start:n) starts with, shortest first; stops when it
  // returns true (and returns true). Adds the bytes it compared to *compared (to within 64).
  template <typename OnToken>
  bool walk(const uint8_t* s, size_t start, size_t n, OnToken on_token, uint64_t* compared = nullptr) const;
  // The longest token starting at s[i], by a walk; 0 when none.
  size_t longest_at(const uint8_t* s, size_t i, size_t n, uint64_t* compared = nullptr) const;
  // The next position at or after i where some token could start (its first byte), or n.
  size_t next_candidate(const uint8_t* s, size_t i, size_t n) const;

  // With a token longer than kLongToken: an Aho-Corasick automaton of the reversed tokens. Run
  // backwards over the text, its state at byte i holds the longest token that starts at i, so one
  // pass finds the longest token at every position of a stretch in time linear in the stretch
  // plus the longest token (the lookahead), however the tokens and the text overlap. Walks stay
  // the first choice (a memchr to each possible start is far cheaper on ordinary text); the
  // automaton takes over where the walks compare more than a few bytes per byte of text.
  struct ReverseAutomaton {
    std::vector<uint32_t> first_edge, fail, longest;  // per node; node 0 is the root
    std::vector<uint16_t> num_edges;
    std::vector<uint8_t> edge_byte;                   // by node, then byte
    std::vector<uint32_t> edge_node;
    uint32_t root_next[256] = {};                     // 0: no token ends with that byte
    bool empty() const { return fail.empty(); }
    uint32_t child(uint32_t node, uint8_t byte) const;  // 0 when none
    uint32_t step(uint32_t state, uint8_t byte) const;
  };
  void build_reverse_automaton(const std::vector<std::string>& sorted_tokens);
  // Calls visit(i, length) for i = b - 1 down to a (a < b <= n), length being that of the longest
  // token starting at s[i] (0: none); stops when visit returns true (and returns true). Needs the
  // reverse automaton.
  template <typename Visit>
  bool visit_longest(const uint8_t* s, size_t n, size_t a, size_t b, Visit visit, Interrupt* interrupt) const;

  std::vector<Node> nodes_;           // nodes_[0]: the root
  std::vector<uint8_t> edge_bytes_;   // each edge's first byte, for the search
  std::vector<Edge> edges_;
  std::string labels_;               // the tokens, sorted, one after another
  uint32_t root_edge_[256] = {};      // 1 + the root's edge for that first byte; 0: none
  size_t max_length_ = 0;
  int num_first_bytes_ = 0;
  unsigned char only_first_byte_ = 0;
  ReverseAutomaton reverse_;
};

// Bytes the walks of a special-token search may compare beyond 4 per byte of text before the
// automaton takes over (65536). Tests set 0 so that small texts reach the automaton too.
uint64_t special_token_walk_slack();
void set_special_token_walk_slack(uint64_t bytes);

// Special-token search forward through one text: find(from) answers as the matcher's find, and
// with long tokens reuses the longest-token lengths of the stretch it last read, so finding every
// occurrence takes time linear in the text (one search per call re-read the lookahead each time).
class SpecialTokenFinder {
 public:
  SpecialTokenFinder(const SpecialTokenMatcher& matcher, std::string_view text) : matcher_(matcher), text_(text) {}
  std::pair<size_t, size_t> find(size_t from, Interrupt* interrupt = nullptr);

 private:
  const SpecialTokenMatcher& matcher_;
  std::string_view text_;
  size_t begin_ = 0;               // longest_[k]: the longest token starting at text_[begin_ + k]
  std::vector<uint32_t> longest_;
  size_t walks_from_ = SIZE_MAX;   // walks since the last stretch (or the first call) started here
  uint64_t compared_ = 0;          // and compared this many bytes
};

// Which points of one text an occurrence of a special token covers, asked for points in
// increasing order: the furthest end of the occurrences that start before the point, kept as the
// point moves, so asking at every point of a text costs time linear in it however long the tokens
// (straddling() reads a long token's whole reach at each point: text densely covered by a short
// token, with a 10 KB token beside it, took 25 s per MB).
class SpecialTokenCover {
 public:
  SpecialTokenCover(const SpecialTokenMatcher& matcher, std::string_view text)
      : matcher_(matcher), finder_(matcher, text), n_(text.size()) {}
  // As matcher.straddling(text, p).second: the furthest end of the occurrences that cover p - 1
  // and p, or p when none does. p must not decrease from one call to the next.
  size_t covered_until(size_t p, Interrupt* interrupt = nullptr);

 private:
  const SpecialTokenMatcher& matcher_;
  SpecialTokenFinder finder_;
  size_t n_;
  size_t scanned_ = 0;                    // occurrences starting below this are in max_end_
  size_t next_start_ = SIZE_MAX;          // the first occurrence at or after scanned_, if looked up
  size_t next_length_ = 0;
  size_t max_end_ = 0;
};

// Whether cutting s[0:n) at byte p (0 < p < n) leaves every pre-token unchanged:
// findall(s) == findall(s[:p]) + findall(s[p:]). It reads only the characters at p-1 and p, so the
// cut stays safe whatever text follows s[n-1] (streaming). The proof is at is_safe_split.
bool is_safe_cut(Pattern pattern, const uint8_t* s, size_t p, size_t n);

// Pre-tokens and special tokens of `text`, in order, as byte ranges.
struct Piece {
  size_t begin;
  size_t end;
  bool special;
};
std::vector<Piece> split_and_pretokenize(std::string_view text, Pattern pattern, const SpecialTokenMatcher& specials,
                                         Interrupt* interrupt = nullptr);

// Invalid UTF-8 in strict mode; the message names the input and the first bad byte's offset.
class DecodeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

using trainfast::FileError;

// Decodes UTF-8 like Python's text mode (errors = strict/replace/ignore, then universal newlines:
// "\r\n" and "\r" become "\n"), incrementally: the bytes of an unfinished character are kept until
// the next call or `final`; a "\r" is written at once and a "\n" first in the next call dropped.
class TextDecoder {
 public:
  explicit TextDecoder(Utf8Errors errors) : errors_(errors) {}
  // Appends the decoded text of raw[0:n) to `out` and returns how many bytes were consumed (the
  // rest must be passed again, first, with the next bytes). `base_offset` is the input offset of
  // raw[0], for error messages; `name` names the input. Throws DecodeError (strict mode).
  size_t decode(const uint8_t* raw, size_t n, bool final, int64_t base_offset,
                const std::string& name, std::string& out);

 private:
  Utf8Errors errors_;
  bool skip_lf_ = false;  // the last character written was a translated "\r"
};

struct PretokenCounts {
  std::vector<std::string> pretokens;  // unique, in order of first occurrence in the input
  std::vector<int64_t> counts;         // counts[i] >= 1 occurrences of pretokens[i]
};

// The same, flat: pre-token k is bytes[offsets[k]:offsets[k + 1]] (offsets has one more entry).
struct FlatPretokenCounts {
  UninitializedBuffer<uint8_t> bytes;
  UninitializedBuffer<uint64_t> offsets;
  UninitializedBuffer<int64_t> counts;
};

struct CountOptions {
  Pattern pattern = Pattern::kGpt2;
  std::vector<std::string> special_tokens;  // split on first, never counted
  Utf8Errors errors = Utf8Errors::kStrict;
  int num_threads = 1;
  size_t block_bytes = size_t{64} << 20;  // file bytes read per step (bounds memory)
  size_t chunk_bytes = size_t{256} << 10;  // target work unit per thread (small: threads finish together)
};

// Counts pre-tokens over any number of inputs; each input (file or document) is pre-tokenized on
// its own. Results never depend on num_threads, block_bytes or chunk_bytes. A call that throws
// once it has begun counting (or merging) leaves the counter broken: later calls throw
// std::logic_error. Not for concurrent use.
class PretokenCounter {
 public:
  explicit PretokenCounter(CountOptions options);
  ~PretokenCounter();
  PretokenCounter(const PretokenCounter&) = delete;
  PretokenCounter& operator=(const PretokenCounter&) = delete;

  // A file, decoded like Python text mode. `bytes_done` (optional) advances by the bytes of
  // decoded text counted (the file size for clean UTF-8 without "\r").
  void add_file(const std::string& path, Interrupt* interrupt = nullptr,
                std::atomic<int64_t>* bytes_done = nullptr);
  // Documents: `decoded` ones are UTF-8 text taken as is (no newline translation); the others are
  // raw bytes decoded like a file. `names` (optional, same length) name them in errors.
  void add_documents(std::span<const std::string_view> documents, bool decoded,
                     std::span<const std::string> names = {}, Interrupt* interrupt = nullptr,
                     std::atomic<int64_t>* bytes_done = nullptr);
  // The counts so far, in first-occurrence order; the counter is empty afterwards.
  PretokenCounts finish(Interrupt* interrupt = nullptr);
  // finish() without a string per pre-token (cheaper for large tables).
  FlatPretokenCounts finish_flat(Interrupt* interrupt = nullptr);
  // Breaks the counter as a failed call does: for a caller that lost finish()'s result.
  void mark_broken();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainfast::bpe
