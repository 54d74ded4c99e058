// The machine's sustained read bandwidth, measured in the same run as the decode cases: a
// streaming sum over a buffer much larger than the last-level cache, split over threads.
#pragma once

#include <cstdint>
#include <vector>

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

// Reads `bytes` (rounded down to whole cache lines per thread) `repetitions` times on
// `pool`, after one untimed pass that faults the pages in.
stream_result measure_stream_read(thread_pool& pool, std::size_t bytes, int repetitions);

}  // namespace floe::bench
