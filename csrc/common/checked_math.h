// Overflow-checked 64-bit arithmetic: sizes come from users and must never wrap silently.
#pragma once

#include <cstdint>
#include <optional>

namespace trainfast {

inline std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

}  // namespace trainfast
