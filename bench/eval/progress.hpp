// A progress bar on stderr, drawn only on a terminal and only once a run has taken more
// than a second; thread-safe.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

#include "floe/core/config.hpp"

namespace floe::eval {

class progress {
 public:
  using clock = std::chrono::steady_clock;

  explicit progress(index_t total, bool enabled = isatty(2) != 0) : total_(total), enabled_(enabled) {}
  ~progress() { finish(); }
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  void set_label(std::string label) {
    std::lock_guard lock(mutex_);
    label_ = std::move(label);
  }

  void tick(index_t units = 1) {
    const index_t done = done_ += units;
    if (!enabled_) return;
    const auto now = clock::now();
    if (now - start_ < std::chrono::seconds(1)) return;
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock || now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    draw(done);
  }

  // Clears the bar (if one was drawn) so that the table starts on a clean line.
  void finish() {
    std::lock_guard lock(mutex_);
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    drawn_ = false;
    std::fflush(stderr);
  }

 private:
  void draw(index_t done) {
    constexpr int width = 30;
    const double f = total_ ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total_)) : 1.0;
    const double elapsed = std::chrono::duration<double>(clock::now() - start_).count();
    const int filled = static_cast<int>(f * width);
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.resize(width, '.');
    const double eta = f > 0 ? elapsed * (1 - f) / f : 0.0;
    std::fprintf(stderr, "\r\033[K[%s] %3.0f%%  %.0fs, ~%.0fs left  %s", bar.c_str(), 100 * f, elapsed, eta,
                 label_.c_str());
    std::fflush(stderr);
    drawn_ = true;
  }

  index_t total_;
  bool enabled_;
  std::atomic<index_t> done_{0};
  clock::time_point start_ = clock::now();
  clock::time_point last_draw_{};
  std::mutex mutex_;
  std::string label_;
  bool drawn_ = false;
};

}  // namespace floe::eval
