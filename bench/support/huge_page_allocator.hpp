// An allocator for benchmark buffers backed by 2 MiB transparent huge pages where the
// kernel grants them (madvise), as inference engines allocate their KV caches: the
// sparse methods gather scattered rows, and with 4 KiB pages each row costs a TLB walk.
// FLOE_BENCH_HUGE_PAGES=0 turns it off, to measure the difference.
#pragma once

#include <cstdlib>

#include "floe/core/huge_page_allocator.hpp"

namespace floe::bench {

struct huge_pages_from_environment {
  static bool enabled() {
    const char* v = std::getenv("FLOE_BENCH_HUGE_PAGES");
    return !(v && v[0] == '0');
  }
};

template <class T>
using huge_page_allocator = floe::huge_page_allocator<T, huge_pages_from_environment>;

}  // namespace floe::bench
