// A small fixed thread pool whose parallel_for fits floe::parallel_for_fn. The caller's
// thread takes part, so thread_pool(2) starts one worker. A call made from inside one of
// the pool's own bodies runs serially, so nested parallelism cannot deadlock. Idle
// workers, and the caller waiting for them, spin for a while before they sleep: waking a
// sleeping thread costs tens of microseconds, a large part of a short decode step
// (docs/benchmarks.md, "Waking the pool").
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/exec/parallel.hpp"

namespace floe {

class thread_pool {
 public:
  // `threads` bodies may run at once, the calling thread included; 1 starts no worker.
  // `spin`: how long an idle thread polls for work (or the caller for the workers to
  // finish) before it blocks; zero blocks at once.
  explicit thread_pool(index_t threads, std::chrono::microseconds spin = std::chrono::microseconds(200))
      : size_(threads), spin_(spin) {
    require(threads >= 1, "threads", "a thread pool needs at least 1 thread, got ", threads);
    require(spin.count() >= 0, "spin", "must not be negative, got ", spin.count(), " us");
    workers_.reserve(threads - 1);
    for (index_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  index_t size() const { return size_; }

  // Runs body(0..n-1) on the pool and returns when all are done; rethrows the first
  // exception a body threw (the remaining indices are then skipped).
  void parallel_for(index_t n, const std::function<void(index_t)>& body) {
    if (n == 0) return;
    if (n == 1 || workers_.empty() || current_pool() == this) {
      for (index_t i = 0; i < n; ++i) body(i);
      return;
    }
    std::lock_guard caller(call_mutex_);  // one job at a time from outside
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return active_.load(std::memory_order_relaxed) == 0; });  // stragglers of the last job
      body_ = &body;
      count_ = n;
      next_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    const thread_pool* outer = current_pool();  // a worker of another pool may call us
    current_pool() = this;
    run_indices();
    current_pool() = outer;
    std::exception_ptr error;
    // Sequentially consistent with the workers' joining and claiming (below): a worker
    // that claimed an index counted itself in active_ first, so 0 here means none did.
    spin_until([this] { return active_.load() == 0; });
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return active_.load(std::memory_order_relaxed) == 0; });
      error = error_;
      body_ = nullptr;
    }
    if (error) std::rethrow_exception(error);
  }

  // This pool as a parallel_for_fn; the pool must outlive every copy.
  parallel_for_fn hook() {
    return [this](index_t n, const std::function<void(index_t)>& body) { parallel_for(n, body); };
  }

 private:
  static const thread_pool*& current_pool() {
    thread_local const thread_pool* pool = nullptr;
    return pool;
  }

  void run_indices() {
    for (;;) {
      const index_t i = next_.fetch_add(1);
      if (i >= count_) return;
      try {
        (*body_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(count_, std::memory_order_relaxed);
      }
    }
  }

  // Polls `ready` for up to spin_ (checking the clock every 64 polls); true once it holds.
  template <class Ready>
  bool spin_until(Ready ready) const {
    if (spin_.count() == 0) return ready();
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  void work() {
    current_pool() = this;
    std::uint64_t seen = 0;
    for (;;) {
      spin_until([&] {
        return stopping_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
      });
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_relaxed) != seen; });
        if (stopping_.load(std::memory_order_relaxed)) return;
        seen = generation_.load(std::memory_order_relaxed);
        active_.fetch_add(1);
      }
      run_indices();
      {
        std::lock_guard lock(mutex_);
        active_.fetch_sub(1, std::memory_order_release);
      }
      done_.notify_all();
    }
  }

  index_t size_;
  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(index_t)>* body_ = nullptr;
  index_t count_ = 0;
  std::atomic<index_t> next_{0};
  std::exception_ptr error_;
  // Written under mutex_ (the sleepers' protocol), read without it while spinning.
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<index_t> active_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace floe
