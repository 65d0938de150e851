#include "bpe/pretokenize.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <ranges>
#include <thread>
#include <tuple>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bpe/unicode_tables.h"
#include "common/buffer.h"
#include "common/check.h"
#include "common/hash.h"
#include "common/utf8.h"

namespace trainfast::bpe {
namespace {

using unicode::CharClass;
using unicode::kLetterBoth;
using unicode::kLower;
using unicode::kMark;
using unicode::kNumber;
using unicode::kOther;
using unicode::kSpace;
using unicode::kUpper;

constexpr size_t kNone = static_cast<size_t>(-1);

// Sets of classes as bit masks.
constexpr uint32_t bit(CharClass c) { return 1u << c; }
constexpr uint32_t kLetterMask = bit(kUpper) | bit(kLower) | bit(kLetterBoth);       // \p{L}
constexpr uint32_t kOtherMask = bit(kOther) | bit(kMark);                           // [^\s\p{L}\p{N}]
constexpr uint32_t kUpperRunMask = bit(kUpper) | bit(kLetterBoth) | bit(kMark);     // o200k [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
constexpr uint32_t kLowerRunMask = bit(kLower) | bit(kLetterBoth) | bit(kMark);     // o200k [\p{Ll}\p{Lm}\p{Lo}\p{M}]
constexpr uint32_t kNumberMask = bit(kNumber);

// GPT-2/cl100k run groups: \p{L}, \p{N}, [^\s\p{L}\p{N}], \s.
constexpr uint8_t kGroupLetter = 0, kGroupNumber = 1, kGroupOther = 2, kGroupSpace = 3, kGroupNonAscii = 255;
constexpr uint8_t kGroupOfClass[unicode::kNumClasses] = {kGroupOther,  kGroupSpace,  kGroupLetter, kGroupLetter,
                                                         kGroupLetter, kGroupOther,  kGroupNumber};

struct AsciiClasses {
  uint8_t cls[128];
  uint8_t group[256];  // kGroupNonAscii for bytes >= 0x80
  AsciiClasses() {
    for (int c = 0; c < 256; ++c) {
      if (c < 128) cls[c] = unicode::char_class(static_cast<char32_t>(c));
      group[c] = c < 128 ? kGroupOfClass[cls[c]] : kGroupNonAscii;
    }
  }
};
const AsciiClasses kAscii;

struct CharInfo {
  CharClass cls;
  uint32_t len;
};

// Decodes the character at s[i] (i < n) leniently: input is UTF-8 with surrogates allowed; a
// truncated or stray byte counts as one U+FFFD-like "other" character, so scanning stays in bounds.
[[gnu::always_inline]] inline char32_t decode_at(const uint8_t* s, size_t i, size_t n, uint32_t* len) {
  const uint8_t b = s[i];
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  if (b >= 0xC0 && b < 0xE0 && i + 1 < n) {
    *len = 2;
    return (char32_t{b & 0x1Fu} << 6) | (s[i + 1] & 0x3Fu);
  }
  if (b >= 0xE0 && b < 0xF0 && i + 2 < n) {
    *len = 3;
    return (char32_t{b & 0x0Fu} << 12) | (char32_t{s[i + 1] & 0x3Fu} << 6) | (s[i + 2] & 0x3Fu);
  }
  if (b >= 0xF0 && b < 0xF8 && i + 3 < n) {
    *len = 4;
    return (char32_t{b & 0x07u} << 18) | (char32_t{s[i + 1] & 0x3Fu} << 12) |
           (char32_t{s[i + 2] & 0x3Fu} << 6) | (s[i + 3] & 0x3Fu);
  }
  *len = 1;
  return 0xFFFD;
}

[[gnu::always_inline]] inline CharInfo char_at(const uint8_t* s, size_t i, size_t n) {
  const uint8_t b = s[i];
  if (b < 0x80) return {static_cast<CharClass>(kAscii.cls[b]), 1};
  uint32_t len;
  const char32_t cp = decode_at(s, i, n, &len);
  return {unicode::char_class(cp), len};
}

inline bool in(uint32_t mask, CharClass c) { return (mask >> c) & 1u; }

// End of the maximal run of characters whose class is in `mask`, starting at i.
[[gnu::always_inline]] inline size_t run_end(const uint8_t* s, size_t i, size_t n, uint32_t mask) {
  while (i < n) {
    const uint8_t b = s[i];
    if (b < 0x80) {
      if (!in(mask, static_cast<CharClass>(kAscii.cls[b]))) break;
      ++i;
    } else {
      const CharInfo c = char_at(s, i, n);
      if (!in(mask, c.cls)) break;
      i += c.len;
    }
  }
  return i;
}

// End of a run of group `group` (kGroupLetter/Number/Other) from i: a tight loop while the run
// stays ASCII (the common case), then the general one.
constexpr uint32_t kGroupMask[3] = {bit(kUpper) | bit(kLower) | bit(kLetterBoth), bit(kNumber), bit(kOther) | bit(kMark)};

[[gnu::always_inline]] inline size_t ascii_run_end(const uint8_t* s, size_t i, size_t n, uint8_t group) {
  while (i < n && kAscii.group[s[i]] == group) ++i;
  if (i < n && s[i] >= 0x80) return run_end(s, i, n, kGroupMask[group]);
  return i;
}

// The contraction letter (one of "sdmtlvre") that `(?i:x)` matches for cp, else 0.
inline char fold_letter(char32_t cp) {
  if (cp < 0x80) {
    const char lower = static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
    switch (lower) {
      case 's': case 'd': case 'm': case 't': case 'l': case 'v': case 'r': case 'e':
        break;
      default:
        return 0;
    }
  }
  auto member = [cp](const auto& set) { return std::find(std::begin(set), std::end(set), cp) != std::end(set); };
  if (member(unicode::kFold_s)) return 's';
  if (member(unicode::kFold_d)) return 'd';
  if (member(unicode::kFold_m)) return 'm';
  if (member(unicode::kFold_t)) return 't';
  if (member(unicode::kFold_l)) return 'l';
  if (member(unicode::kFold_v)) return 'v';
  if (member(unicode::kFold_r)) return 'r';
  if (member(unicode::kFold_e)) return 'e';
  return 0;
}

// A maximal whitespace run from i: its end, the start of its last character, its length in
// characters (capped at 2) and the end of its last "\r" or "\n" (kNone when it has none).
struct SpaceRun {
  size_t end;
  size_t last_start;
  int count;
  size_t newline_end;
};

[[gnu::always_inline]] inline SpaceRun space_run(const uint8_t* s, size_t i, size_t n) {
  SpaceRun run{i, i, 0, kNone};
  while (run.end < n) {
    const CharInfo c = char_at(s, run.end, n);
    if (c.cls != kSpace) break;
    if (s[run.end] == '\r' || s[run.end] == '\n') run.newline_end = run.end + 1;
    run.last_start = run.end;
    run.end += c.len;
    if (run.count < 2) ++run.count;
  }
  return run;
}

// '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
[[gnu::always_inline]] inline size_t gpt2_next(const uint8_t* s, size_t i, size_t n) {
  const uint8_t c = s[i];
  if (c == ' ') {
    if (i + 1 < n) {
      // Every non-space character is \p{L}, \p{N} or [^\s\p{L}\p{N}]: one of the " ?X+" alternatives.
      const uint8_t d = s[i + 1];
      const uint8_t group = kAscii.group[d];
      if (group < kGroupSpace) return ascii_run_end(s, i + 2, n, group);
      if (d >= 0x80) {
        const CharInfo next = char_at(s, i + 1, n);
        if (next.cls != kSpace) return ascii_run_end(s, i + 1 + next.len, n, kGroupOfClass[next.cls]);
      }
    }
  } else if (c == '\'' && i + 1 < n) {  // contractions: ASCII lower case only
    const uint8_t c1 = s[i + 1];
    if (c1 == 's' || c1 == 'd' || c1 == 'm' || c1 == 't') return i + 2;
    if (i + 2 < n) {
      const uint8_t c2 = s[i + 2];
      if ((c1 == 'l' && c2 == 'l') || (c1 == 'v' && c2 == 'e') || (c1 == 'r' && c2 == 'e')) return i + 3;
    }
  }
  const CharInfo first = char_at(s, i, n);
  if (first.cls != kSpace) return ascii_run_end(s, i + first.len, n, kGroupOfClass[first.cls]);
  const SpaceRun run = space_run(s, i, n);
  if (run.end == n || run.count == 1) return run.end;  // \s+(?!\S) at the end, else \s+
  return run.last_start;                               // \s+(?!\S) gives back the last space
}

// ---------------------------------------------------------------------------------------------
// GPT-2 on ASCII, 64 bytes at a time: bit masks of the byte classes give every pre-token start of
// a window at once, so the scan has no per-byte branches (and few per-token ones).
//
// On ASCII (bit p = byte p of the window, X = letters | digits | other, i.e. not \s), a match
// starts at p exactly when
//   - p is X, its group differs from byte p-1's, and byte p-1 is not ' ' (" ?X+" takes a ' '), or
//   - p is \s and p-1 is not (a whitespace run starts), or
//   - p is \s and p+1 is X: `\s+(?!\S)` gives back the run's last character, which then starts
//     its own match (" ?X+" when it is ' ', else `\s+` alone),
// except for contractions: an apostrophe that starts a match (p-1 neither "other" nor ' ') and is
// followed by s|d|m|t or ll|ve|re is a match of its own, which moves the next start past it.
// The start at p depends on bytes p-4..p+1 only, so starts are final up to two bytes before the
// first non-ASCII byte (or the window's end); classify_high (below) moves that byte further.
// scan_pretokens (below) moves the windows.

struct WindowMasks {
  uint64_t letter, digit, space, blank, apostrophe, high;  // blank = ' '
  uint64_t newline;                                        // "\r" or "\n" (cl100k, o200k)
  uint64_t upper, slash;                                   // A-Z, "/" (o200k)
};

#if defined(__SSE2__)
template <Pattern P>
[[gnu::always_inline]] inline WindowMasks classify64(const uint8_t* w) {
  WindowMasks m{};
  const __m128i lower_a = _mm_set1_epi8('a' - 1), lower_z = _mm_set1_epi8('z' + 1);
  const __m128i digit_0 = _mm_set1_epi8('0' - 1), digit_9 = _mm_set1_epi8('9' + 1);
  const __m128i tab = _mm_set1_epi8(8), cr = _mm_set1_epi8(14), blank = _mm_set1_epi8(' ');
  const __m128i case_bit = _mm_set1_epi8(0x20), quote = _mm_set1_epi8('\'');
  for (int k = 0; k < 4; ++k) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * k));
    // Signed compares: bytes >= 0x80 are negative, so they fall in none of the ASCII ranges.
    const __m128i folded = _mm_or_si128(v, case_bit);
    const __m128i letter = _mm_and_si128(_mm_cmpgt_epi8(folded, lower_a), _mm_cmpgt_epi8(lower_z, folded));
    const __m128i digit = _mm_and_si128(_mm_cmpgt_epi8(v, digit_0), _mm_cmpgt_epi8(digit_9, v));
    const __m128i is_blank = _mm_cmpeq_epi8(v, blank);
    const __m128i space = _mm_or_si128(_mm_and_si128(_mm_cmpgt_epi8(v, tab), _mm_cmpgt_epi8(cr, v)), is_blank);
    const int shift = 16 * k;
    m.letter |= uint64_t(uint32_t(_mm_movemask_epi8(letter))) << shift;
    m.digit |= uint64_t(uint32_t(_mm_movemask_epi8(digit))) << shift;
    m.space |= uint64_t(uint32_t(_mm_movemask_epi8(space))) << shift;
    m.blank |= uint64_t(uint32_t(_mm_movemask_epi8(is_blank))) << shift;
    m.apostrophe |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(v, quote)))) << shift;
    m.high |= uint64_t(uint32_t(_mm_movemask_epi8(v))) << shift;
    if constexpr (P != Pattern::kGpt2) {
      const __m128i newline = _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('\n')), _mm_cmpeq_epi8(v, _mm_set1_epi8('\r')));
      m.newline |= uint64_t(uint32_t(_mm_movemask_epi8(newline))) << shift;
    }
    if constexpr (P == Pattern::kO200k) {
      const __m128i upper = _mm_and_si128(_mm_cmpgt_epi8(v, _mm_set1_epi8('A' - 1)), _mm_cmpgt_epi8(_mm_set1_epi8('Z' + 1), v));
      m.upper |= uint64_t(uint32_t(_mm_movemask_epi8(upper))) << shift;
      m.slash |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8('/'))))) << shift;
    }
  }
  return m;
}
#else
template <Pattern P>
inline WindowMasks classify64(const uint8_t* w) {
  WindowMasks m{};
  for (int p = 0; p < 64; ++p) {
    const uint8_t b = w[p];
    const uint64_t bit_p = uint64_t{1} << p;
    if (b >= 0x80) {
      m.high |= bit_p;
      continue;
    }
    const uint8_t group = kAscii.group[b];
    if (group == kGroupLetter) m.letter |= bit_p;
    if (group == kGroupNumber) m.digit |= bit_p;
    if (group == kGroupSpace) m.space |= bit_p;
    if (b == ' ') m.blank |= bit_p;
    if (b == '\'') m.apostrophe |= bit_p;
    if (P != Pattern::kGpt2 && (b == '\n' || b == '\r')) m.newline |= bit_p;
    if (P == Pattern::kO200k && b >= 'A' && b <= 'Z') m.upper |= bit_p;
    if (P == Pattern::kO200k && b == '/') m.slash |= bit_p;
  }
  return m;
}
#endif

// A window's pre-token starts (bit 0, where the scan stands, is one) and how many of its first
// bytes they are final for.
struct WindowStarts {
  uint64_t starts;
  int decided;
};

