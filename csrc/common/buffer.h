// Output buffers that skip value-initialisation: every element of a plan's big arrays is written
// exactly once (often by worker threads), and zeroing them first doubled the memory traffic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainfast {

// Blocks of at least kLargeAllocation bytes come 2 MiB-aligned with a transparent-huge-page hint
// (far fewer page faults when they are first written).
constexpr size_t kLargeAllocation = size_t{4} << 20;
void* allocate_large(size_t bytes);
void free_large(void* p) noexcept;
// `bytes` zero bytes; large blocks are fresh kernel pages (2 MiB-aligned, huge-page hint), zeroed
// when first written, by whichever thread writes them. Freed with free_zeroed(p, bytes).
void* allocate_zeroed(size_t bytes);
void free_zeroed(void* p, size_t bytes) noexcept;

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

// n zero-valued T in one block from allocate_zeroed: a big table needs no zeroing pass up front
// (its pages are cleared as the threads filling it first touch them).
template <typename T>
class ZeroedArray {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);

 public:
  ZeroedArray() = default;
  explicit ZeroedArray(size_t n) : data_(static_cast<T*>(allocate_zeroed(n * sizeof(T)))), size_(n) {}
  ~ZeroedArray() {
    if (data_ != nullptr) free_zeroed(data_, size_ * sizeof(T));
  }
  ZeroedArray(ZeroedArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  ZeroedArray& operator=(ZeroedArray&& other) noexcept {
    swap(other);
    return *this;
  }
  ZeroedArray(const ZeroedArray&) = delete;
  ZeroedArray& operator=(const ZeroedArray&) = delete;
  void swap(ZeroedArray& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace trainfast
