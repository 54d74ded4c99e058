#include "stream_read.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace floe::bench {

namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f"))) std::uint64_t sum_avx512(const std::uint64_t* p, std::size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 24));
  }
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  std::uint64_t s = 0;
  for (auto x : lanes) s += x;
  for (; i < n; ++i) s += p[i];
  return s;
}

__attribute__((target("avx2"))) std::uint64_t sum_avx2(const std::uint64_t* p, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  std::uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif

std::uint64_t sum_plain(const std::uint64_t* p, std::size_t n) {
  std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
  for (; i < n; ++i) s0 += p[i];
  return s0 + s1 + s2 + s3;
}

// Runs pass() once to warm up, then `repetitions` times; each pass returns the seconds it
// timed and reads `bytes`. The sums stay alive through `sums`.
template <class Pass>
stream_result timed_passes(Pass&& pass, int repetitions, std::size_t bytes, const std::vector<std::uint64_t>& sums) {
  pass();
  std::vector<double> gbps;
  for (int r = 0; r < repetitions; ++r) gbps.push_back(static_cast<double>(bytes) / pass() * 1e-9);
  volatile std::uint64_t sink = 0;
  for (auto x : sums) sink = sink + x;
  std::sort(gbps.begin(), gbps.end());
  return {gbps[gbps.size() / 2], gbps.back(), bytes};
}

}  // namespace

std::uint64_t stream_sum(const std::uint64_t* words, std::size_t count) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return sum_avx512(words, count);
  if (__builtin_cpu_supports("avx2")) return sum_avx2(words, count);
#endif
  return sum_plain(words, count);
}

stream_reader::stream_reader(std::size_t bytes, bool huge_pages)
    : words_(bytes / 64 * 8), buffer_(nullptr, &std::free) {
  const std::size_t align = huge_pages ? std::size_t{2} << 20 : 64;  // aligned like the KV caches
  const std::size_t size = (words_ * 8 + align - 1) / align * align;
  buffer_.reset(std::aligned_alloc(align, size));
  if (!buffer_) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
  if (huge_pages) madvise(buffer_.get(), size, MADV_HUGEPAGE);
#endif
  auto* data = static_cast<std::uint64_t*>(buffer_.get());
  for (std::size_t i = 0; i < words_; ++i) data[i] = i;
  data_ = data;
}

stream_result stream_reader::measure(thread_pool& pool, int repetitions) const {
  const std::size_t threads = pool.size();
  const std::size_t per_thread = words_ / threads / 8 * 8;  // whole cache lines
  std::vector<std::uint64_t> sums(threads);
  auto pass = [&] {  // the first (untimed) one warms up the threads and the TLB
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(threads, [&](index_t t) { sums[t] = stream_sum(data_ + t * per_thread, per_thread); });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  return timed_passes(pass, repetitions, per_thread * threads * 8, sums);
}

stream_result stream_reader::measure_scattered(thread_pool& pool, std::size_t chunk_bytes, std::size_t spread,
                                              int repetitions) const {
  const std::size_t chunk_words = std::max<std::size_t>(8, chunk_bytes / 64 * 8);
  const std::size_t stretches = words_ / chunk_words / std::max<std::size_t>(1, spread);
  const std::size_t threads = pool.size(), per_thread = stretches / threads;
  if (per_thread == 0) return {};  // too few chunks for the threads: no measurement
  std::vector<std::uint64_t> sums(threads);
  std::vector<std::size_t> chosen(stretches);  // word offset of each stretch's chunk
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  auto pass = [&] {
    for (std::size_t s = 0; s < stretches; ++s) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;  // a fresh place per pass
      chosen[s] = (s * spread + (state >> 33) % spread) * chunk_words;
    }
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(threads, [&](index_t t) {
      std::uint64_t sum = 0;
      for (std::size_t s = t * per_thread; s < (t + 1) * per_thread; ++s) {
        if (s + 1 < (t + 1) * per_thread) {
          const char* next = reinterpret_cast<const char*>(data_ + chosen[s + 1]);
          for (std::size_t b = 0; b < chunk_words * 8; b += 64) __builtin_prefetch(next + b, 0, 2);
        }
        sum += stream_sum(data_ + chosen[s], chunk_words);
      }
      sums[t] = sum;
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  return timed_passes(pass, repetitions, per_thread * threads * chunk_words * 8, sums);
}

}  // namespace floe::bench
