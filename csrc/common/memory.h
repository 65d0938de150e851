// Refuse up front a result that could not fit in this machine's memory, saying how big it would be,
// instead of failing halfway with std::bad_alloc.
#pragma once

#include <cstdint>

namespace trainfast {

// Physical memory of this machine in bytes (0 when unknown).
int64_t physical_memory_bytes();

// Throws std::invalid_argument naming `what` and the size when `num_elements` x `bytes_per_element`
// exceeds physical memory (or int64).
void check_output_fits(const char* what, int64_t num_elements, int64_t bytes_per_element);

}  // namespace trainfast
