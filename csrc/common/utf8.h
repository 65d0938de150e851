// UTF-8 well-formedness (Unicode Table 3-7), shared by the decoders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/buffer.h"
#include "common/parallel.h"

namespace trainfast {

// For a lead byte >= 0x80: the number of continuation bytes it needs and the allowed range of the
// first one (the later ones are always 0x80..0xBF). False for bytes that cannot start a sequence.
inline bool utf8_lead(uint8_t lead, int* num_continuation, uint8_t* first_lo, uint8_t* first_hi) {
  *first_lo = 0x80;
  *first_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    *num_continuation = 1;
  } else if (lead == 0xE0) {
    *num_continuation = 2, *first_lo = 0xA0;
  } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
    *num_continuation = 2;
  } else if (lead == 0xED) {
    *num_continuation = 2, *first_hi = 0x9F;  // no surrogates
  } else if (lead == 0xF0) {
    *num_continuation = 3, *first_lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    *num_continuation = 3;
  } else if (lead == 0xF4) {
    *num_continuation = 3, *first_hi = 0x8F;  // <= U+10FFFF
  } else {
    return false;
  }
  return true;
}

// Whether any byte of w is zero (w ^ 0x0D0D...: whether any byte is "\r").
inline bool has_zero_byte(uint64_t w) { return ((w - 0x0101010101010101ull) & ~w & 0x8080808080808080ull) != 0; }

// Whether s[0:n) is well-formed UTF-8 made of complete characters; when it is, adds its "\r" and
// "\r\n" counts to *num_cr and *num_crlf. AVX2 (Keiser-Lemire lookup) where the CPU has it.
bool scan_utf8(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf);
// The same, a byte at a time (the reference the SIMD path is tested against).
bool scan_utf8_scalar(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf);
// The same, on the SIMD path whatever n is (scalar where the CPU has no AVX2); for tests.
bool scan_utf8_simd(const uint8_t* s, size_t n, uint64_t* num_cr, uint64_t* num_crlf);
bool has_simd_utf8();

// Text stored as fixed-width code points (Python's str storage: 1, 2 or 4 bytes each).
struct CodePoints {
  const void* data = nullptr;
  int bytes_per_code_point = 1;
  size_t size = 0;
};

// UTF-8 of several texts in one buffer: text k is bytes[offsets[k], offsets[k + 1]). Lone
// surrogates get their 3-byte form, as Python's "surrogatepass" writes them.
struct EncodedUtf8 {
  UninitializedBuffer<char> bytes;
  std::vector<size_t> offsets;
  std::vector<int64_t> first_surrogate_idx;  // per text: code point index of its first lone surrogate, or -1
};
// Texts are cut into pieces of at most 2^20 code points, encoded on up to num_threads threads;
// the bytes do not depend on it. Throws std::invalid_argument for a width other than 1, 2 or 4.
EncodedUtf8 encode_utf8(std::span<const CodePoints> texts, int num_threads, Interrupt* interrupt);

}  // namespace trainfast
