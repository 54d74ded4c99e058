// The AVX2 kernels (AVX2 + FMA + F16C, as xsimd's fma3<avx2>). Compiled once, into the
// floe::simd library, with -mavx2 -mfma -mf16c (cmake/FloeSimd.cmake); include
// floe/exec/simd.hpp instead.
#pragma once

#if !defined(FLOE_SIMD_BUILDING_LIBRARY)
#error "floe/exec/simd/instantiate_avx2.ipp is compiled only into floe::simd; include floe/exec/simd.hpp"
#endif

#include <immintrin.h>

#include "floe/exec/simd/attend_kernel.hpp"
#include "floe/exec/simd/xsimd_lanes.hpp"

namespace floe::simd_detail {

// 8 fp16 -> fp32 (F16C vcvtph2ps); bf16 is the upper half of an fp32.
struct avx2_isa {
  static constexpr index_t accumulators = 8;  // of 16 ymm registers
  static constexpr index_t max_chunks = 4;
  static __m256 load(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m256 load(const bfloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  using pair_bits = __m256i;  // 16 bf16
  static void load_pair(const bfloat16* p, __m256i& bits) { bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256 even_of(__m256i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
  static __m256 odd_of(__m256i bits) { return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(-65536))); }
  // unpack works within 128-bit halves: [0-3 | 8-11] and [4-7 | 12-15], then swap halves.
  static __m256 interleave_lo(__m256 even, __m256 odd) {
    return _mm256_permute2f128_ps(_mm256_unpacklo_ps(even, odd), _mm256_unpackhi_ps(even, odd), 0x20);
  }
  static __m256 interleave_hi(__m256 even, __m256 odd) {
    return _mm256_permute2f128_ps(_mm256_unpacklo_ps(even, odd), _mm256_unpackhi_ps(even, odd), 0x31);
  }
  static float scalar(half h) { return _cvtsh_ss(h.bits); }
  static float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  template <class Batch>
  static __m256 sum_rows(const Batch* rows) { return xsimd::haddp(rows); }
};

extern constinit const kernel_set avx2_kernel_set;
constinit const kernel_set avx2_kernel_set =
    make_kernel_set<xsimd_lanes<xsimd::fma3<xsimd::avx2>, avx2_isa>>(simd_arch::avx2);

}  // namespace floe::simd_detail
