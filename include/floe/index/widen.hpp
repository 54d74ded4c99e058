// Element rows to float without branches, so that the loops vectorise: the gathers of
// the re-rank and of the feature-map subtraction convert thousands of scattered rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "floe/core/numeric_types.hpp"

namespace floe::detail {

// dst[0..n) = src[0..n) as float, exactly (Inf and NaN included).
template <KvElement T>
inline void widen(const T* src, float* dst, index_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    for (index_t j = 0; j < n; ++j) dst[j] = bits_float(static_cast<std::uint32_t>(src[j].bits) << 16);
  } else {
    index_t j = 0;
#if defined(__AVX512F__)
    // The hardware conversion where the caller's flags allow it: exact, Inf and NaN kept.
    for (; j + 16 <= n; j += 16)
      _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
#elif defined(__F16C__)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
    for (; j < n; ++j) {
      const std::uint32_t h = src[j].bits, em = h & 0x7fffu;
      // Exponent and mantissa moved into float position, rescaled by 2^112: exact for
      // normal and subnormal halves. Inf and NaN keep the all-ones exponent instead.
      const std::uint32_t finite = float_bits(bits_float(em << 13) * 5.192296858534828e33f);
      const std::uint32_t special = 0x7f800000u | ((em & 0x3ffu) << 13);
      dst[j] = bits_float((em >= 0x7c00u ? special : finite) | ((h & 0x8000u) << 16));
    }
  }
}

// half -> float for values known to be finite (normal, subnormal or zero): the same
// rescaling without the Inf/NaN select, which keeps the loop a few vector instructions.
inline void widen_finite(const half* src, float* dst, index_t n) {
  for (index_t j = 0; j < n; ++j) {
    const std::uint32_t h = src[j].bits;
    const float magnitude = bits_float((h & 0x7fffu) << 13) * 5.192296858534828e33f;  // 2^112
    dst[j] = bits_float(float_bits(magnitude) | ((h & 0x8000u) << 16));
  }
}

// Asks for the cache lines of a row that will be read soon (scattered gathers), into L2:
// into L1 the cached-feature phase ran 2.6-3.1 ms, into L2 2.0-2.3 ms (4 heads, g = 1, cold).
template <KvElement T>
inline void prefetch_row(const T* row, index_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (index_t byte = 0; byte < n * sizeof(T); byte += 64) __builtin_prefetch(p + byte, 0, 2);
}

}  // namespace floe::detail