[[gnu::always_inline]] inline WindowStarts gpt2_window_starts(const uint8_t* w, const WindowMasks& m, uint64_t real,
                                                              int first_unknown, bool whole, size_t avail) {
  const uint64_t other = real & ~(m.high | m.letter | m.digit | m.space);
  const uint64_t nonspace = m.letter | m.digit | other;
  const uint64_t changed = (m.letter & ~(m.letter << 1)) | (m.digit & ~(m.digit << 1)) | (other & ~(other << 1));
  uint64_t starts = (changed & ~(m.blank << 1)) | (m.space & ~(m.space << 1)) | (m.space & (nonspace >> 1)) | 1;
  uint64_t quotes = m.apostrophe & ~(other << 1) & ~(m.blank << 1);
  while (quotes != 0) {
    const int p = __builtin_ctzll(quotes);
    quotes &= quotes - 1;
    if (p + 1 >= 64) break;
    const uint8_t c1 = w[p + 1];
    int len = 0;
    if (c1 == 's' || c1 == 'd' || c1 == 'm' || c1 == 't') {
      len = 2;
    } else if (p + 2 < 64) {
      const uint8_t c2 = w[p + 2];
      if ((c1 == 'l' && c2 == 'l') || (c1 == 'v' && c2 == 'e') || (c1 == 'r' && c2 == 'e')) len = 3;
    }
    if (len == 0) continue;
    starts &= ~(uint64_t{1} << (p + 1));
    if (p + len < 64) starts |= uint64_t{1} << (p + len);
  }
  return {starts, whole ? static_cast<int>(avail) : first_unknown - 2};
}

// Other scripts in the windows. GPT-2's rules above hold for characters of any length once every
// byte of a character carries its class (a start can then only fall on a lead byte: a continuation
// byte has its lead's group, and is neither ' ' nor \s), except that `\s+(?!\S)` gives back the
// run's last *character*, whose lead need not be the byte before the next X. So the window's
// non-ASCII characters are decoded (by decode_at over the rest of the segment, `avail` bytes from
// w) and their bytes moved into the class masks, up to the first one that the pattern's rules
// cannot take or that goes on past the window; that one stays "high", unknown, as before.
// cl100k's and o200k's rules (below) also look two bytes back past an O, and count digits by
// bytes, so they take letters only: cl100k any \p{L}, o200k \p{Lu}/\p{Lt} (as A-Z) and \p{Ll}
// (\p{Lm}, \p{Lo} and \p{M} are in both of its case runs, which its rules do not model). A letter
// byte looks only one character back or ahead in those rules, where the byte's class is its
// character's. U+017F (long s) stays unknown: `(?i:...)` matches it as the "s" of a contraction;
// so does an overlong (invalid) encoding of an ASCII letter, which the window reads as raw bytes.
template <Pattern P>
[[gnu::always_inline]] inline void classify_high(const uint8_t* w, WindowMasks& m, uint64_t real, size_t avail) {
  for (uint64_t todo = m.high & real; todo != 0;) {
    const int p = __builtin_ctzll(todo);
    uint32_t len;
    const char32_t cp = decode_at(w, static_cast<size_t>(p), avail, &len);
    if (p + len > 64) return;
    const CharClass cls = unicode::char_class(cp);
    if constexpr (P == Pattern::kGpt2) {
      if (cls == kSpace) return;
    } else {
      const bool taken = P == Pattern::kCl100k ? in(kLetterMask, cls) : cls == kUpper || cls == kLower;
      if (!taken || cp < 0x80 || cp == 0x17F) return;
    }
    const uint64_t span = ((uint64_t{1} << len) - 1) << p;
    if ((span & ~m.high) != 0) {  // invalid UTF-8 whose "character" took ASCII bytes along
      m.letter &= ~span;
      m.digit &= ~span;
      m.space &= ~span;
      m.blank &= ~span;
      m.apostrophe &= ~span;
      m.newline &= ~span;
      m.upper &= ~span;
      m.slash &= ~span;
    }
    m.high &= ~span;
    if (in(kLetterMask, cls)) m.letter |= span;
    if (cls == kNumber) m.digit |= span;
    if (P == Pattern::kO200k && cls == kUpper) m.upper |= span;
    todo &= ~span;
  }
}

// Calls emit(begin, end) for every pre-token of s[0:n), in order.
template <Pattern P, typename Emit>
[[gnu::always_inline]] inline void scan_pretokens(const uint8_t* s, size_t n, Emit&& emit);

// Up to three \p{N} from i (which is one).
inline size_t numbers_upto3(const uint8_t* s, size_t i, size_t n, uint32_t first_len) {
  size_t j = i + first_len;
  for (int k = 1; k < 3 && j < n; ++k) {
    const CharInfo c = char_at(s, j, n);
    if (c.cls != kNumber) break;
    j += c.len;
  }
  return j;
}

// '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s
[[gnu::always_inline]] inline size_t cl100k_next(const uint8_t* s, size_t i, size_t n) {
  const uint8_t c = s[i];
  if (c == '\'' && i + 1 < n) {
    uint32_t len1;
    const char l1 = fold_letter(decode_at(s, i + 1, n, &len1));
    if (l1 == 's' || l1 == 'd' || l1 == 'm' || l1 == 't') return i + 1 + len1;
    if ((l1 == 'l' || l1 == 'v' || l1 == 'r') && i + 1 + len1 < n) {
      uint32_t len2;
      const char l2 = fold_letter(decode_at(s, i + 1 + len1, n, &len2));
      if ((l1 == 'l' && l2 == 'l') || (l1 != 'l' && l2 == 'e')) return i + 1 + len1 + len2;
    }
  }
  const CharInfo first = char_at(s, i, n);
  if (in(kLetterMask, first.cls)) return ascii_run_end(s, i + first.len, n, kGroupLetter);
  if (first.cls == kNumber) return numbers_upto3(s, i, n, first.len);
  // [^\r\n\p{L}\p{N}]?+\p{L}++ with the prefix: possessive, so no other split of it is tried.
  if (c != '\r' && c != '\n' && i + first.len < n) {
    const CharInfo next = char_at(s, i + first.len, n);
    if (in(kLetterMask, next.cls)) return ascii_run_end(s, i + first.len + next.len, n, kGroupLetter);
  }
  size_t other_end = kNone;
  if (in(kOtherMask, first.cls)) {
    other_end = run_end(s, i + first.len, n, kOtherMask);
  } else if (c == ' ' && i + 1 < n) {
    const CharInfo next = char_at(s, i + 1, n);
    if (in(kOtherMask, next.cls)) other_end = run_end(s, i + 1 + next.len, n, kOtherMask);
  }
  if (other_end != kNone) {
    while (other_end < n && (s[other_end] == '\r' || s[other_end] == '\n')) ++other_end;
    return other_end;
  }
  const SpaceRun run = space_run(s, i, n);
  if (run.end == n) return n;                           // \s++$
  if (run.newline_end != kNone) return run.newline_end;  // \s*[\r\n]
  if (run.count == 2) return run.last_start;             // \s+(?!\S)
  return run.end;                                        // \s
}

// The length of `'(?i:[sdmt]|ll|ve|re)` at window byte p (an apostrophe, p < 63), or 0: ASCII
// case folding of letters; past bit 63 nothing follows when the window ends the segment (else the
// starts from p on are undecided anyway).
inline int folded_contraction_length(const uint8_t* w, int p) {
  const uint8_t c1 = w[p + 1] | 0x20, c2 = p + 2 < 64 ? w[p + 2] | 0x20 : 0;
  if (c1 == 's' || c1 == 'd' || c1 == 'm' || c1 == 't') return 2;
  if ((c1 == 'l' && c2 == 'l') || (c1 == 'v' && c2 == 'e') || (c1 == 'r' && c2 == 'e')) return 3;
  return 0;
}

// Starts in the window's digit runs: `\p{N}{1,3}` cuts a run every third digit from its start.
inline uint64_t digit_run_starts(uint64_t digit) {
  constexpr uint64_t kEveryThird = 0x9249249249249249ull;  // bits 0, 3, 6, ...
  uint64_t starts = 0;
  for (uint64_t runs = digit & ~(digit << 1); runs != 0; runs &= runs - 1) {
    const int p = __builtin_ctzll(runs);
    const uint64_t rest = ~(digit >> p);  // its lowest set bit is the run's end
    const uint64_t run = rest == 0 ? ~uint64_t{0} : (rest & -rest) - 1;
    starts |= (kEveryThird & run) << p;
  }
  return starts;
}

// The positions p of `candidates` whose run of `hspace` bits from p ends at a bit of `ends`, or
// runs past bit 63 when `past_window`.
inline uint64_t hspace_runs_ending_in(uint64_t candidates, uint64_t hspace, uint64_t ends, bool past_window) {
  uint64_t starts = 0;
  for (; candidates != 0; candidates &= candidates - 1) {
    const int p = __builtin_ctzll(candidates);
    const uint64_t rest = ~hspace >> p;  // its lowest set bit is where the run ends (if in the window)
    if (rest == 0 ? past_window : ((ends >> (p + __builtin_ctzll(rest))) & 1) != 0) starts |= uint64_t{1} << p;
  }
  return starts;
}

// `decided` (how many bytes of a window that does not end the segment have final starts), cut
// back to just past the start of a \s run that reaches the first unknown byte: the starts after
// an NL depend on how the run ends.
inline int decided_before_open_space(int decided, uint64_t space, int first_unknown) {
  if (first_unknown == 0 || ((space >> (first_unknown - 1)) & 1) == 0) return decided;
  const uint64_t before = ~space & ((first_unknown >= 64 ? uint64_t{0} : uint64_t{1} << first_unknown) - 1);
  const int run_start = before == 0 ? 0 : 64 - __builtin_clzll(before);
  return std::min(decided, run_start + 1);
}

// cl100k on ASCII (and the letters classify_high takes), a window at a time (as GPT-2 above).
// Classes: L letters, N digits, \s split into NL ("\r", "\n") and HS (the other four), O the rest.
// A match starts at p exactly when
//   - p is O and p-1 is neither O nor ' ' (a ' ' before O always starts ` ?O++[\r\n]*+`);
//   - p is L and p-1 is N or NL; or p-1 is O that does not start a match (p-2 is O or ' '), so
//     not the prefix of `[^\r\n\p{L}\p{N}]?+\p{L}++`; or p follows a contraction ('s 'd 'm 't
//     'll 've 're in any case) whose apostrophe starts a match. An HS before L always starts one;
//   - p is N and 3k digits into its run (k >= 0);
//   - p is \s and p-1 is L or N; or p is HS and p-1 is O (O++ takes only [\r\n]*+ after it); or
//     p is HS and p-1 an NL that an O run took or after which the HS run from p ends at L, N or
//     O (`\s*[\r\n]` ends there); or p is HS between an HS and L, N or O (`\s+(?!\S)` gives the
//     run's last character back). A \s run that ends the segment is one match (`\s++$`).
// Starts at p depend on bytes before p and on p+1, except after an NL, where they depend on how
// the \s run ends: starts are final below the first unknown byte less one, and up to the start
// of a \s run that reaches it (that start included).
[[gnu::noinline]] WindowStarts cl100k_window_starts(const uint8_t* w, const WindowMasks& m, uint64_t real,
                                                    int first_unknown, bool whole, size_t avail) {
  const uint64_t letter = m.letter, digit = m.digit, space = m.space, newline = m.newline;
  const uint64_t hspace = space & ~newline;
  const uint64_t other = real & ~(m.high | letter | digit | space);
  const uint64_t nonspace = letter | digit | other;
  const uint64_t taken_newlines = newline & ~(newline + (newline & (other << 1)));  // runs right after O
  uint64_t starts = (other & ~(other << 1) & ~(m.blank << 1)) |
                    (letter & (((digit | newline) << 1) | ((other << 1) & ((other | m.blank) << 2)))) |
                    (space & ((letter | digit) << 1)) | (hspace & ((other | taken_newlines) << 1)) |
                    (hspace & (hspace << 1) & (nonspace >> 1)) | 1;
  starts |= digit_run_starts(digit);
  starts |= hspace_runs_ending_in(hspace & (newline << 1) & ~(taken_newlines << 1), hspace, nonspace, false);
  for (uint64_t quotes = m.apostrophe & starts; quotes != 0; quotes &= quotes - 1) {
    const int p = __builtin_ctzll(quotes);
    if (p + 1 >= 64) break;
    const int len = folded_contraction_length(w, p);
    if (len != 0 && p + len < 64) starts |= letter & (uint64_t{1} << (p + len));
  }
  return {starts, whole ? static_cast<int>(avail) : decided_before_open_space(first_unknown - 1, space, first_unknown)};
}

// o200k [Upper]*[Lower]+ from i: kNone when it does not match. Greedy [Upper]* backtracks until
// [Lower]+ can start, so it ends after the last "both" character of the upper run unless a
// \p{Ll} follows the run.
inline size_t o200k_word_lower(const uint8_t* s, size_t i, size_t n) {
  size_t j = i;
  size_t both_end = kNone;
  while (j < n) {
    const CharInfo c = char_at(s, j, n);
    if (!in(kUpperRunMask, c.cls)) {
      if (c.cls == kLower) return run_end(s, j + c.len, n, kLowerRunMask);
      break;
    }
    j += c.len;
    if (c.cls != kUpper) both_end = j;
  }
  return both_end;
}

// o200k [Upper]+[Lower]* from i: kNone when it does not match.
inline size_t o200k_word_upper(const uint8_t* s, size_t i, size_t n) {
  const size_t j = run_end(s, i, n, kUpperRunMask);
  if (j == i) return kNone;
  return run_end(s, j, n, kLowerRunMask);
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)? after a word ending at e.
inline size_t o200k_contraction(const uint8_t* s, size_t e, size_t n) {
  if (e + 1 >= n || s[e] != '\'') return e;
  uint32_t len1;
  const char l1 = fold_letter(decode_at(s, e + 1, n, &len1));
  if (l1 == 's' || l1 == 't' || l1 == 'm' || l1 == 'd') return e + 1 + len1;
  if ((l1 == 'r' || l1 == 'v' || l1 == 'l') && e + 1 + len1 < n) {
    uint32_t len2;
    const char l2 = fold_letter(decode_at(s, e + 1 + len1, n, &len2));
    if ((l1 == 'l' && l2 == 'l') || (l1 != 'l' && l2 == 'e')) return e + 1 + len1 + len2;
  }
  return e;
}

