// An allocator for benchmark buffers backed by 2 MiB transparent huge pages where the
// kernel grants them (madvise), as inference engines allocate their KV caches: the
// sparse methods gather scattered rows, and with 4 KiB pages each row costs a TLB walk.
// FLOE_BENCH_HUGE_PAGES=0 turns it off, to measure the difference.
#pragma once

#include <cstdlib>
#include <new>

#include <sys/mman.h>

namespace floe::bench {

template <class T>
struct huge_page_allocator {
  using value_type = T;
  static constexpr std::size_t huge = std::size_t{2} << 20;

  huge_page_allocator() = default;
  template <class U>
  huge_page_allocator(const huge_page_allocator<U>&) {}

  static bool enabled() {
    const char* v = std::getenv("FLOE_BENCH_HUGE_PAGES");
    return !(v && v[0] == '0');
  }

  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + huge - 1) / huge * huge;
    void* p = std::aligned_alloc(huge, bytes);
    if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (enabled()) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure leaves 4 KiB pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }

  template <class U>
  bool operator==(const huge_page_allocator<U>&) const { return true; }
};

}  // namespace floe::bench
