#include "common/utf8.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/check.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TRAINFAST_UTF8_AVX2 1
#endif

namespace trainfast {

bool scan_utf8_scalar(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf) {
  uint64_t total_cr = 0, total_crlf = 0;
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s + i, 8);
      if ((w & 0x8080808080808080ull) == 0 && !has_zero_byte(w ^ 0x0D0D0D0D0D0D0D0Dull)) {
        i += 8;
        continue;
      }
    }
    const uint8_t b = s[i];
    if (b < 0x80) {
      if (b == '\r') {
        ++total_cr;
        if (i + 1 < n && s[i + 1] == '\n') ++total_crlf;
      }
      ++i;
      continue;
    }
    int num_continuation;
    uint8_t lo, hi;
    if (!utf8_lead(b, &num_continuation, &lo, &hi)) return false;
    const size_t need = static_cast<size_t>(num_continuation);
    if (i + need >= n) return false;  // unfinished at the end
    if (s[i + 1] < lo || s[i + 1] > hi) return false;
    for (size_t k = 2; k <= need; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
    }
    i += need + 1;
  }
  *num_cr += total_cr;
  *num_crlf += total_crlf;
  return true;
}

#if defined(TRAINFAST_UTF8_AVX2)
namespace {

// Keiser and Lemire, "Validating UTF-8 in less than one instruction per byte" (2021), the
// "lookup" method: every error shows in the pair (previous byte, this byte) as an AND of three
// 16-entry nibble tables, except a missing or extra 3rd/4th byte, which the bytes 2 and 3 back
// decide. One bit per error kind:
constexpr char kTooShort = static_cast<char>(1 << 0);      // lead followed by a lead or ASCII
constexpr char kTooLong = static_cast<char>(1 << 1);       // ASCII followed by a continuation
constexpr char kOverlong3 = static_cast<char>(1 << 2);     // E0 80..9F
constexpr char kTooLarge = static_cast<char>(1 << 3);      // F4 90..BF, F5..FF 90..BF
constexpr char kSurrogate = static_cast<char>(1 << 4);     // ED A0..BF
constexpr char kOverlong2 = static_cast<char>(1 << 5);     // C0, C1 followed by a continuation
constexpr char kTooLarge1000 = static_cast<char>(1 << 6);  // F5..FF 80..8F
constexpr char kOverlong4 = static_cast<char>(1 << 6);     // F0 80..8F (shares the bit: both need 1111____ 1000____)
constexpr char kTwoConts = static_cast<char>(1 << 7);      // continuation after continuation: an error unless a 3rd/4th byte
constexpr char kCarry = kTooShort | kTooLong | kTwoConts;

#define TF_TABLE(...) _mm256_setr_epi8(__VA_ARGS__, __VA_ARGS__)

// The byte before each byte of `input` (prev_input holds the 32 bytes before it); k = 1, 2, 3.
template <int K>
[[gnu::target("avx2"), gnu::always_inline]] inline __m256i previous(__m256i input, __m256i prev_input) {
  return _mm256_alignr_epi8(input, _mm256_permute2x128_si256(prev_input, input, 0x21), 16 - K);
}

[[gnu::target("avx2"), gnu::always_inline]] inline __m256i errors_of(__m256i input, __m256i prev_input) {
  const __m256i low_nibble = _mm256_set1_epi8(0x0F);
  const __m256i prev1 = previous<1>(input, prev_input);
  const __m256i byte_1_high = _mm256_shuffle_epi8(
      TF_TABLE(kTooLong, kTooLong, kTooLong, kTooLong, kTooLong, kTooLong, kTooLong, kTooLong,  // 0_______
               kTwoConts, kTwoConts, kTwoConts, kTwoConts,                                      // 10______
               kTooShort | kOverlong2,                                                          // 1100____
               kTooShort,                                                                       // 1101____
               kTooShort | kOverlong3 | kSurrogate,                                             // 1110____
               kTooShort | kTooLarge | kTooLarge1000 | kOverlong4),                             // 1111____
      _mm256_and_si256(_mm256_srli_epi16(prev1, 4), low_nibble));
  constexpr char kLarge = kCarry | kTooLarge | kTooLarge1000;
  const __m256i byte_1_low = _mm256_shuffle_epi8(
      TF_TABLE(kCarry | kOverlong3 | kOverlong2 | kOverlong4,  // ____0000
               kCarry | kOverlong2,                            // ____0001
               kCarry, kCarry,                                 // ____001_
               kCarry | kTooLarge,                             // ____0100
               kLarge, kLarge, kLarge,                         // ____0101, ____011_
               kLarge, kLarge, kLarge, kLarge, kLarge,         // ____1000..____1100
               kLarge | kSurrogate,                            // ____1101
               kLarge, kLarge),                                // ____111_
      _mm256_and_si256(prev1, low_nibble));
  constexpr char kCont = kTooLong | kOverlong2 | kTwoConts;
  const __m256i byte_2_high = _mm256_shuffle_epi8(
      TF_TABLE(kTooShort, kTooShort, kTooShort, kTooShort, kTooShort, kTooShort, kTooShort, kTooShort,  // 0_______
               kCont | kOverlong3 | kTooLarge1000 | kOverlong4,                                        // 1000____
               kCont | kOverlong3 | kTooLarge,                                                         // 1001____
               kCont | kSurrogate | kTooLarge, kCont | kSurrogate | kTooLarge,                         // 101_____
               kTooShort, kTooShort, kTooShort, kTooShort),                                            // 11______
      _mm256_and_si256(_mm256_srli_epi16(input, 4), low_nibble));
  const __m256i special = _mm256_and_si256(_mm256_and_si256(byte_1_high, byte_1_low), byte_2_high);
  // A byte 2 back at E0..FF or 3 back at F0..FF makes this byte a required continuation: kTwoConts
  // is then expected (the XOR clears it) and its absence is an error.
  const __m256i third = _mm256_subs_epu8(previous<2>(input, prev_input), _mm256_set1_epi8(static_cast<char>(0xE0 - 0x80)));
  const __m256i fourth = _mm256_subs_epu8(previous<3>(input, prev_input), _mm256_set1_epi8(static_cast<char>(0xF0 - 0x80)));
  const __m256i must_continue = _mm256_and_si256(_mm256_or_si256(third, fourth), _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_xor_si256(must_continue, special);
}

// Nonzero where the last bytes of `input` start a sequence that needs bytes past it.
[[gnu::target("avx2"), gnu::always_inline]] inline __m256i incomplete_at_end(__m256i input) {
  const __m256i max_complete = _mm256_setr_epi8(
      -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
      -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
      static_cast<char>(0xF0 - 1), static_cast<char>(0xE0 - 1), static_cast<char>(0xC0 - 1));
  return _mm256_subs_epu8(input, max_complete);
}

#undef TF_TABLE

[[gnu::target("avx2,popcnt")]] bool scan_utf8_avx2(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf) {
  __m256i error = _mm256_setzero_si256();
  __m256i prev_input = _mm256_setzero_si256();
  __m256i prev_incomplete = _mm256_setzero_si256();
  const __m256i cr = _mm256_set1_epi8('\r'), lf = _mm256_set1_epi8('\n');
  uint64_t cr_before = 0;  // whether the byte before this block is "\r"
  uint64_t total_cr = 0, total_crlf = 0;
  alignas(32) uint8_t tail[64];
  for (size_t i = 0; i < n; i += 64) {
    const uint8_t* block = s + i;
    if (n - i < 64) {  // zero padding is ASCII: it completes nothing, so a cut-off sequence is an error
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, s + i, n - i);
      block = tail;
    }
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32));
    const uint64_t cr_mask = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, cr))) |
                             static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, cr)))) << 32;
    if (cr_mask != 0 || cr_before != 0) {
      const uint64_t lf_mask = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, lf))) |
                               static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, lf)))) << 32;
      total_cr += static_cast<uint64_t>(_mm_popcnt_u64(cr_mask));
      total_crlf += static_cast<uint64_t>(_mm_popcnt_u64(((cr_mask << 1) | cr_before) & lf_mask));
      cr_before = cr_mask >> 63;
    }
    if (_mm256_movemask_epi8(_mm256_or_si256(lo, hi)) == 0) {
      error = _mm256_or_si256(error, prev_incomplete);
      prev_incomplete = _mm256_setzero_si256();
      prev_input = hi;
      continue;
    }
    error = _mm256_or_si256(error, errors_of(lo, prev_input));
    error = _mm256_or_si256(error, errors_of(hi, lo));
    prev_incomplete = incomplete_at_end(hi);
    prev_input = hi;
  }
  error = _mm256_or_si256(error, prev_incomplete);
  if (!_mm256_testz_si256(error, error)) return false;
  *num_cr += total_cr;
  *num_crlf += total_crlf;
  return true;
}

}  // namespace
#endif