// [^\r\n\p{L}\p{N}]?[Upper]*[Lower]+C?|[^\r\n\p{L}\p{N}]?[Upper]+[Lower]*C?|\p{N}{1,3}
// | ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+   (Upper, Lower, C as in tiktoken's o200k)
[[gnu::always_inline]] inline size_t o200k_next(const uint8_t* s, size_t i, size_t n) {
  const uint8_t c = s[i];
  const CharInfo first = char_at(s, i, n);
  const bool prefixable = c != '\r' && c != '\n' && !in(kLetterMask | kNumberMask, first.cls);
  const size_t after = i + first.len;
  size_t e;
  // Backtracking order: optional prefix taken first, then not; the first alternative, then the second.
  if (prefixable && after < n && (e = o200k_word_lower(s, after, n)) != kNone) return o200k_contraction(s, e, n);
  if ((e = o200k_word_lower(s, i, n)) != kNone) return o200k_contraction(s, e, n);
  if (prefixable && after < n && (e = o200k_word_upper(s, after, n)) != kNone) return o200k_contraction(s, e, n);
  if ((e = o200k_word_upper(s, i, n)) != kNone) return o200k_contraction(s, e, n);
  if (first.cls == kNumber) return numbers_upto3(s, i, n, first.len);
  size_t other_end = kNone;
  if (in(kOtherMask, first.cls)) {
    other_end = run_end(s, after, n, kOtherMask);
  } else if (c == ' ' && after < n) {
    const CharInfo next = char_at(s, after, n);
    if (in(kOtherMask, next.cls)) other_end = run_end(s, after + next.len, n, kOtherMask);
  }
  if (other_end != kNone) {
    while (other_end < n && (s[other_end] == '\r' || s[other_end] == '\n' || s[other_end] == '/')) ++other_end;
    return other_end;
  }
  const SpaceRun run = space_run(s, i, n);
  if (run.newline_end != kNone) return run.newline_end;  // \s*[\r\n]+
  if (run.end == n || run.count == 1) return run.end;    // \s+(?!\S) at the end, else \s+
  return run.last_start;                                 // \s+(?!\S)
}

// o200k on ASCII (and the letters classify_high takes), a window at a time (as cl100k; letters
// split into U, upper case (A-Z, \p{Lu}, \p{Lt}), and lower case). The run of "\r", "\n" and "/"
// that starts at an NL right after O is taken by the match of that O run
// (` ?[^\s\p{L}\p{N}]+[\r\n/]*`). A match starts at p exactly when
//   - p is U and p-1 is lower case (a word ends where upper case follows lower case);
//   - p is L and p-1 is N or NL; or p-1 is O, taken or not starting a match (p-2 is O or ' ', not
//     taken), so not a word's prefix; or p follows a contraction suffix (below);
//   - p is O, not taken, and p-1 is neither O nor ' ', or was taken;
//   - p is N and 3k digits into its run (k >= 0);
//   - p is \s and p-1 is L or N; or p is HS and p-1 is O or taken; or p is HS, p-1 an NL, and the
//     HS run from p ends at L, N, O or the segment's end (`\s*[\r\n]+` ended at p-1); or p is HS
//     between an HS and L, N or O (`\s+(?!\S)` gives the run's last character back).
// An apostrophe right after a letter, followed by s t m d re ve ll (any case), ends that word
// (`(?i:'s|'t|'re|'ve|'m|'ll|'d)?`), unless the letter ends such a suffix itself. The start at p
// depends on bytes before p and on p+1 and p+2, except after an NL (as for cl100k).
[[gnu::noinline]] WindowStarts o200k_window_starts(const uint8_t* w, const WindowMasks& m, uint64_t real,
                                                   int first_unknown, bool whole, size_t avail) {
  const uint64_t letter = m.letter, lower = m.letter & ~m.upper, digit = m.digit, space = m.space;
  const uint64_t newline = m.newline, hspace = space & ~newline;
  const uint64_t other = real & ~(m.high | letter | digit | space);
  const uint64_t nonspace = letter | digit | other;
  // Taken: every NL right after O, and what follows it through "\r", "\n" and "/" (filled in
  // doubling steps, since one run may hold several such NLs).
  uint64_t taken = newline & (other << 1);
  uint64_t trail = newline | m.slash;
  for (int step = 1; step < 64; step *= 2) {
    taken |= (taken << step) & trail;
    trail &= trail << step;
  }
  uint64_t starts = (other & ~taken & (~((other | m.blank) << 1) | (taken << 1))) |
                    (letter & ((m.upper & (lower << 1)) | ((digit | newline) << 1) |
                               ((other << 1) & ((taken << 1) | (((other | m.blank) << 2) & ~(taken << 2)))))) |
                    (space & ((letter | digit) << 1)) | (hspace & ((other | taken) << 1)) |
                    (hspace & (hspace << 1) & (nonspace >> 1)) | 1;
  starts |= digit_run_starts(digit);
  // Past bit 63 the run ends the segment when the window is its whole rest (else it is undecided).
  starts |= hspace_runs_ending_in(hspace & (newline << 1) & ~(taken << 1), hspace, ~newline, whole);
  int suffix_end = -1;  // where the last contraction suffix ended
  for (uint64_t quotes = m.apostrophe & (letter << 1); quotes != 0; quotes &= quotes - 1) {
    const int p = __builtin_ctzll(quotes);
    if (p + 1 >= 64) break;
    if (p == suffix_end) continue;
    const int len = folded_contraction_length(w, p);
    if (len == 0) continue;
    starts &= ~(((uint64_t{1} << len) - 1) << p);
    if (p + len < 64) starts |= letter & (uint64_t{1} << (p + len));
    suffix_end = p + len;
  }
  return {starts, whole ? static_cast<int>(avail) : decided_before_open_space(first_unknown - 2, space, first_unknown)};
}

template <Pattern P>
[[gnu::always_inline]] inline size_t next_end(const uint8_t* s, size_t i, size_t n) {
  if constexpr (P == Pattern::kGpt2) return gpt2_next(s, i, n);
  if constexpr (P == Pattern::kCl100k) return cl100k_next(s, i, n);
  if constexpr (P == Pattern::kO200k) return o200k_next(s, i, n);
}

// Calls emit(begin, end) for every pre-token of s[0:n), in order, a 64-byte window at a time: the
// window's starts are final below `decided` (the whole window when the segment ends in it, all
// ASCII); from the last final start on, the next window continues, and a pre-token that no window
// can finish goes to next_end.
template <Pattern P, typename Emit>
[[gnu::always_inline]] inline void scan_pretokens(const uint8_t* s, size_t n, Emit&& emit) {
  alignas(64) uint8_t tail[64];
  size_t i = 0;
  size_t fallback_bytes = 16;
  while (i < n) {
    const size_t avail = n - i;
    const bool last = avail <= 64;
    const uint8_t* w = s + i;
    if (last) {  // the segment ends in this window: pad with a non-ASCII byte, which stops every run
      std::memcpy(tail, s + i, avail);
      std::memset(tail + avail, 0x80, 64 - avail);
      w = tail;
    }
    WindowMasks m = classify64<P>(w);
    const uint64_t real = last && avail < 64 ? (uint64_t{1} << avail) - 1 : ~uint64_t{0};
    if ((m.high & real) != 0) classify_high<P>(w, m, real, avail);
    const uint64_t high = m.high & real;
    const bool whole = last && high == 0;
    const int first_unknown = high != 0 ? __builtin_ctzll(high) : 64;
    WindowStarts found;
    if constexpr (P == Pattern::kGpt2) {
      found = gpt2_window_starts(w, m, real, first_unknown, whole, avail);
    } else if constexpr (P == Pattern::kCl100k) {
      found = cl100k_window_starts(w, m, real, first_unknown, whole, avail);
    } else {
      found = o200k_window_starts(w, m, real, first_unknown, whole, avail);
    }
    const int decided = found.decided;
    uint64_t final_starts = decided <= 0 ? 1 : found.starts & (decided >= 64 ? ~uint64_t{0} : (uint64_t{1} << decided) - 1);
    final_starts &= final_starts - 1;  // bit 0 (i) is known
    size_t begin = i;
    while (final_starts != 0) {
      const size_t end = i + static_cast<size_t>(__builtin_ctzll(final_starts));
      final_starts &= final_starts - 1;
      emit(begin, end);
      begin = end;
    }
    if (whole) {
      emit(begin, n);
      return;
    }
    if (begin > i) {
      i = begin;
      fallback_bytes = 16;
      continue;
    }
    // No pre-token ends inside the window (a long one, or non-ASCII text): scan one by one for a
    // while, longer each time this repeats (text in other scripts rarely has ASCII windows).
    const size_t until = std::min(n, i + fallback_bytes);
    fallback_bytes = std::min<size_t>(fallback_bytes * 2, 4096);
    while (i < until) {
      const size_t end = next_end<P>(s, i, n);
      emit(i, end);
      i = end;
    }
  }
}


// Whether cutting text at byte p (0 < p < n) leaves every pre-token unchanged:
//   findall(text) == findall(text[:p]) + findall(text[p:]).
// Proof sketch. The rule needs text[p] = an ASCII \s character and text[p-1] (a character) not \s.
// (1) A pre-token of the whole text ends at p: the one holding text[p-1] is not a whitespace
//     token, and no non-whitespace alternative continues over an \s character, except
//     cl100k's `[^\s\p{L}\p{N}]++[\r\n]*+` and o200k's `[^\s\p{L}\p{N}]+[\r\n/]*`, which can
//     take a "\r"/"\n" after punctuation. So for cl100k/o200k a "\r"/"\n" at p also needs
//     text[p-1] in \p{L} or \p{N}: those characters are never inside such a punctuation token.
//     (A space prefix or o200k's [^\r\n\p{L}\p{N}] prefix belongs to the token after it.)
// (2) The scans left of p agree: every match attempt before p that looks at text[p] sees an \s
//     character there, and the same attempt on text[:p] sees the end of the string; no
//     alternative of these patterns treats the two differently when the attempt starts before
//     p-1 is passed (runs of \p{L}/\p{N}/[^\s\p{L}\p{N}]/o200k case classes stop at both;
//     contraction letters fail at both; `(?!\S)` and `$` are only reached from a whitespace
//     run, which cannot start at or before p-1 and reach p because text[p-1] is not \s).
// (3) The scans right of p agree: none of the patterns has a look-behind, and by (1) the
//     whole-text scan starts a fresh match at p, exactly as a scan of text[p:] does.
// The test suite checks the rule against the unsplit scan on random and corpus text.
template <Pattern P>
bool is_safe_split(const uint8_t* s, size_t p, size_t n) {
  if (p == 0 || p >= n) return false;
  const uint8_t b = s[p];
  if (b >= 0x80 || kAscii.cls[b] != kSpace) return false;
  size_t q = p - 1;
  while (q > 0 && p - q < 4 && (s[q] & 0xC0) == 0x80) --q;
  const CharInfo prev = char_at(s, q, p);
  if (q + prev.len != p || prev.cls == kSpace) return false;
  if (P != Pattern::kGpt2 && (b == '\r' || b == '\n')) return in(kLetterMask | kNumberMask, prev.cls);
  return true;
}

template <Pattern P>
void pretokenize_impl(const uint8_t* s, size_t n, size_t base, std::vector<size_t>& ends, Interrupt* interrupt) {
  scan_pretokens<P>(s, n, [&](size_t, size_t end) {
    ends.push_back(base + end);
    // Text without a safe cut arrives as one segment, however long.
    if (interrupt != nullptr && (ends.size() & 0xFFFF) == 0) interrupt->check();
  });
}

void pretokenize_segment(const uint8_t* s, size_t n, size_t base, Pattern pattern, std::vector<size_t>& ends,
                         Interrupt* interrupt = nullptr) {
  switch (pattern) {
    case Pattern::kGpt2: return pretokenize_impl<Pattern::kGpt2>(s, n, base, ends, interrupt);
    case Pattern::kCl100k: return pretokenize_impl<Pattern::kCl100k>(s, n, base, ends, interrupt);
    case Pattern::kO200k: return pretokenize_impl<Pattern::kO200k>(s, n, base, ends, interrupt);
  }
  TF_CHECK_ARG(false, "pattern", static_cast<int>(pattern), "must be gpt2, cl100k or o200k");
}

// ---------------------------------------------------------------------------------------------
// Counting table: open addressing (linear probing) over 32-byte slots that hold a key of up to 16
// bytes inline (longer ones: the first 8 bytes inline, all of them in an arena), so a lookup
// touches one cache line, which the scan prefetches a few pre-tokens ahead.

inline uint64_t load_upto8(const uint8_t* p, uint32_t len) {
  if (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return w;
  }
  if (len >= 4) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + len - 4, 4);
    return uint64_t{lo} | (uint64_t{hi} << (8 * (len - 4)));
  }
  if (len == 0) return 0;
  return uint64_t{p[0]} | (uint64_t{p[len / 2]} << (8 * (len / 2))) | (uint64_t{p[len - 1]} << (8 * (len - 1)));
}

// Keys of up to 16 bytes (zero padded words): every key bit reaches the high (home and tag) bits.
inline uint64_t short_hash(uint64_t w0, uint64_t w1, uint32_t len) {
  uint64_t h = (w0 ^ (uint64_t{len} << 58)) * 0x9E3779B97F4A7C15ull;
  h ^= (w1 + (h >> 29)) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  return h ^ (h >> 29);
}

