// Output buffers that skip value-initialisation: every element of a plan's big arrays is written
// exactly once (often by worker threads), and zeroing them first doubled the memory traffic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace trainfast {

// Blocks of at least kLargeAllocation bytes come 2 MiB-aligned with a transparent-huge-page hint
// (far fewer page faults when they are first written).
constexpr size_t kLargeAllocation = size_t{4} << 20;
void* allocate_large(size_t bytes);
void free_large(void* p) noexcept;

template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    if (n * sizeof(T) >= kLargeAllocation) return static_cast<T*>(allocate_large(n * sizeof(T)));
    return std::allocator<T>::allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) >= kLargeAllocation) {
      free_large(p);
    } else {
      std::allocator<T>::deallocate(p, n);
    }
  }
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-init: no zeroing
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitializedBuffer = std::vector<T, UninitializedAllocator<T>>;

}  // namespace trainfast
