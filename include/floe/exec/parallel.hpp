// The parallel-for hook: executors and batch drivers never own threads an engine did not
// give them. Pass any callable that runs body(0..n-1), in any order, and returns when
// all are done.
#pragma once

#include <concepts>
#include <functional>

#include "floe/core/config.hpp"

namespace floe {

using parallel_for_fn = std::function<void(index_t n, const std::function<void(index_t)>& body)>;

inline void serial_for(index_t n, const std::function<void(index_t)>& body) {
  for (index_t i = 0; i < n; ++i) body(i);
}

// An executor may lend its threads to the policies it runs (exec::simd does), so that a
// selector's own scan splits as the exact part does; one that does not runs them serially.
template <class E>
concept LendsThreads = requires(const E& e, index_t n, const std::function<void(index_t)>& body) {
  { e.concurrency() } -> std::convertible_to<index_t>;
  e.parallel_for(n, body);
};

template <class E>
index_t lent_threads(const E& exec) {
  if constexpr (LendsThreads<E>) return exec.concurrency();
  else return 1;
}

template <class E>
void parallel_for_on(const E& exec, index_t n, const std::function<void(index_t)>& body) {
  if constexpr (LendsThreads<E>) exec.parallel_for(n, body);
  else serial_for(n, body);
}

}  // namespace floe
