// Shared hashing for the open-addressing tables (pre-token counts, BPE pairs and words).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace trainfast {

// Two xor-shift-multiply rounds: spreads every input bit over the low bits a table mask keeps.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return x;
}

// Hash of a byte string (8 bytes per round, then mix64).
inline uint64_t hash_bytes(const uint8_t* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 29;
  }
  if (i < n) {
    uint64_t word = 0;
    std::memcpy(&word, p + i, n - i);
    h = (h ^ word) * 0xC2B2AE3D27D4EB4Full;
  }
  return mix64(h);
}

}  // namespace trainfast