bool has_simd_utf8() {
#if defined(TRAINFAST_UTF8_AVX2)
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return has_avx2;
#else
  return false;
#endif
}

bool scan_utf8_simd(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf) {
#if defined(TRAINFAST_UTF8_AVX2)
  if (has_simd_utf8()) return scan_utf8_avx2(s, n, num_cr, num_crlf);
#endif
  return scan_utf8_scalar(s, n, num_cr, num_crlf);
}

bool scan_utf8(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf) {
  // A few bytes (the split rule's checks) are quicker one by one than padded to a 64-byte block.
  return n >= 64 ? scan_utf8_simd(s, n, num_cr, num_crlf) : scan_utf8_scalar(s, n, num_cr, num_crlf);
}

namespace {

template <typename Unit>
size_t utf8_size(const Unit* s, size_t n, int64_t* first_surrogate_idx) {
  size_t size = n;
  bool any_surrogate = false;
  for (size_t k = 0; k < n; ++k) {
    const uint32_t c = s[k];
    size += (c >= 0x80) + (c >= 0x800) + (c >= 0x10000);
    any_surrogate |= (c & ~uint32_t{0x7FF}) == 0xD800;
  }
  if (any_surrogate) {  // rare: a second pass keeps the first one vectorisable
    for (size_t k = 0; k < n; ++k) {
      if ((static_cast<uint32_t>(s[k]) & ~uint32_t{0x7FF}) == 0xD800) {
        *first_surrogate_idx = static_cast<int64_t>(k);
        break;
      }
    }
  }
  return size;
}

template <typename Unit>
void write_utf8(const Unit* s, size_t n, char* out) {
  for (size_t k = 0; k < n; ++k) {
    const uint32_t c = s[k];
    if (c < 0x80) {
      *out++ = static_cast<char>(c);
    } else if (c < 0x800) {
      out[0] = static_cast<char>(0xC0 | (c >> 6));
      out[1] = static_cast<char>(0x80 | (c & 0x3F));
      out += 2;
    } else if (c < 0x10000) {
      out[0] = static_cast<char>(0xE0 | (c >> 12));
      out[1] = static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out[2] = static_cast<char>(0x80 | (c & 0x3F));
      out += 3;
    } else {
      out[0] = static_cast<char>(0xF0 | (c >> 18));
      out[1] = static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out[2] = static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out[3] = static_cast<char>(0x80 | (c & 0x3F));
      out += 4;
    }
  }
}

// fn(code points of text[begin, end) as their own width, their number).
template <typename Fn>
auto with_piece(const CodePoints& text, size_t begin, size_t end, Fn&& fn) {
  switch (text.bytes_per_code_point) {
    case 1:
      return fn(static_cast<const uint8_t*>(text.data) + begin, end - begin);
    case 2:
      return fn(static_cast<const uint16_t*>(text.data) + begin, end - begin);
    default:
      return fn(static_cast<const uint32_t*>(text.data) + begin, end - begin);
  }
}

}  // namespace

