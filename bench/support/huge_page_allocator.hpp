// An allocator for benchmark buffers backed by 2 MiB transparent huge pages where the
// kernel grants them (madvise), as inference engines allocate their KV caches: the
// sparse methods gather scattered rows, and with 4 KiB pages each row costs a TLB walk.
// FLOE_BENCH_HUGE_PAGES=0 turns it off, to measure the difference.
#pragma once

#include <cstdlib>

#include "floe/core/huge_page_allocator.hpp"

namespace floe::bench {

template <class T>
struct huge_page_allocator {
  using value_type = T;

  huge_page_allocator() = default;
  template <class U>
  huge_page_allocator(const huge_page_allocator<U>&) {}

  static bool enabled() {
    const char* v = std::getenv("FLOE_BENCH_HUGE_PAGES");
    return !(v && v[0] == '0');
  }

  T* allocate(std::size_t n) { return static_cast<T*>(detail::allocate_huge_aligned(n * sizeof(T), enabled())); }
  void deallocate(T* p, std::size_t n) { detail::free_huge_aligned(p, n * sizeof(T)); }

  template <class U>
  bool operator==(const huge_page_allocator<U>&) const { return true; }
};

}  // namespace floe::bench
