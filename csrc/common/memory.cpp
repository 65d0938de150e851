#include "common/memory.h"

#include <cstdio>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include "common/checked_math.h"

namespace trainfast {

int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return checked_mul(pages, page_size).value_or(INT64_MAX);
}

void check_output_fits(const char* what, int64_t num_elements, int64_t bytes_per_element) {
  const auto bytes = checked_mul(num_elements, bytes_per_element);
  const int64_t memory = physical_memory_bytes();
  if (bytes && (memory == 0 || *bytes <= memory)) return;
  char message[256];
  if (bytes) {
    std::snprintf(message, sizeof(message),
                  "%s would need %lld elements (%.1f GiB), more than this machine's %.1f GiB of memory",
                  what, static_cast<long long>(num_elements), static_cast<double>(*bytes) / (1 << 30),
                  static_cast<double>(memory) / (1 << 30));
  } else {
    std::snprintf(message, sizeof(message), "%s would need %lld elements of %lld bytes, over 2^63 bytes",
                  what, static_cast<long long>(num_elements), static_cast<long long>(bytes_per_element));
  }
  throw std::invalid_argument(message);
}

}  // namespace trainfast