// The bytes of a key of `len` <= 16 bytes in each of its two words, by table: English pre-tokens
// straddle 8 bytes unpredictably: a branch on the length mispredicted for one in six (callgrind).
struct KeyMasks {
  uint64_t word0[17];
  uint64_t word1[17];
  constexpr KeyMasks() : word0(), word1() {
    for (uint32_t len = 0; len <= 16; ++len) {
      const uint32_t in0 = std::min(len, 8u), in1 = len - in0;
      word0[len] = in0 == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * in0)) - 1;
      word1[len] = in1 == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * in1)) - 1;
    }
  }
};
constexpr KeyMasks kKeyMasks;

// Cache-line aligned: each worker's table members (written on every insert) never share a line with
// another worker's (read on every pre-token).
class alignas(128) CountTable {
 public:
  static constexpr uint32_t kInlineBytes = 16;

  struct Slot {
    uint64_t w0;     // key bytes 0..7, zero padded
    uint64_t w1;     // key bytes 8..15, zero padded (len <= 16), else the key's arena offset
    int64_t count;   // 0: empty slot
    uint64_t meta;   // (tag << 32) | len; tag = the hash's high 32 bits
    uint32_t tag() const { return static_cast<uint32_t>(meta >> 32); }
    uint32_t len() const { return static_cast<uint32_t>(meta); }
  };
  static_assert(sizeof(Slot) == 32);

  // A key with its hash, computed ahead so its slot can be prefetched.
  struct Key {
    const uint8_t* data;
    uint64_t w0, w1, meta;
  };

  static constexpr size_t kNotFound = static_cast<size_t>(-1);
  // The count of an entry merged into another table's entry of the same key.
  static constexpr int64_t kDropped = std::numeric_limits<int64_t>::min();

  // No slots until the first work item (begin_item): a counter may have more tables than work.
  CountTable() = default;

  // `readable`: bytes readable from `data` (>= len); with 16 the short words take two plain loads.
  [[gnu::always_inline]] static inline Key make_key(const uint8_t* data, uint32_t len, size_t readable) {
    Key key{data, 0, 0, 0};
    uint64_t hash;
    if (len <= kInlineBytes) {
      if (readable >= 16) {
        uint64_t a, b;
        std::memcpy(&a, data, 8);
        std::memcpy(&b, data + 8, 8);
        key.w0 = a & kKeyMasks.word0[len];
        key.w1 = b & kKeyMasks.word1[len];
      } else {
        key.w0 = load_upto8(data, std::min<uint32_t>(len, 8));
        key.w1 = len > 8 ? load_upto8(data + 8, len - 8) : 0;
      }
      hash = short_hash(key.w0, key.w1, len);
    } else {
      std::memcpy(&key.w0, data, 8);
      hash = hash_bytes(data, len);
    }
    key.meta = (hash & 0xFFFFFFFF00000000ull) | len;
    return key;
  }

  [[gnu::always_inline]] inline void prefetch(uint64_t meta) const { __builtin_prefetch(&slots_[home(meta)]); }

  // Counts one occurrence. A worker counts its work items in stream order, so its insertion order
  // is the order of first occurrences. `interrupt` is checked while the table grows.
  [[gnu::always_inline]] inline void add(const Key& key, Interrupt* interrupt) {
    const uint32_t len = static_cast<uint32_t>(key.meta);
    for (size_t idx = home(key.meta);; idx = (idx + 1) & mask_) {
      Slot& slot = slots_[idx];
      if (slot.count == 0) {
        insert(idx, key, interrupt);
        return;
      }
      if (slot.meta == key.meta && slot.w0 == key.w0 &&
          (len <= kInlineBytes ? slot.w1 == key.w1
                               : std::memcmp(arena_.data() + slot.w1 + 8, key.data + 8, len - 8) == 0)) {
        ++slot.count;
        return;
      }
    }
  }

  // The slot holding the key (meta, w0, w1) in this table, or kNotFound; `long_bytes` are the
  // key's bytes when it is longer than kInlineBytes (then w1 is unused). It reads only the key
  // fields of other keys' slots (an empty slot has meta 0: keys are never empty), so it may run
  // while other threads rewrite those keys' counts.
  size_t find(uint64_t meta, uint64_t w0, uint64_t w1, const uint8_t* long_bytes) const {
    const uint32_t len = static_cast<uint32_t>(meta);
    for (size_t idx = home(meta);; idx = (idx + 1) & mask_) {
      const Slot& mine = slots_[idx];
      if (mine.meta == 0) return kNotFound;
      if (mine.meta == meta && mine.w0 == w0 &&
          (len <= kInlineBytes ? mine.w1 == w1 : std::memcmp(arena_.data() + mine.w1, long_bytes, len) == 0)) {
        return idx;
      }
    }
  }

  // Keys inserted from now on were first seen in work item `item` (items are numbered in stream
  // order over the counter's life, and each is counted by one worker into its own table).
  void begin_item(uint64_t item) {
    if (slots_.size() == 0) reset(wanted_bits_);  // in the worker, which then touches its pages first
    if (!runs_.empty() && runs_.back().first_entry == order_.size()) {
      runs_.back().item = item;  // the previous item inserted nothing
    } else {
      runs_.push_back({item, order_.size()});
    }
  }
  // The entries inserted during one work item: [first_entry, the next run's first_entry or size()).
  struct Run {
    uint64_t item;
    size_t first_entry;
  };
  const std::vector<Run>& runs() const { return runs_; }

  size_t size() const { return order_.size(); }
  // 2^bits slots; a key's home slot is its tag's top `bits` bits.
  int bits() const { return 32 - shift_; }
  size_t capacity() const { return slots_.size(); }
  const Slot& slot(size_t idx) const { return slots_[idx]; }
  // For merging tables after counting (then a count may also be kDropped).
  int64_t& count_at(size_t idx) { return slots_[idx].count; }
  // Every entry's slot, in insertion (= first-occurrence) order.
  const uint32_t* entry_slots() const { return order_.data(); }
  // Key bytes of the entries before entry k (in insertion order).
  uint64_t key_bytes_before(size_t k) const { return key_bytes_before_[k]; }
  const Slot* slots() const { return slots_.data(); }

  // The key bytes of a slot: inline ones are read in place (the slot is little-endian bytes).
  const uint8_t* key_bytes(const Slot& slot) const {
    return slot.len() <= kInlineBytes ? reinterpret_cast<const uint8_t*>(&slot.w0) : arena_.data() + slot.w1;
  }

  // Frees everything (on the calling thread); the next work item allocates again.
  void clear() { *this = CountTable(); }

  // Sizes an empty table for about `input_bytes` of text, so it need not grow (rehash) step by
  // step from a few thousand slots: about one slot per `bytes_per_slot` (English has ~1 unique
  // pre-token per 120 bytes at 40 MB, and fewer per byte beyond), at most 2^20 slots up front.
  void reserve_for(size_t input_bytes, size_t bytes_per_slot) {
    if (!order_.empty()) return;
    const int bits = std::clamp(static_cast<int>(std::bit_width(input_bytes / bytes_per_slot)), kInitialBits, 20);
    if (slots_.size() == 0) {
      wanted_bits_ = std::max(wanted_bits_, bits);
    } else if (bits > 32 - shift_) {
      reset(bits);
    }
  }

 private:
  static constexpr int kInitialBits = 12;
  static constexpr size_t kMaxEntries = size_t{3} << 30;

  // Entries that make the table grow: 3/4 of the slots, so probes stay short.
  size_t max_entries() const { return slots_.size() / 4 * 3; }

  [[gnu::always_inline]] inline size_t home(uint64_t meta) const { return static_cast<size_t>((meta >> 32) >> shift_); }

  void reset(int bits) {
    ZeroedArray<Slot>(size_t{1} << bits).swap(slots_);
    mask_ = slots_.size() - 1;
    shift_ = 32 - bits;
    std::vector<uint32_t>().swap(order_);
    std::vector<Run>().swap(runs_);
    std::vector<uint64_t>(1, 0).swap(key_bytes_before_);
    std::vector<uint8_t>().swap(arena_);
  }

  [[gnu::noinline]] void insert(size_t idx, const Key& key, Interrupt* interrupt) {
    const uint32_t len = static_cast<uint32_t>(key.meta);
    Slot& slot = slots_[idx];
    slot.w0 = key.w0;
    slot.w1 = key.w1;
    if (len > kInlineBytes) {
      slot.w1 = arena_.size();
      arena_.insert(arena_.end(), key.data, key.data + len);
    }
    slot.count = 1;
    slot.meta = key.meta;
    order_.push_back(static_cast<uint32_t>(idx));
    key_bytes_before_.push_back(key_bytes_before_.back() + len);
    if (order_.size() >= max_entries()) grow(interrupt);
  }

  // Rehashes every entry, walking the old slots in order: home slots rise with the old slot (but
  // for a cluster that wrapped around the end), so both arrays stream; in insertion order both
  // were read and written at random. Tenths of a second for millions, so Ctrl-C is polled. A grow
  // cut short leaves the table inconsistent, which is fine: a call that throws breaks the counter.
  void grow(Interrupt* interrupt) {
    if (shift_ == 0 || order_.size() >= kMaxEntries) throw std::length_error("pre-token table is full");
    UninitializedBuffer<uint32_t> moved_to(slots_.size());  // new slot of each old slot
    ZeroedArray<Slot> old_slots(slots_.size() * 2);
    old_slots.swap(slots_);
    --shift_;
    mask_ = slots_.size() - 1;
    for (size_t old_idx = 0; old_idx < old_slots.size(); ++old_idx) {
      if (interrupt != nullptr && (old_idx & 0xFFFF) == 0xFFFF) interrupt->check();
      const Slot& old = old_slots[old_idx];
      if (old.count == 0) continue;
      size_t idx = home(old.meta);
      while (slots_[idx].count != 0) idx = (idx + 1) & mask_;
      slots_[idx] = old;
      moved_to[old_idx] = static_cast<uint32_t>(idx);
    }
    for (size_t k = 0; k < order_.size(); ++k) {
      if (interrupt != nullptr && (k & 0xFFFF) == 0xFFFF) interrupt->check();
      order_[k] = moved_to[order_[k]];
    }
  }

  // Slots in huge pages: a large table is probed at random, and with 4 KiB pages most probes
  // were TLB misses as well as cache misses. Zeroed lazily: each worker's table is cleared by the
  // worker itself as it fills, in parallel, not by the thread that sized the tables.
  ZeroedArray<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 32;                  // home = tag >> shift_; capacity 2^(32 - shift_)
  std::vector<uint32_t> order_;     // slot of each entry, in insertion order
  std::vector<Run> runs_;           // entries by work item, in stream order
  std::vector<uint64_t> key_bytes_before_ = std::vector<uint64_t>(1, 0);  // running sum of key lengths in that order
  std::vector<uint8_t> arena_;      // bytes of keys longer than kInlineBytes
  int wanted_bits_ = kInitialBits;  // the size begin_item allocates (reserve_for may raise it)
};

// Runs fn(item, worker) for item in [0, num_items) on up to num_threads threads, workers pulling
// items in order; the calling thread is worker 0 and polls `interrupt` between items, then while
// it waits for the others (fn should check it inside long items). The same loop as common's
// parallel_for_each, kept here: with that one GCC scheduled the GPT-2 scan loop differently, and
// one-thread counting of gcide measured 2-3% slower (8 paired rounds, all the same way).
void run_workers(size_t num_items, int num_threads, Interrupt* interrupt,
                 const std::function<void(size_t, int)>& fn) {
  if (num_items == 0) return;
  const int num_workers = static_cast<int>(std::min<size_t>(std::max(1, num_threads), num_items));
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto record_error = [&](std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!first_error) first_error = error;
    stop.store(true);
  };
  auto loop = [&](int worker) {
    try {
      while (!stop.load(std::memory_order_relaxed)) {
        if (worker == 0 && interrupt != nullptr) interrupt->check();
        const size_t item = next.fetch_add(1);
        if (item >= num_items) break;
        fn(item, worker);
      }
    } catch (...) {
      record_error(std::current_exception());
    }
  };
  run_on_threads(num_workers, loop, interrupt, record_error);
  if (first_error) std::rethrow_exception(first_error);
}

