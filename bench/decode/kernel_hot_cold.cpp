// The attend kernel of floe::exec::simd on one thread, one GQA group: nanoseconds per
// token with the KV cache in L2 ("hot": its arithmetic alone) and read from DRAM ("cold":
// a new copy each call, 1 GiB rotated), next to the streaming read of the same thread.
// Rows start on 64-byte lines, as in an engine's cache; FLOE_BENCH_MISALIGN=16 shifts
// the cache by that many bytes (what a plain std::vector of it gets from malloc).
// How far cold is from max(hot, memory) says how well arithmetic and memory overlap
// (docs/benchmarks.md, "Where the time goes").
//
//   decode_kernel_hot_cold [hot|cold]      FLOE_SIMD_ARCH=avx512|avx2|scalar as usual
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "floe/exec/simd.hpp"
#include "stream_read.hpp"

namespace {

using floe::index_t;

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Hot: N = 2048 (1 MiB of fp16 K+V at d = 128), best of 300 calls. Cold: N = 32768, each
// call on another copy of a 1 GiB set, median of 64 calls. Thread CPU time, so that
// another process taking the core does not count.
template <class T>
void measure(const char* type, index_t d, index_t g, bool hot) {
  const index_t n = hot ? 2048 : 32768;
  const std::size_t per_copy = static_cast<std::size_t>(n) * d * 2;
  const std::size_t copies = hot ? 1 : std::max<std::size_t>(2, (std::size_t{1} << 30) / (per_copy * sizeof(T)));
  const char* shift = std::getenv("FLOE_BENCH_MISALIGN");
  const std::size_t misalign = shift ? std::strtoull(shift, nullptr, 10) : 0;
  std::vector<T> storage(per_copy * copies + (64 + misalign) / sizeof(T));
  const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
  const std::span<T> kv(storage.data() + ((64 - address % 64) % 64 + misalign) / sizeof(T), per_copy * copies);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  const std::size_t pattern = std::min<std::size_t>(kv.size(), 1 << 20);
  for (std::size_t i = 0; i < pattern; ++i) kv[i] = floe::from_float<T>(normal(rng));
  for (std::size_t i = pattern; i < kv.size(); ++i) kv[i] = kv[i % pattern];
  std::vector<float> q(g * d);
  for (auto& x : q) x = normal(rng);
  const floe::exec::simd simd;
  floe::partial_set<float> partial(g, d);
  const auto group = floe::query_group::make(q.data(), g, d);
  const floe::token_range all{0, n};
  std::vector<double> seconds;
  for (int r = 0; r < (hot ? 300 : 64); ++r) {
    const std::size_t c = static_cast<std::size_t>(r) % copies;
    const floe::kv_view<T> view(kv.data() + c * per_copy, kv.data() + c * per_copy + n * d, n, d, d);
    partial.reset();
    const double t0 = thread_seconds();
    simd.attend(view, group, std::span<const floe::token_range>(&all, 1), partial);
    seconds.push_back(thread_seconds() - t0);
  }
  std::sort(seconds.begin(), seconds.end());
  const double s = hot ? seconds.front() : seconds[seconds.size() / 2];
  std::printf("%-5s d=%-3ld g=%ld %s: %6.1f ns/token  %5.1f GB/s\n", type, static_cast<long>(d), static_cast<long>(g),
              hot ? "hot " : "cold", s / static_cast<double>(n) * 1e9,
              static_cast<double>(n) * 2.0 * static_cast<double>(d * sizeof(T)) / s * 1e-9);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  floe::thread_pool pool(1);
  const floe::bench::stream_reader reader(std::size_t{1} << 30);
  std::printf("kernels %s\n", std::string(floe::simd_arch_name(floe::exec::simd().arch())).c_str());
  std::printf("stream read, 1 thread: %.1f GB/s\n", reader.measure(pool, 3).median_gbps);
  for (const bool hot : {true, false}) {
    if (!only.empty() && only != (hot ? "hot" : "cold")) continue;
    measure<floe::half>("fp16", 128, 4, hot);
    measure<floe::bfloat16>("bf16", 128, 4, hot);
    measure<floe::half>("fp16", 64, 3, hot);
    measure<floe::bfloat16>("bf16", 64, 3, hot);
  }
  std::printf("stream read, 1 thread: %.1f GB/s\n", reader.measure(pool, 3).median_gbps);
  return 0;
}