EncodedUtf8 encode_utf8(std::span<const CodePoints> texts, int num_threads, Interrupt* interrupt) {
  constexpr size_t kPiece = size_t{1} << 20;  // code points: a few ms, so Ctrl-C is prompt
  struct Piece {
    size_t text_idx, begin, end;
  };
  std::vector<Piece> pieces;
  std::vector<size_t> task_starts;  // consecutive pieces of about kPiece code points in all
  size_t task_code_points = kPiece;
  for (size_t k = 0; k < texts.size(); ++k) {
    const int width = texts[k].bytes_per_code_point;
    TF_CHECK_ARG(width == 1 || width == 2 || width == 4, "bytes_per_code_point", width, "must be 1, 2 or 4");
    for (size_t begin = 0; begin < texts[k].size; begin += kPiece) {
      const size_t end = std::min(texts[k].size, begin + kPiece);
      if (task_code_points >= kPiece) {
        task_starts.push_back(pieces.size());
        task_code_points = 0;
      }
      pieces.push_back({k, begin, end});
      task_code_points += end - begin;
    }
  }
  task_starts.push_back(pieces.size());
  const auto num_tasks = static_cast<int64_t>(task_starts.size() - 1);

  std::vector<size_t> piece_offsets(pieces.size() + 1, 0);
  std::vector<int64_t> piece_surrogates(pieces.size(), -1);
  parallel_for(num_tasks, 1, num_threads, [&](int64_t task_begin, int64_t task_end) {
    for (size_t p = task_starts[task_begin]; p < task_starts[task_end]; ++p) {
      piece_offsets[p + 1] = with_piece(texts[pieces[p].text_idx], pieces[p].begin, pieces[p].end,
                                        [&](const auto* s, size_t n) { return utf8_size(s, n, &piece_surrogates[p]); });
    }
  }, interrupt);

  EncodedUtf8 out;
  out.offsets.assign(texts.size() + 1, 0);
  out.first_surrogate_idx.assign(texts.size(), -1);
  for (size_t p = 0; p < pieces.size(); ++p) {
    piece_offsets[p + 1] += piece_offsets[p];
    const size_t k = pieces[p].text_idx;
    out.offsets[k + 1] = piece_offsets[p + 1];
    if (out.first_surrogate_idx[k] < 0 && piece_surrogates[p] >= 0) {
      out.first_surrogate_idx[k] = static_cast<int64_t>(pieces[p].begin) + piece_surrogates[p];
    }
  }
  for (size_t k = 0; k < texts.size(); ++k) out.offsets[k + 1] = std::max(out.offsets[k + 1], out.offsets[k]);  // empty texts
  out.bytes.resize(piece_offsets.back());
  parallel_for(num_tasks, 1, num_threads, [&](int64_t task_begin, int64_t task_end) {
    for (size_t p = task_starts[task_begin]; p < task_starts[task_end]; ++p) {
      with_piece(texts[pieces[p].text_idx], pieces[p].begin, pieces[p].end,
                 [&](const auto* s, size_t n) { write_utf8(s, n, out.bytes.data() + piece_offsets[p]); });
    }
  }, interrupt);
  return out;
}

}  // namespace trainfast
