// The parallel-for hook: executors and batch drivers never own threads an engine did not
// give them. Pass any callable that runs body(0..n-1), in any order, and returns when
// all are done.
#pragma once

#include <functional>

#include "floe/core/config.hpp"

namespace floe {

using parallel_for_fn = std::function<void(index_t n, const std::function<void(index_t)>& body)>;

inline void serial_for(index_t n, const std::function<void(index_t)>& body) {
  for (index_t i = 0; i < n; ++i) body(i);
}

}  // namespace floe