std::string byte_hex(uint8_t b) {
  static const char* digits = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void pretokenize(std::string_view text, Pattern pattern, std::vector<size_t>& ends, Interrupt* interrupt) {
  pretokenize_segment(reinterpret_cast<const uint8_t*>(text.data()), text.size(), 0, pattern, ends, interrupt);
}

SpecialTokenMatcher::SpecialTokenMatcher(std::vector<std::string> special_tokens) {
  for (size_t k = 0; k < special_tokens.size(); ++k) {
    if (special_tokens[k].empty()) {
      throw std::invalid_argument("special_tokens must not contain an empty string (got one at index " +
                                  std::to_string(k) + ")");
    }
  }
  // Built from the sorted tokens, breadth first: a node stands for the tokens [lo, hi) that share
  // its first `depth` bytes, and each edge's label is a slice of one token in labels_ (the tokens
  // concatenated), so memory stays near the tokens' own size.
  std::sort(special_tokens.begin(), special_tokens.end());
  special_tokens.erase(std::unique(special_tokens.begin(), special_tokens.end()), special_tokens.end());
  size_t total_bytes = 0;
  for (const std::string& token : special_tokens) total_bytes += token.size();
  if (total_bytes >= UINT32_MAX) throw std::length_error("special tokens of 4 GiB or more in all");
  std::vector<uint32_t> offsets;  // of each token in labels_
  labels_.reserve(total_bytes);
  for (const std::string& token : special_tokens) {
    offsets.push_back(static_cast<uint32_t>(labels_.size()));
    labels_ += token;
    max_length_ = std::max(max_length_, token.size());
  }
  struct Pending {
    size_t lo, hi, depth;
  };
  std::vector<Pending> pending{{0, special_tokens.size(), 0}};  // pending[k]: the tokens of nodes_[k]
  nodes_.emplace_back();
  for (size_t k = 0; k < pending.size(); ++k) {
    auto [lo, hi, depth] = pending[k];
    nodes_[k].first_edge = static_cast<uint32_t>(edges_.size());
    if (lo < hi && special_tokens[lo].size() == depth) {  // sorted: the token ending here comes first
      nodes_[k].is_token = true;
      ++lo;
    }
    while (lo < hi) {  // one edge per next byte; the rest of [lo, hi) is longer than depth
      const auto byte = static_cast<uint8_t>(special_tokens[lo][depth]);
      const size_t end = static_cast<size_t>(
          std::partition_point(special_tokens.begin() + static_cast<std::ptrdiff_t>(lo),
                               special_tokens.begin() + static_cast<std::ptrdiff_t>(hi),
                               [&](const std::string& token) { return static_cast<uint8_t>(token[depth]) <= byte; }) -
          special_tokens.begin());
      // Sorted, so the group's common prefix is that of its first and last tokens.
      const std::string& first = special_tokens[lo];
      const std::string& last = special_tokens[end - 1];
      size_t shared = depth + 1;
      while (shared < first.size() && shared < last.size() && first[shared] == last[shared]) ++shared;
      edge_bytes_.push_back(byte);
      edges_.push_back({offsets[lo] + static_cast<uint32_t>(depth), static_cast<uint32_t>(shared - depth),
                        static_cast<uint32_t>(nodes_.size())});
      nodes_.emplace_back();
      pending.push_back({lo, end, shared});
      ++nodes_[k].num_edges;
      lo = end;
    }
  }
  for (uint32_t e = 0; e < nodes_[0].num_edges; ++e) {
    root_edge_[edge_bytes_[e]] = e + 1;
    ++num_first_bytes_;
    only_first_byte_ = edge_bytes_[e];
  }
  if (max_length_ > kLongToken) build_reverse_automaton(special_tokens);
}

// A plain byte trie of the reversed tokens, built breadth first from them sorted (each node's
// tokens are a contiguous range, its children's edges sorted by byte), with failure links: a
// node's is the longest proper suffix of its bytes that is also a node. Breadth first, a node's
// failure target and that target's own links are complete before the node is reached.
void SpecialTokenMatcher::build_reverse_automaton(const std::vector<std::string>& sorted_tokens) {
  std::vector<std::string> reversed = sorted_tokens;
  for (std::string& token : reversed) std::reverse(token.begin(), token.end());
  std::sort(reversed.begin(), reversed.end());
  ReverseAutomaton& a = reverse_;
  struct Pending {
    size_t lo, hi;
    uint32_t depth;
  };
  std::vector<Pending> pending{{0, reversed.size(), 0}};
  a.fail.push_back(0);
  for (size_t k = 0; k < pending.size(); ++k) {
    auto [lo, hi, depth] = pending[k];
    const auto node = static_cast<uint32_t>(k);
    const bool is_token = lo < hi && reversed[lo].size() == depth;
    if (is_token) ++lo;
    a.longest.push_back(is_token ? depth : (node == 0 ? 0 : a.longest[a.fail[node]]));
    a.first_edge.push_back(static_cast<uint32_t>(a.edge_byte.size()));
    a.num_edges.push_back(0);
    while (lo < hi) {
      const auto byte = static_cast<uint8_t>(reversed[lo][depth]);
      size_t end = lo + 1;
      while (end < hi && static_cast<uint8_t>(reversed[end][depth]) == byte) ++end;
      const auto child = static_cast<uint32_t>(pending.size());
      a.fail.push_back(node == 0 ? 0 : a.step(a.fail[node], byte));
      a.edge_byte.push_back(byte);
      a.edge_node.push_back(child);
      ++a.num_edges[node];
      if (node == 0) a.root_next[byte] = child;
      pending.push_back({lo, end, depth + 1});
      lo = end;
    }
  }
}

uint32_t SpecialTokenMatcher::ReverseAutomaton::child(uint32_t node, uint8_t byte) const {
  const uint8_t* const begin = edge_byte.data() + first_edge[node];
  const uint8_t* const end = begin + num_edges[node];
  const uint8_t* const it = num_edges[node] <= 8 ? std::find(begin, end, byte) : std::lower_bound(begin, end, byte);
  return it != end && *it == byte ? edge_node[first_edge[node] + static_cast<size_t>(it - begin)] : 0;
}

uint32_t SpecialTokenMatcher::ReverseAutomaton::step(uint32_t state, uint8_t byte) const {
  while (state != 0) {
    const uint32_t next = child(state, byte);
    if (next != 0) return next;
    state = fail[state];
  }
  return root_next[byte];
}

template <typename Visit>
bool SpecialTokenMatcher::visit_longest(const uint8_t* s, size_t n, size_t a, size_t b, Visit visit,
                                        Interrupt* interrupt) const {
  // A token starting before b ends by b - 1 + max_length_: reading from there, every state below
  // b has seen all the bytes its tokens could use.
  const size_t from = std::min(n, b - 1 + max_length_);
  uint32_t state = 0;
  for (size_t i = from; i-- > a;) {
    if (interrupt != nullptr && (i & 0xFFFF) == 0) interrupt->check();
    state = reverse_.step(state, s[i]);
    if (i < b && visit(i, reverse_.longest[state])) return true;
  }
  return false;
}

const SpecialTokenMatcher::Edge* SpecialTokenMatcher::edge(uint32_t node, uint8_t byte) const {
  if (node == 0) return root_edge_[byte] == 0 ? nullptr : &edges_[root_edge_[byte] - 1];
  const Node& from = nodes_[node];
  const uint8_t* const begin = edge_bytes_.data() + from.first_edge;
  const uint8_t* const end = begin + from.num_edges;
  const uint8_t* const it = from.num_edges <= 8 ? std::find(begin, end, byte) : std::lower_bound(begin, end, byte);
  return it != end && *it == byte ? &edges_[from.first_edge + static_cast<size_t>(it - begin)] : nullptr;
}

template <typename OnToken>
bool SpecialTokenMatcher::walk(const uint8_t* s, size_t start, size_t n, OnToken on_token, uint64_t* compared) const {
  uint32_t node = 0;
  for (size_t j = start; j < n;) {
    const Edge* next = edge(node, s[j]);
    if (next == nullptr || next->label_length > n - j) return false;
    // A long label in 64-byte steps, so that a near miss is charged about what it cost.
    const char* const label = labels_.data() + next->label_begin;
    for (size_t k = 0; k < next->label_length; k += 64) {
      const size_t step = std::min<size_t>(64, next->label_length - k);
      if (compared != nullptr) *compared += step;
      if (std::memcmp(s + j + k, label + k, step) != 0) return false;
    }
    j += next->label_length;
    node = next->node;
    if (nodes_[node].is_token && on_token(j)) return true;
  }
  return false;
}

size_t SpecialTokenMatcher::longest_at(const uint8_t* s, size_t i, size_t n, uint64_t* compared) const {
  size_t longest = 0;
  walk(s, i, n, [&](size_t end) {
    longest = end - i;
    return false;
  }, compared);
  return longest;
}

size_t SpecialTokenMatcher::next_candidate(const uint8_t* s, size_t i, size_t n) const {
  if (i >= n) return n;
  if (num_first_bytes_ == 1) {
    const void* hit = std::memchr(s + i, only_first_byte_, n - i);
    return hit == nullptr ? n : static_cast<size_t>(static_cast<const uint8_t*>(hit) - s);
  }
  while (i < n && root_edge_[s[i]] == 0) ++i;
  return i;
}

namespace {
std::atomic<uint64_t> walk_slack{65536};
}  // namespace

uint64_t special_token_walk_slack() { return walk_slack.load(std::memory_order_relaxed); }
void set_special_token_walk_slack(uint64_t bytes) { walk_slack.store(bytes, std::memory_order_relaxed); }

namespace {
// The rule that hands a search over to the automaton: its walks compared more than 4 bytes per
// byte of the `span` of text they covered, beyond `slack`.
bool walks_over_budget(uint64_t compared, uint64_t span, uint64_t slack) {
  return compared > slack && compared - slack > 4 * span;
}
}  // namespace

std::pair<size_t, size_t> SpecialTokenMatcher::find(std::string_view text, size_t from, Interrupt* interrupt) const {
  const size_t n = text.size();
  if (empty()) return {n, 0};
  if (!reverse_.empty()) return SpecialTokenFinder(*this, text).find(from, interrupt);
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  uint64_t num_walks = 0;
  for (size_t i = next_candidate(s, from, n); i < n; i = next_candidate(s, i + 1, n)) {
    if (interrupt != nullptr && (++num_walks & 0xFFF) == 0) interrupt->check();
    const size_t longest = longest_at(s, i, n);
    if (longest > 0) return {i, longest};
  }
  return {n, 0};
}

std::pair<size_t, size_t> SpecialTokenMatcher::straddling(std::string_view text, size_t p) const {
  if (empty() || p == 0 || p >= text.size()) return {p, p};
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  // An occurrence covering p - 1 and p starts in [p - max_length_ + 1, p - 1] and ends past p.
  const size_t lo = p + 1 > max_length_ ? p + 1 - max_length_ : 0;
  size_t first_start = p, last_end = p;
  auto take = [&](size_t start, size_t end) {
    if (end > p) {
      first_start = std::min(first_start, start);
      last_end = std::max(last_end, end);
    }
  };
  // Walks from each possible start, unless they compare more than a few times the reach (text
  // full of near misses of a long token): then one automaton pass over twice the reach.
  const uint64_t slack = special_token_walk_slack();
  uint64_t compared = 0;
  for (size_t start = next_candidate(s, lo, p); start < p; start = next_candidate(s, start + 1, p)) {
    walk(s, start, n, [&](size_t end) {
      take(start, end);
      return false;
    }, &compared);
    if (!reverse_.empty() && walks_over_budget(compared, p - lo, slack)) {
      first_start = last_end = p;
      visit_longest(s, n, lo, p, [&](size_t i, uint32_t length) {
        take(i, i + length);
        return false;
      }, nullptr);
      break;
    }
  }
  return {first_start, last_end};
}

std::pair<size_t, size_t> SpecialTokenFinder::find(size_t from, Interrupt* interrupt) {
  const size_t n = text_.size();
  const SpecialTokenMatcher& m = matcher_;
  if (m.reverse_.empty()) return m.find(text_, from, interrupt);
  const auto* s = reinterpret_cast<const uint8_t*>(text_.data());
  // Stretches at least twice the lookahead, so reading it costs at most half as much again.
  const size_t stretch = std::max<size_t>(size_t{1} << 16, 2 * m.max_length_);
  if (from < walks_from_) walks_from_ = from, compared_ = 0;
  const uint64_t slack = special_token_walk_slack();
  uint64_t num_walks = 0;
  while (from < n) {
    if (from >= begin_ && from < begin_ + longest_.size()) {
      for (size_t i = from - begin_; i < longest_.size(); ++i) {
        if (longest_[i] != 0) return {begin_ + i, longest_[i]};
      }
      from = begin_ + longest_.size();
      walks_from_ = from;
      compared_ = 0;
      continue;
    }
    const size_t i = m.next_candidate(s, from, n);
    if (i >= n) break;
    // Walks compare a few bytes per byte of text, or the stretch's automaton pass (about 1.5
    // bytes read per byte) takes over from here: linear time either way.
    if (walks_over_budget(compared_, i - walks_from_, slack)) {
      begin_ = i;
      longest_.assign(std::min(stretch, n - i), 0);
      m.visit_longest(s, n, begin_, begin_ + longest_.size(), [&](size_t k, uint32_t length) {
        longest_[k - begin_] = length;
        return false;
      }, interrupt);
      from = i;
      continue;
    }
    if (interrupt != nullptr && (++num_walks & 0xFFF) == 0) interrupt->check();
    const size_t longest = m.longest_at(s, i, n, &compared_);
    if (longest > 0) return {i, longest};
    from = i + 1;
  }
  return {n, 0};
}

size_t SpecialTokenCover::covered_until(size_t p, Interrupt* interrupt) {
  if (matcher_.empty() || p == 0 || p >= n_) return p;
  // Only occurrences starting in [p - max_length + 1, p) can reach past p.
  const size_t lo = p + 1 > matcher_.max_length() ? p + 1 - matcher_.max_length() : 0;
  if (scanned_ < lo) {
    scanned_ = lo;
    if (next_start_ != SIZE_MAX && next_start_ < lo) next_start_ = SIZE_MAX;
  }
  while (true) {
    if (next_start_ == SIZE_MAX) {
      if (scanned_ >= p) break;
      std::tie(next_start_, next_length_) = finder_.find(scanned_, interrupt);  // {n, 0}: none left
    }
    if (next_start_ >= p) break;
    max_end_ = std::max(max_end_, next_start_ + next_length_);
    scanned_ = next_start_ + 1;
    next_start_ = SIZE_MAX;
  }
  return max_end_ > p ? max_end_ : p;
}

bool is_safe_cut(Pattern pattern, const uint8_t* s, size_t p, size_t n) {
  switch (pattern) {
    case Pattern::kGpt2: return is_safe_split<Pattern::kGpt2>(s, p, n);
    case Pattern::kCl100k: return is_safe_split<Pattern::kCl100k>(s, p, n);
    case Pattern::kO200k: return is_safe_split<Pattern::kO200k>(s, p, n);
  }
  return false;
}

std::vector<Piece> split_and_pretokenize(std::string_view text, Pattern pattern, const SpecialTokenMatcher& specials,
                                         Interrupt* interrupt) {
  constexpr size_t kPollBytes = size_t{1} << 22;
  std::vector<Piece> pieces;
  std::vector<size_t> ends;
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  SpecialTokenFinder finder(specials, text);
  size_t i = 0;
  while (i <= text.size()) {
    const auto [special_start, special_len] = finder.find(i, interrupt);
    // A long segment goes in blocks cut at safe points (same pre-tokens), polling Ctrl-C between.
    for (size_t begin = i; begin < special_start;) {
      const size_t n = special_start - begin;
      size_t p = n;
      if (n > 2 * kPollBytes) {
        p = kPollBytes;
        while (p < n && !is_safe_cut(pattern, s + begin, p, n)) {
          ++p;
          if (interrupt != nullptr && (p & 0xFFFFF) == 0) interrupt->check();
        }
      }
      ends.clear();
      pretokenize_segment(s + begin, p, begin, pattern, ends, interrupt);
      size_t piece_begin = begin;
      for (size_t end : ends) {
        pieces.push_back({piece_begin, end, false});
        piece_begin = end;
      }
      begin += p;
      if (interrupt != nullptr) interrupt->check();
    }
    if (special_len == 0) break;
    pieces.push_back({special_start, special_start + special_len, true});
    i = special_start + special_len;
  }
  return pieces;
}

size_t TextDecoder::decode(const uint8_t* raw, size_t n, bool final, int64_t base_offset,
                           const std::string& name, std::string& out) {
  out.reserve(out.size() + n);
  auto invalid = [&](size_t i, size_t len, const char* reason) {
    if (errors_ == Utf8Errors::kStrict) {
      throw DecodeError(name + ": invalid UTF-8 at byte offset " + std::to_string(base_offset + static_cast<int64_t>(i)) +
                            ": 'utf-8' codec can't decode byte " + byte_hex(raw[i]) + ": " + reason +
                            " (pass errors='replace' or errors='ignore' to decode anyway)");
    }
    if (errors_ == Utf8Errors::kReplace) {
      out.append("\xEF\xBF\xBD");
      skip_lf_ = false;
    }
    return i + len;
  };
  size_t i = 0;
  while (i < n) {
    const uint8_t b = raw[i];
    if (b < 0x80) {
      if (b == '\r') {  // universal newlines: "\r" and "\r\n" -> "\n"
        out.push_back('\n');
        skip_lf_ = true;
        ++i;
        continue;
      }
      if (b == '\n' && skip_lf_) {
        skip_lf_ = false;
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j + 8 <= n) {  // ASCII without "\r", eight bytes at a time
        uint64_t w;
        std::memcpy(&w, raw + j, 8);
        if ((w & 0x8080808080808080ull) != 0 || has_zero_byte(w ^ 0x0D0D0D0D0D0D0D0Dull)) break;
        j += 8;
      }
      while (j < n && raw[j] < 0x80 && raw[j] != '\r') ++j;
      out.append(reinterpret_cast<const char*>(raw + i), j - i);
      skip_lf_ = false;
      i = j;
      continue;
    }
    // Well-formed sequences (Unicode Table 3-7); an ill-formed one is replaced by maximal
    // subparts, as Python's decoder does.
    int need;
    uint8_t lo, hi;
    if (!utf8_lead(b, &need, &lo, &hi)) {
      i = invalid(i, 1, "invalid start byte");
      continue;
    }
    size_t k = 1;
    for (; k <= static_cast<size_t>(need); ++k) {
      if (i + k >= n) break;
      const uint8_t cb = raw[i + k];
      if (cb < (k == 1 ? lo : 0x80) || cb > (k == 1 ? hi : 0xBF)) break;
    }
    if (k > static_cast<size_t>(need)) {
      out.append(reinterpret_cast<const char*>(raw + i), need + 1);
      skip_lf_ = false;
      i += need + 1;
    } else if (i + k >= n) {
      if (!final) return i;  // unfinished: wait for more bytes
      i = invalid(i, k, "unexpected end of data");
    } else {
      i = invalid(i, k, "invalid continuation byte");
    }
  }
  return n;
}

// ---------------------------------------------------------------------------------------------

namespace {
bool is_clean_utf8(const uint8_t* s, size_t n);

// Drops the whole pages of [data, data + size) from a read-only file mapping once that block is
// counted (it is not read again): without this the whole file stayed resident until the end.
void release_mapped(const uint8_t* data, size_t size) {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) & ~(page - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}
}  // namespace

struct PretokenCounter::Impl {
  CountOptions options;
  SpecialTokenMatcher specials;
  std::vector<CountTable> tables;  // one per worker
  uint64_t num_items = 0;          // work items counted so far: numbers them in stream order
  bool broken = false;             // a call failed part way: the tables may hold partial counts

  // Marks the counter broken if the scope exits by an exception: it would otherwise go on from
  // half-added counts, reused item numbers or half-merged tables.
  class BreakOnThrow {
   public:
    explicit BreakOnThrow(Impl& impl) : impl_(impl) {
      if (impl_.broken) {
        throw std::logic_error("this pre-token counter failed in an earlier call and holds partial counts; use a new one");
      }
    }
    ~BreakOnThrow() {
      if (std::uncaught_exceptions() > num_uncaught_) impl_.broken = true;
    }
    BreakOnThrow(const BreakOnThrow&) = delete;
    BreakOnThrow& operator=(const BreakOnThrow&) = delete;

   private:
    Impl& impl_;
    int num_uncaught_ = std::uncaught_exceptions();
  };

  explicit Impl(CountOptions opts) : options(std::move(opts)), specials(options.special_tokens) {
    TF_CHECK_ARG(options.num_threads >= 1, "num_threads", options.num_threads, "must be >= 1");
    // One count table per thread: an absurd count would allocate tables until memory runs out.
    TF_CHECK_ARG(options.num_threads <= 4096, "num_threads", options.num_threads, "must be <= 4096");
    TF_CHECK_ARG(options.chunk_bytes >= 1, "chunk_bytes", options.chunk_bytes, "must be >= 1");
    TF_CHECK_ARG(options.block_bytes >= 16, "block_bytes", options.block_bytes, "must be >= 16");
    const int p = static_cast<int>(options.pattern);
    TF_CHECK_ARG(p >= 0 && p <= 2, "pattern", p, "must be gpt2, cl100k or o200k");
    tables.resize(options.num_threads);
  }

  // Each worker sees its share of the text, whose unique keys grow sublinearly with it: two tables
  // are sized for the whole input (half of gcide holds ~3/4 of its keys), more for twice their
  // share, so the up-front memory stays about that of two tables for any thread count. A single
  // table gets room for text in other scripts (a new key per 83 bytes of multilingual.txt), which
  // would cost more tables more than it saves: the merge walks all their slots.
  void reserve_tables(size_t input_bytes) {
    if (tables.size() == 1) {
      tables[0].reserve_for(input_bytes, 64);
      return;
    }
    const size_t share = tables.size() == 2 ? input_bytes : input_bytes / tables.size() * 2;
    for (CountTable& table : tables) table.reserve_for(share, 128);
  }

  struct Chunk {
    const uint8_t* data;
    size_t size;
  };

  // The first safe cut of s[0:n) in [p, limit) (the pattern's rule, and no special token covers
  // it), or limit when there is none. An occurrence of a special token over the point is skipped
  // whole (no point inside it is safe): byte by byte, a long token's reach was read at each byte.
  // `cover` is over s[0:n), asked at increasing points.
  size_t next_safe_split(const uint8_t* s, size_t p, size_t limit, size_t n, SpecialTokenCover& cover,
                         Interrupt* interrupt) const {
    for (uint64_t steps = 1; p < limit; ++steps) {
      if (interrupt != nullptr && (steps & 0xFFFFF) == 0) interrupt->check();  // text without a safe cut
      if (!is_safe_cut(options.pattern, s, p, n)) {
        ++p;
        continue;
      }
      const size_t past = cover.covered_until(p, interrupt);
      if (past == p) return p;
      p = past;
    }
    return limit;
  }

  // p when cutting the raw file bytes s[0:n) at p (0 < p < n) is safe and also a safe cut of the
  // decoded text, whatever the errors mode; else the next point worth trying. Besides
  // next_safe_split's rules, the character before p is valid UTF-8 (so it decodes to itself, and
  // no invalid sequence reaches p), and with special tokens the bytes around p that an occurrence
  // covering p-1 and p could use are clean (decode to themselves).
  size_t raw_safe_split_from(const uint8_t* s, size_t p, size_t n, SpecialTokenCover& cover) const {
    if (s[p] >= 0x80) return p + 1;
    size_t q = p - 1;
    while (q > 0 && p - q < 4 && (s[q] & 0xC0) == 0x80) --q;
    if (s[q] >= 0x80 && !is_clean_utf8(s + q, p - q)) return p + 1;
    // The pattern's rule first: it is cheap, and it fails all through text with no safe cut, where
    // checking a long special token's window at every byte took seconds per MB.
    if (!is_safe_cut(options.pattern, s, p, n)) return p + 1;
    if (!specials.empty()) {
      const size_t reach = specials.max_length();
      size_t lo = p > reach ? p - reach : 0;
      while (lo > 0 && (s[lo] & 0xC0) == 0x80) --lo;
      size_t hi = std::min(n, p + reach);
      while (hi < n && (s[hi] & 0xC0) == 0x80) ++hi;
      // Past an unclean window by half the reach: some points skipped may have been safe, which
      // only lengthens the block, while retrying the next point read the window again per byte.
      if (!is_clean_utf8(s + lo, hi - lo)) return p + std::max<size_t>(1, reach / 2);
    }
    // Inside an occurrence no point is safe: past its end is the next one to try.
    return cover.covered_until(p);
  }

  // Decodes and counts one block of raw file bytes that starts and ends at raw-safe cuts.
  void count_raw_block(const uint8_t* s, size_t n, int64_t raw_offset, const std::string& name,
                       std::string& buffer, Interrupt* interrupt, std::atomic<int64_t>* bytes_done) {
    // Pieces cut at character starts and never between "\r" and "\n", checked in parallel.
    const size_t num_pieces = static_cast<size_t>(options.num_threads) * 4;
    std::vector<size_t> cuts{0};
    for (size_t k = 1; k < num_pieces; ++k) {
      size_t c = std::max(cuts.back(), n / num_pieces * k);
      while (c < n && ((s[c] & 0xC0) == 0x80 || (c > 0 && s[c - 1] == '\r'))) ++c;
      cuts.push_back(c);
    }
    cuts.push_back(n);
    std::vector<uint64_t> num_cr(num_pieces, 0), num_crlf(num_pieces, 0);
    std::vector<uint8_t> valid(num_pieces, 0);
    run_workers(num_pieces, options.num_threads, interrupt, [&](size_t k, int) {
      valid[k] = scan_utf8(s + cuts[k], cuts[k + 1] - cuts[k], &num_cr[k], &num_crlf[k]);
    });
    const bool all_valid = std::all_of(valid.begin(), valid.end(), [](uint8_t v) { return v != 0; });
    const uint64_t total_cr = std::accumulate(num_cr.begin(), num_cr.end(), uint64_t{0});
    const uint8_t* text = s;
    size_t text_size = n;
    if (!all_valid) {
      buffer.clear();
      TextDecoder decoder(options.errors);
      decoder.decode(s, n, true, raw_offset, name, buffer);
      text = reinterpret_cast<const uint8_t*>(buffer.data());
      text_size = buffer.size();
    } else if (total_cr > 0) {
      // Universal newlines, each piece into its place: "\r\n" -> "\n", lone "\r" -> "\n".
      std::vector<size_t> out_starts(num_pieces + 1, 0);
      for (size_t k = 0; k < num_pieces; ++k) {
        out_starts[k + 1] = out_starts[k] + (cuts[k + 1] - cuts[k]) - num_crlf[k];
      }
      buffer.resize(out_starts[num_pieces]);
      auto* out = reinterpret_cast<uint8_t*>(buffer.data());
      run_workers(num_pieces, options.num_threads, interrupt, [&](size_t k, int) {
        uint8_t* dst = out + out_starts[k];
        for (size_t i = cuts[k]; i < cuts[k + 1]; ++i) {
          if (s[i] != '\r') {
            *dst++ = s[i];
            continue;
          }
          *dst++ = '\n';
          if (i + 1 < cuts[k + 1] && s[i + 1] == '\n') ++i;
        }
      });
      text = out;
      text_size = buffer.size();
    }
    if (text != s) release_mapped(s, n);  // decoded into the buffer
    std::vector<Chunk> chunks;
    cut_all(text, text_size, chunks, 0, interrupt);
    // Counted in place: the pages are dropped as counting moves on, the rest at the end.
    count_chunks(chunks, interrupt, bytes_done, text == s);
    if (text == s) release_mapped(s, n);
  }

  // Cuts text[0:n) into chunks of about chunk_bytes at safe points before `limit`; returns the
  // end of the last chunk cut (the rest is left for the caller). Points before `searched` are
  // known not to be safe cuts (a caller rescanning a growing text would otherwise go quadratic).
  size_t cut(const uint8_t* s, size_t n, size_t limit, std::vector<Chunk>& chunks, size_t searched = 0,
             Interrupt* interrupt = nullptr) const {
    size_t start = 0;
    SpecialTokenCover cover(specials, std::string_view(reinterpret_cast<const char*>(s), n));
    while (start + options.chunk_bytes < limit) {
      const size_t p = next_safe_split(s, std::max(start + options.chunk_bytes, searched), limit, n, cover, interrupt);
      if (p >= limit) break;
      chunks.push_back({s + start, p - start});
      start = p;
    }
    return start;
  }

  // Counts the pre-tokens of s[0:n) into `table` through a ring of pending pre-tokens: each one's
  // slot is prefetched kAhead pre-tokens before it is counted, which hides most cache misses of a
  // large table. 32: with 16, English (short pre-tokens) counted 3-5% slower on one thread, and 64
  // measured the same as 32.
  template <Pattern P>
  void count_segment(const uint8_t* s, size_t n, CountTable& table, Interrupt* interrupt) const {
    constexpr unsigned kAhead = 32;
    CountTable::Key keys[kAhead];
    uint64_t num_pending = 0;
    scan_pretokens<P>(s, n, [&](size_t begin, size_t end) {
      if (end - begin > 0xFFFFFFFFull) throw std::length_error("a pre-token is longer than 4 GiB");
      // A chunk is long only in text without a safe cut, but then it is all of it.
      if (interrupt != nullptr && (num_pending & 0xFFFF) == 0xFFFF) interrupt->check();
      const unsigned k = num_pending % kAhead;
      if (num_pending >= kAhead) table.add(keys[k], interrupt);
      keys[k] = CountTable::make_key(s + begin, static_cast<uint32_t>(end - begin), n - begin);
      table.prefetch(keys[k].meta);
      ++num_pending;
    });
    for (uint64_t j = num_pending > kAhead ? num_pending - kAhead : 0; j < num_pending; ++j) {
      table.add(keys[j % kAhead], interrupt);
    }
  }

  template <Pattern P>
  void count_chunk_impl(const Chunk& chunk, CountTable& table, Interrupt* interrupt) const {
    if (specials.empty()) return count_segment<P>(chunk.data, chunk.size, table, interrupt);
    SpecialTokenFinder finder(specials, std::string_view(reinterpret_cast<const char*>(chunk.data), chunk.size));
    size_t i = 0;
    while (i < chunk.size) {
      const auto [start, len] = finder.find(i, interrupt);
      count_segment<P>(chunk.data + i, start - i, table, interrupt);
      if (len == 0) break;
      i = start + len;
    }
  }

  void count_chunk(const Chunk& chunk, CountTable& table, Interrupt* interrupt) const {
    switch (options.pattern) {
      case Pattern::kGpt2: return count_chunk_impl<Pattern::kGpt2>(chunk, table, interrupt);
      case Pattern::kCl100k: return count_chunk_impl<Pattern::kCl100k>(chunk, table, interrupt);
      case Pattern::kO200k: return count_chunk_impl<Pattern::kO200k>(chunk, table, interrupt);
    }
  }

  // Drops the pages of a file block's chunks (which tile it) as the counted prefix of its work
  // items grows, at least kStepBytes at a time: each madvise makes every core that runs a worker
  // flush its TLB (an interrupt, costly in a VM), and one per chunk made two threads count gcide
  // about 5% slower on the 2-vCPU dev VM. The caller drops the whole block at the end.
  class CountedPrefixRelease {
   public:
    static constexpr size_t kStepBytes = size_t{4} << 20;

    CountedPrefixRelease(const std::vector<Chunk>& chunks, const std::vector<size_t>& item_starts)
        : chunks_(chunks), item_starts_(item_starts), done_(item_starts.size() - 1, 0),
          from_(chunks.empty() ? nullptr : chunks.front().data) {}

    void item_done(size_t item) {
      const uint8_t* begin = nullptr;
      size_t size = 0;
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        done_[item] = 1;
        while (next_item_ < done_.size() && done_[next_item_] != 0) ++next_item_;
        if (next_item_ == done_.size()) return;
        const uint8_t* prefix_end = chunks_[item_starts_[next_item_]].data;
        if (static_cast<size_t>(prefix_end - from_) < kStepBytes) return;
        begin = from_;
        size = static_cast<size_t>(prefix_end - from_);
        from_ = prefix_end;
      }
      release_mapped(begin, size);
    }

   private:
    const std::vector<Chunk>& chunks_;
    const std::vector<size_t>& item_starts_;
    std::mutex mutex_;
    std::vector<uint8_t> done_;
    size_t next_item_ = 0;    // the first item not counted yet
    const uint8_t* from_;     // where the pages not dropped yet begin
  };

  // Counts chunks in parallel, each worker into its own table (threads never share a cache line
  // while counting); consecutive small chunks are grouped into work items, pulled in order.
  // `release`: the chunks tile a block of a file mapping, whose pages are dropped once counted.
  void count_chunks(const std::vector<Chunk>& chunks, Interrupt* interrupt, std::atomic<int64_t>* bytes_done,
                    bool release = false) {
    std::vector<size_t> item_starts;
    size_t bytes = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (item_starts.empty() || bytes >= options.chunk_bytes) {
        item_starts.push_back(k);
        bytes = 0;
      }
      bytes += chunks[k].size;
    }
    item_starts.push_back(chunks.size());
    const size_t num_new_items = item_starts.size() - 1;
    std::optional<CountedPrefixRelease> released;
    if (release) released.emplace(chunks, item_starts);
    run_workers(num_new_items, options.num_threads, interrupt, [&](size_t item, int worker) {
      tables[worker].begin_item(num_items + item);
      int64_t item_bytes = 0;
      for (size_t k = item_starts[item]; k < item_starts[item + 1]; ++k) {
        count_chunk(chunks[k], tables[worker], interrupt);
        item_bytes += static_cast<int64_t>(chunks[k].size);
      }
      if (released) released->item_done(item);
      if (bytes_done != nullptr) bytes_done->fetch_add(item_bytes, std::memory_order_relaxed);
    });
    num_items += num_new_items;
  }

  // Cuts all of text[0:n) into chunks, the rest after the last safe cut being the last chunk.
  void cut_all(const uint8_t* s, size_t n, std::vector<Chunk>& chunks, size_t searched = 0,
               Interrupt* interrupt = nullptr) const {
    const size_t done = cut(s, n, n, chunks, searched, interrupt);
    if (done < n) chunks.push_back({s + done, n - done});
  }

  // Cuts one whole document of decoded text into chunks (a short one stays whole).
  void cut_document(const uint8_t* s, size_t n, std::vector<Chunk>& chunks, Interrupt* interrupt) const {
    if (n > 2 * options.chunk_bytes) {
      cut_all(s, n, chunks, 0, interrupt);
    } else if (n > 0) {
      chunks.push_back({s, n});
    }
  }
};

