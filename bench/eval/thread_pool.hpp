// floe::parallel_for_fn on plain threads: the tool's own threads over KV heads.
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "floe/exec/parallel.hpp"

namespace floe::eval {

// Runs body(0..n-1) on up to `threads` threads (the caller's among them); the first
// exception thrown by a body is rethrown after all threads have stopped.
inline parallel_for_fn threaded_for(unsigned threads) {
  return [threads](index_t n, const std::function<void(index_t)>& body) {
    const unsigned workers = static_cast<unsigned>(std::min<index_t>(std::max(1u, threads), n));
    if (workers <= 1) return serial_for(n, body);
    std::atomic<index_t> next{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&] {
      for (index_t i; (i = next++) < n;) {
        try {
          body(i);
        } catch (...) {
          std::lock_guard lock(error_mutex);
          if (!error) error = std::current_exception();
          next = n;
        }
      }
    };
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (error) std::rethrow_exception(error);
  };
}

}  // namespace floe::eval
