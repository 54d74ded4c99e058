// The machine's sustained read bandwidth, measured in the same run as the decode cases: a
// streaming sum over a buffer much larger than the last-level cache, split over threads.
#pragma once

#include <cstdint>
#include <memory>

#include "floe/exec/thread_pool.hpp"

namespace floe::bench {

// Sums 64-bit words with the widest vector unit this CPU has (several independent
// accumulators, so the loads, not the adds, set the pace).
std::uint64_t stream_sum(const std::uint64_t* words, std::size_t count);

struct stream_result {
  double median_gbps = 0;  // median over repetitions: the reference for bw_fraction
  double best_gbps = 0;
  std::size_t bytes = 0;
};

// A buffer of `bytes` (written once, so its pages exist) that measure() reads whole.
class stream_reader {
 public:
  // huge_pages: on 2 MiB pages (madvise before the first touch), like KV caches placed so.
  explicit stream_reader(std::size_t bytes, bool huge_pages = false);
  // Reads the buffer `repetitions` times on `pool`, each thread its own contiguous part.
  stream_result measure(thread_pool& pool, int repetitions) const;
  // The reference for a sparse paged pool: reads one `chunk_bytes` chunk out of every
  // `spread` (at a random place in each stretch, a fresh choice each pass), in address
  // order, asking for the next chunk's lines before summing one. Each thread its own part.
  stream_result measure_scattered(thread_pool& pool, std::size_t chunk_bytes, std::size_t spread,
                                  int repetitions) const;

 private:
  std::size_t words_;
  std::unique_ptr<void, void (*)(void*)> buffer_;  // words_ from data_, on a 64-byte line (or 2 MiB)
  const std::uint64_t* data_;
};

}  // namespace floe::bench
