// An allocator for index memory read at scattered rows (the feature map's cached token
// features): blocks of 2 MiB or more are 2 MiB-aligned and, on Linux, advised as
// transparent huge pages (a hint the kernel may decline). With 4 KiB pages each scattered
// row costs a TLB walk: the feature-map subtraction took 4.1 ms instead of 3.0 ms per
// step of 4 heads at N = 128K (docs/methods/retrieval-completion.md, "Cached features").
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace floe {

namespace detail {
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

// Small blocks come from operator new; large ones aligned, and advised when `advise`.
inline void* allocate_huge_aligned(std::size_t bytes, bool advise) {
  if (bytes < huge_page_bytes) return ::operator new(bytes);
  if (bytes > (std::size_t{1} << 48)) throw std::bad_alloc();  // no machine has it; keeps the rounding in range
  const std::size_t rounded = (bytes + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
  void* p = std::aligned_alloc(huge_page_bytes, rounded);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (advise) madvise(p, rounded, MADV_HUGEPAGE);
#else
  (void)advise;
#endif
  return p;
}

inline void free_huge_aligned(void* p, std::size_t bytes) {
  if (bytes < huge_page_bytes) ::operator delete(p);
  else std::free(p);
}
}  // namespace detail

// Whether to advise huge pages: always, unless a policy says otherwise (the benches
// read an environment variable, to measure the difference).
struct advise_huge_pages {
  static bool enabled() { return true; }
};

template <class T, class Advise = advise_huge_pages>
struct huge_page_allocator {
  using value_type = T;
  huge_page_allocator() = default;
  template <class U>
  huge_page_allocator(const huge_page_allocator<U, Advise>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(detail::allocate_huge_aligned(n * sizeof(T), Advise::enabled())); }
  void deallocate(T* p, std::size_t n) { detail::free_huge_aligned(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const huge_page_allocator<U, Advise>&) const { return true; }
};

}  // namespace floe
