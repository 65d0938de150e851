#include "common/buffer.h"

#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace trainfast {
namespace {
constexpr size_t kHugePage = size_t{2} << 20;
size_t round_to_huge_pages(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
}  // namespace

void* allocate_large(size_t bytes) {
  const size_t rounded = round_to_huge_pages(bytes);
  void* p = std::aligned_alloc(kHugePage, rounded);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  ::madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure just means 4 KiB pages
#endif
  return p;
}

void free_large(void* p) noexcept { std::free(p); }

void* allocate_zeroed(size_t bytes) {
#if defined(__linux__)
  if (bytes >= kLargeAllocation) {
    // Mapped 2 MiB-aligned (over-map, trim both ends) so the huge-page hint can take effect.
    const size_t rounded = round_to_huge_pages(bytes);
    void* raw = ::mmap(nullptr, rounded + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = round_to_huge_pages(start);
    const uintptr_t end = start + rounded + kHugePage;
    if (aligned > start) ::munmap(raw, aligned - start);
    if (end > aligned + rounded) ::munmap(reinterpret_cast<void*>(aligned + rounded), end - (aligned + rounded));
#if defined(MADV_HUGEPAGE)
    ::madvise(reinterpret_cast<void*>(aligned), rounded, MADV_HUGEPAGE);  // a hint, as above
#endif
    return reinterpret_cast<void*>(aligned);
  }
#endif
  void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void free_zeroed(void* p, size_t bytes) noexcept {
#if defined(__linux__)
  if (bytes >= kLargeAllocation) {
    ::munmap(p, round_to_huge_pages(bytes));
    return;
  }
#endif
  std::free(p);
}

}  // namespace trainfast
