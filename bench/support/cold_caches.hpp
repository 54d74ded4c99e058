// Cold caches between benchmark steps: reads a buffer of FLOE_BENCH_COLD_MIB MiB (default
// 1024, more than the 260-300 MiB L3 of the machines here; 0 turns it off) with the
// timing paused, so that a step finds no KV, index or selection cached, as in an engine
// that steps every layer in turn.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <vector>

#include <benchmark/benchmark.h>

namespace floe::bench {

inline std::uint64_t cold_mib() {
  static const std::uint64_t mib = [] {
    const char* v = std::getenv("FLOE_BENCH_COLD_MIB");
    return v ? std::strtoull(v, nullptr, 10) : std::uint64_t{1024};
  }();
  return mib;
}

// Evicts the caches (one read per 64-byte line) outside the timing of `state`.
inline void start_cold(benchmark::State& state) {
  if (cold_mib() == 0) return;
  state.PauseTiming();  // before the buffer's first use: writing 1 GiB once is no step's time
  static std::vector<std::uint64_t> junk(cold_mib() << 17, 1);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < junk.size(); i += 8) sum += junk[i];
  benchmark::DoNotOptimize(sum);
  state.ResumeTiming();
}

}  // namespace floe::bench