PretokenCounter::PretokenCounter(CountOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
PretokenCounter::~PretokenCounter() = default;

namespace {

bool is_clean_utf8(const uint8_t* s, size_t n) {
  uint64_t num_cr = 0, num_crlf = 0;
  return scan_utf8(s, n, &num_cr, &num_crlf) && num_cr == 0;
}

struct Mapping {
  void* data = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (data != MAP_FAILED) ::munmap(data, size);
  }
};

}  // namespace

void PretokenCounter::add_file(const std::string& path, Interrupt* interrupt, std::atomic<int64_t>* bytes_done) {
  Impl& impl = *impl_;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError(path, errno);
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw FileError(path, errno);
  if (S_ISDIR(info.st_mode)) throw FileError(path, EISDIR);
  const Impl::BreakOnThrow guard(impl);
  // Lookahead a cut needs: text[p] and any special token that might straddle p.
  const size_t lookahead = std::max<size_t>(1, impl.specials.max_length());

  // A regular file is memory-mapped and cut into blocks at raw-byte points that are safe cuts of
  // the decoded text too (see raw_safe_split), so blocks decode and count independently: in place
  // when clean UTF-8, translated in parallel when only "\r" needs it, else decoded in order.
  Mapping mapping;
  if (S_ISREG(info.st_mode) && info.st_size > 0) {
    mapping.size = static_cast<size_t>(info.st_size);
    mapping.data = ::mmap(nullptr, mapping.size, PROT_READ, MAP_PRIVATE, fd, 0);
  }
  if (mapping.data != MAP_FAILED) {
    ::madvise(mapping.data, mapping.size, MADV_SEQUENTIAL);
    impl.reserve_tables(mapping.size);
    const auto* file = static_cast<const uint8_t*>(mapping.data);
    const size_t size = mapping.size;
    std::string buffer;
    SpecialTokenCover cover(impl.specials, std::string_view(reinterpret_cast<const char*>(file), size));
    for (size_t start = 0; start < size;) {
      size_t end = size;
      if (size - start > impl.options.block_bytes) {
        end = start + impl.options.block_bytes;
        // A step reads up to a special token's reach: with long tokens Ctrl-C is polled at each.
        const uint64_t poll_mask = impl.specials.max_length() > SpecialTokenMatcher::kLongToken ? 0 : 0xFFFF;
        for (uint64_t steps = 1; end < size; ++steps) {
          const size_t next = impl.raw_safe_split_from(file, end, size, cover);
          if (next == end) break;
          end = std::min(next, size);
          // Text without a safe cut (one huge pre-token) is scanned to its end: Ctrl-C stays live.
          if (interrupt != nullptr && (steps & poll_mask) == 0) interrupt->check();
        }
      }
      impl.count_raw_block(file + start, end - start, static_cast<int64_t>(start), path, buffer, interrupt,
                           bytes_done);
      start = end;
    }
    return;
  }

  // Anything else (a pipe, an empty or unmappable file) is read and decoded in order.
  size_t block_bytes = impl.options.block_bytes;
  if (S_ISREG(info.st_mode) && info.st_size >= 0) {
    // A small file needs no 64 MiB buffer; /proc files report size 0 and still hold text.
    block_bytes = std::min(block_bytes, std::max<size_t>(static_cast<size_t>(info.st_size), 64 << 10) + 16);
  }
  std::vector<uint8_t> raw(block_bytes);
  size_t raw_len = 0;                                 // bytes in raw (an unfinished character first)
  int64_t raw_offset = 0;                             // file offset of raw[0]
  std::string text;                                   // decoded, not yet counted
  TextDecoder decoder(impl.options.errors);
  size_t searched = 0;  // text[0:searched) holds no safe cut that the next cut() would take
  bool eof = false;
  while (!eof) {
    if (interrupt != nullptr) interrupt->check();  // passes that cut nothing count nothing
    while (raw_len < raw.size()) {
      const ssize_t got = ::read(fd, raw.data() + raw_len, raw.size() - raw_len);
      if (got < 0) {
        if (errno == EINTR) continue;
        throw FileError(path, errno);
      }
      if (got == 0) {
        eof = true;
        break;
      }
      raw_len += static_cast<size_t>(got);
    }
    const size_t consumed = decoder.decode(raw.data(), raw_len, eof, raw_offset, path, text);
    std::memmove(raw.data(), raw.data() + consumed, raw_len - consumed);
    raw_len -= consumed;
    raw_offset += static_cast<int64_t>(consumed);

    const auto* s = reinterpret_cast<const uint8_t*>(text.data());
    std::vector<Impl::Chunk> chunks;
    size_t done;
    if (eof) {
      impl.cut_all(s, text.size(), chunks, searched, interrupt);
      done = text.size();
    } else {
      const size_t limit = text.size() > lookahead ? text.size() - lookahead : 0;
      done = impl.cut(s, text.size(), limit, chunks, searched, interrupt);
      searched = limit > done ? limit - done : 0;  // cut() tried every point up to limit
    }
    impl.count_chunks(chunks, interrupt, bytes_done);
    text.erase(0, done);
  }
}

