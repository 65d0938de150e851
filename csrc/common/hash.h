// Shared integer mixing for the open-addressing tables (pre-token counts, BPE pairs and words).
#pragma once

#include <cstdint>

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

}  // namespace trainfast