void PretokenCounter::add_documents(std::span<const std::string_view> documents, bool decoded,
                                    std::span<const std::string> names, Interrupt* interrupt,
                                    std::atomic<int64_t>* bytes_done) {
  Impl& impl = *impl_;
  std::string decoded_text;
  std::vector<std::pair<size_t, size_t>> ranges;  // into decoded_text
  size_t total = 0;
  for (auto doc : documents) total += doc.size();
  impl.reserve_tables(total);
  if (!decoded) {
    decoded_text.reserve(total);
    for (size_t k = 0; k < documents.size(); ++k) {
      TextDecoder decoder(impl.options.errors);
      const size_t begin = decoded_text.size();
      const std::string name = k < names.size() ? names[k] : "document " + std::to_string(k);
      decoder.decode(reinterpret_cast<const uint8_t*>(documents[k].data()), documents[k].size(), true, 0,
                     name, decoded_text);
      ranges.emplace_back(begin, decoded_text.size());
    }
  }
  std::vector<Impl::Chunk> chunks;
  for (size_t k = 0; k < documents.size(); ++k) {
    const uint8_t* s;
    size_t n;
    if (decoded) {
      s = reinterpret_cast<const uint8_t*>(documents[k].data());
      n = documents[k].size();
    } else {
      s = reinterpret_cast<const uint8_t*>(decoded_text.data()) + ranges[k].first;
      n = ranges[k].second - ranges[k].first;
    }
    impl.cut_document(s, n, chunks, interrupt);
  }
  const Impl::BreakOnThrow guard(impl);
  impl.count_chunks(chunks, interrupt, bytes_done);
}

namespace {

// The entries of all tables in first-occurrence order, as spans: a span is entries [begin, end) of
// one table, inserted during work items that no other table's entries come between. A span's rank
// (its index) orders any two entries of different tables, which is all the merge needs to know:
// no two tables count the same work item.
struct Span {
  size_t table;
  size_t begin;
  size_t end;
};

// The result is written by span: writer j takes spans [bounds[j], bounds[j + 1]).
struct WriteRanges {
  std::vector<Span> spans;
  std::vector<size_t> bounds;
  std::vector<uint64_t> dropped;        // entries in range j merged into another table's entry
  std::vector<uint64_t> dropped_bytes;  // their key bytes
  size_t size() const { return bounds.size() - 1; }
  size_t range_of(size_t rank) const {
    return static_cast<size_t>(std::ranges::upper_bound(bounds, rank) - bounds.begin()) - 1;
  }
};

// The spans, cut into up to 4 * num_threads ranges with about the same number of entries (live or
// not) each; a span is cut where a range starts.
WriteRanges split_for_writing(const std::vector<CountTable*>& tables, int num_threads) {
  struct Piece {
    uint64_t item;
    Span span;
  };
  std::vector<Piece> pieces;
  size_t num_entries = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto& runs = tables[t]->runs();
    num_entries += tables[t]->size();
    for (size_t r = 0; r < runs.size(); ++r) {
      const size_t end = r + 1 < runs.size() ? runs[r + 1].first_entry : tables[t]->size();
      if (end > runs[r].first_entry) pieces.push_back({runs[r].item, {t, runs[r].first_entry, end}});
    }
  }
  std::ranges::sort(pieces, {}, &Piece::item);
  std::vector<Span> spans;
  for (const Piece& piece : pieces) {
    if (!spans.empty() && spans.back().table == piece.span.table) {
      spans.back().end = piece.span.end;  // the table's next run: nothing came between
    } else {
      spans.push_back(piece.span);
    }
  }
  // A few ranges per thread, pulled in turn: the later ones (rarer keys, colder slots) write slower.
  const size_t num_ranges = std::clamp<size_t>(num_entries / 32768, 1, 4 * static_cast<size_t>(num_threads));
  WriteRanges ranges;
  ranges.bounds.push_back(0);
  size_t entries_before = 0;  // in ranges.spans
  for (Span span : spans) {
    // Range j starts at entry num_entries / num_ranges * j; entries_before never passes it.
    while (ranges.bounds.size() < num_ranges) {
      const size_t start = num_entries / num_ranges * ranges.bounds.size();
      if (entries_before + (span.end - span.begin) <= start) break;
      const size_t cut = span.begin + (start - entries_before);
      if (cut > span.begin) {
        ranges.spans.push_back({span.table, span.begin, cut});
        entries_before += cut - span.begin;
        span.begin = cut;
      }
      ranges.bounds.push_back(ranges.spans.size());
    }
    ranges.spans.push_back(span);
    entries_before += span.end - span.begin;
  }
  while (ranges.bounds.size() <= num_ranges) ranges.bounds.push_back(ranges.spans.size());
  ranges.dropped.assign(num_ranges, 0);
  ranges.dropped_bytes.assign(num_ranges, 0);
  return ranges;
}

// The rank of each full slot's span (the merge walks slots in order and moves forward through the
// other tables' slots: ranks by slot keep its reads in that order). Plain heap memory: a huge-page
// block (or a fresh mapping) stalled 2-5 ms now and then on this short-lived buffer. Rank is the
// narrowest type that holds every rank (two bytes keep the array in L2 for the usual table sizes).
template <typename Rank>
std::unique_ptr<Rank[]> rank_slots(const CountTable& table, size_t t, const std::vector<Span>& spans,
                                   Interrupt* interrupt) {
  std::unique_ptr<Rank[]> ranks(new Rank[table.capacity()]);  // uninitialized: read at full slots only
  const uint32_t* const order = table.entry_slots();
  constexpr size_t kAhead = 16;
  for (size_t rank = 0; rank < spans.size(); ++rank) {
    const Span& span = spans[rank];
    if (span.table != t) continue;
    for (size_t k = span.begin; k < span.end; ++k) {
      // With more threads than cores a table's pass takes tens of ms of wall time: stop inside it.
      if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();
      if (k + kAhead < span.end) __builtin_prefetch(&ranks[order[k + kAhead]], 1);
      ranks[order[k]] = static_cast<Rank>(rank);
    }
  }
  return ranks;
}

// Merges the per-worker tables in place: afterwards every key has exactly one live entry, in the
// table where it occurred first (its owner), holding the sum of its counts; its entries in the
// other tables hold kDropped (tallied per write range). Shard s (the keys whose tag's top
// shard_bits bits are s) is merged by one worker, which walks that shard's slot range of each table
// but the last in slot order and looks each key up in the later tables. Every table's home slot is
// a prefix of the same tag bits, so those lookups move forward through the other tables too: the
// whole merge streams through memory instead of jumping to random slots. Worker s writes only the
// counts of shard-s keys, and find() and the walk read only the key fields of other keys' slots,
// so workers never race.
template <typename Rank>
void merge_tables(const std::vector<CountTable*>& tables, int num_threads, WriteRanges& ranges,
                  Interrupt* interrupt) {
  int min_bits = 32;
  for (const CountTable* table : tables) min_bits = std::min(min_bits, table->bits());
  // A few shards per thread, so a thread that falls behind on a shared machine is waited for little.
  const int shard_bits = std::min(min_bits, static_cast<int>(std::bit_width(static_cast<unsigned>(4 * num_threads - 1))));
  const size_t num_shards = size_t{1} << shard_bits;
  const size_t num_tables = tables.size();
  const size_t num_ranges = ranges.size();
  std::vector<std::unique_ptr<Rank[]>> slot_ranks(num_tables);
  run_workers(num_tables, num_threads, interrupt,
              [&](size_t t, int) { slot_ranks[t] = rank_slots<Rank>(*tables[t], t, ranges.spans, interrupt); });
  std::mutex tally_mutex;
  run_workers(num_shards, num_threads, interrupt, [&](size_t shard, int) {
    std::vector<std::pair<size_t, size_t>> found;  // (table, slot) of the key in later tables
    // Tallied here and added once at the end (shared tallies would bounce a cache line).
    std::vector<uint64_t> shard_dropped(num_ranges, 0), shard_dropped_bytes(num_ranges, 0);
    for (size_t t = 0; t + 1 < num_tables; ++t) {
      CountTable& table = *tables[t];
      const int range_bits = table.bits() - shard_bits;
      const size_t begin = shard << range_bits;
      const size_t end = (shard + 1) << range_bits;
      const size_t mask = table.capacity() - 1;
      // One key of this table: merged with its entries in the later tables.
      auto merge_entry = [&](size_t idx) {
        const CountTable::Slot& slot = table.slot(idx);
        if ((slot.tag() >> (32 - shard_bits)) != shard) return;
        int64_t& count = table.count_at(idx);
        if (count == CountTable::kDropped) return;
        if (count < 0) {  // merged by an earlier table's entry, which found this one its owner
          count = -count;
          return;
        }
        const uint8_t* long_bytes = slot.len() <= CountTable::kInlineBytes ? nullptr : table.key_bytes(slot);
        found.clear();
        int64_t total = count;
        for (size_t u = t + 1; u < num_tables; ++u) {
          const size_t other = tables[u]->find(slot.meta, slot.w0, slot.w1, long_bytes);
          if (other == CountTable::kNotFound) continue;
          // Untouched so far: an earlier table holding this key would have marked both entries.
          total += tables[u]->slot(other).count;
          found.emplace_back(u, other);
        }
        if (found.empty()) return;
        size_t owner = t;
        const size_t rank = slot_ranks[t][idx];
        size_t owner_rank = rank;
        for (const auto& [u, other] : found) {
          const size_t other_rank = slot_ranks[u][other];
          if (other_rank < owner_rank) {  // entries of different tables have different ranks
            owner = u;
            owner_rank = other_rank;
          }
        }
        // The owner's count is final here if it is this table or the last one (never walked); an
        // owner in a table between is marked negative, made final (not looked up again) when its
        // table is walked.
        auto drop = [&](int64_t& dropped_count, size_t dropped_rank) {
          dropped_count = CountTable::kDropped;
          const size_t range = ranges.range_of(dropped_rank);
          ++shard_dropped[range];
          shard_dropped_bytes[range] += slot.len();
        };
        if (owner == t) {
          count = total;
        } else {
          drop(count, rank);
        }
        for (const auto& [u, other] : found) {
          if (owner == u) {
            tables[u]->count_at(other) = u + 1 == num_tables ? total : -total;
          } else {
            drop(tables[u]->count_at(other), slot_ranks[u][other]);
          }
        }
      };
      // Slots [begin, end) and, past end, the rest of the run of full slots: a key of this shard
      // whose home is below end sits at or after its home with no empty slot in between (the last
      // shard's run wraps around to slot 0). Taken 8 at a time: which are full is a mask, not a
      // branch per slot (about half are empty, at random).
      for (size_t i = begin;; i += 8) {
        // A shard is a large share of the work: Ctrl-C is polled inside it too, often, because
        // with more threads than cores each worker's last stretch runs at a fraction of a core.
        if (interrupt != nullptr && (i & 0xFFF) == 0) interrupt->check();
        uint32_t full = 0;
        for (size_t b = 0; b < 8; ++b) full |= static_cast<uint32_t>(table.slot((i + b) & mask).meta != 0) << b;
        bool last = false;
        if (i + 8 > end) {
          // Past end, the first empty slot ends the run.
          const uint32_t past_end = i >= end ? 0xFFu : 0xFFu & ~((1u << (end - i)) - 1);
          const uint32_t empty_past_end = ~full & past_end;
          if (empty_past_end != 0) {
            full &= (1u << std::countr_zero(empty_past_end)) - 1;
            last = true;
          }
        }
        for (; full != 0; full &= full - 1) merge_entry((i + static_cast<size_t>(std::countr_zero(full))) & mask);
        if (last) break;
      }
    }
    std::lock_guard<std::mutex> lock(tally_mutex);
    for (size_t j = 0; j < num_ranges; ++j) {
      ranges.dropped[j] += shard_dropped[j];
      ranges.dropped_bytes[j] += shard_dropped_bytes[j];
    }
  });
}

// Writes the live entries of `tables` into `out` in first-occurrence order, range j by writer j
// straight into its place: the entries and key bytes before it are known from the spans (key
// bytes summed as they were inserted) less the dropped ones.
void write_in_order(const std::vector<CountTable*>& tables, const WriteRanges& ranges, int num_threads,
                    FlatPretokenCounts& out, Interrupt* interrupt) {
  const size_t num_ranges = ranges.size();
  // Per range: its first output entry and first output byte.
  std::vector<uint64_t> first_out(num_ranges + 1, 0), first_byte(num_ranges + 1, 0);
  for (size_t j = 0; j < num_ranges; ++j) {
    uint64_t num_entries = 0, num_bytes = 0;
    for (size_t s = ranges.bounds[j]; s < ranges.bounds[j + 1]; ++s) {
      const Span& span = ranges.spans[s];
      num_entries += span.end - span.begin;
      num_bytes += tables[span.table]->key_bytes_before(span.end) - tables[span.table]->key_bytes_before(span.begin);
    }
    first_out[j + 1] = first_out[j] + num_entries - ranges.dropped[j];
    first_byte[j + 1] = first_byte[j] + num_bytes - ranges.dropped_bytes[j];
  }
  out.bytes.resize(first_byte[num_ranges]);
  out.offsets.resize(first_out[num_ranges] + 1);
  out.counts.resize(first_out[num_ranges]);
  out.offsets[0] = 0;
  run_workers(num_ranges, num_threads, interrupt, [&](size_t j, int) {
    // Locals, not members: byte stores may alias anything else in memory.
    size_t num_out = first_out[j];
    uint64_t num_bytes = first_byte[j];
    const uint64_t range_end = first_byte[j + 1];  // 16-byte stores must stay below it
    uint8_t* const bytes = out.bytes.data();
    uint64_t* const offsets = out.offsets.data();
    int64_t* const counts = out.counts.data();
    for (size_t s = ranges.bounds[j]; s < ranges.bounds[j + 1]; ++s) {
      const Span& span = ranges.spans[s];
      const CountTable& table = *tables[span.table];
      const CountTable::Slot* const slots = table.slots();
      const uint32_t* const order = table.entry_slots();
      constexpr size_t kAhead = 16;
      for (size_t k = span.begin; k < span.end; ++k) {
        if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();
        if (k + kAhead < span.end) __builtin_prefetch(&slots[order[k + kAhead]]);
        const CountTable::Slot& slot = slots[order[k]];
        const int64_t count = slot.count;
        if (count == CountTable::kDropped) continue;
        const uint32_t len = slot.len();
        if (len <= CountTable::kInlineBytes && num_bytes + 16 <= range_end) {
          std::memcpy(bytes + num_bytes, &slot.w0, 16);
        } else {
          std::memcpy(bytes + num_bytes, table.key_bytes(slot), len);
        }
        num_bytes += len;
        counts[num_out] = count;
        offsets[++num_out] = num_bytes;
      }
    }
  });
}

}  // namespace

FlatPretokenCounts PretokenCounter::finish_flat(Interrupt* interrupt) {
  Impl& impl = *impl_;
  const Impl::BreakOnThrow guard(impl);
  std::vector<CountTable*> sources;
  for (CountTable& table : impl.tables) {
    if (table.size() > 0) sources.push_back(&table);
  }
  WriteRanges ranges = split_for_writing(sources, impl.options.num_threads);
  if (sources.size() > 1) {
    // Ranks are below the number of spans: at most one per work item, plus one per range cut.
    if (impl.num_items + ranges.size() <= size_t{1} << 16) {
      merge_tables<uint16_t>(sources, impl.options.num_threads, ranges, interrupt);
    } else {
      merge_tables<uint32_t>(sources, impl.options.num_threads, ranges, interrupt);
    }
  }
  FlatPretokenCounts out;
  write_in_order(sources, ranges, impl.options.num_threads, out, interrupt);
  // Each worker frees its own table's memory: the kernel keeps freed pages on a per-CPU list, so the
  // next count's worker on that CPU gets them back warm. Freed by the calling thread, they came
  // back to the other workers as fresh pages, which are slow on a VM that hands free memory to its
  // host (two threads counting gcide again and again: 0.92-0.95x the time).
  // Only tables that counted hold memory (workers that got no item allocated none).
  size_t num_allocated = 0;
  for (size_t t = 0; t < impl.tables.size(); ++t) {
    if (impl.tables[t].capacity() > 0) num_allocated = t + 1;
  }
  std::vector<std::atomic<bool>> cleared(num_allocated);
  run_workers(num_allocated, impl.options.num_threads, nullptr, [&](size_t, int worker) {
    if (!cleared[worker].exchange(true)) impl.tables[worker].clear();
  });
  for (size_t t = 0; t < num_allocated; ++t) {
    if (!cleared[t]) impl.tables[t].clear();
  }
  impl.num_items = 0;
  return out;
}

void PretokenCounter::mark_broken() { impl_->broken = true; }

PretokenCounts PretokenCounter::finish(Interrupt* interrupt) {
  FlatPretokenCounts flat = finish_flat(interrupt);
  const Impl::BreakOnThrow guard(*impl_);
  PretokenCounts out;
  out.counts.assign(flat.counts.begin(), flat.counts.end());
  out.pretokens.resize(out.counts.size());
  for (size_t k = 0; k < out.counts.size(); ++k) {
    if (interrupt != nullptr && (k & 0xFFFF) == 0) interrupt->check();
    out.pretokens[k].assign(reinterpret_cast<const char*>(flat.bytes.data()) + flat.offsets[k],
                            flat.offsets[k + 1] - flat.offsets[k]);
  }
  return out;
}

}  // namespace trainfast::bpe
