// The AVX-512 kernels (F/CD/DQ/BW/VL, as xsimd's avx512bw). Compiled once, into the
// floe::simd library, with -mavx512f -mavx512cd -mavx512dq -mavx512bw -mavx512vl -mfma
// -mf16c (cmake/FloeSimd.cmake); include floe/exec/simd.hpp instead.
#pragma once

#if !defined(FLOE_SIMD_BUILDING_LIBRARY)
#error "floe/exec/simd/instantiate_avx512.ipp is compiled only into floe::simd; include floe/exec/simd.hpp"
#endif

// GCC 12's own _mm512_undefined_ps() trips -W(maybe-)uninitialized (GCC PR 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include "floe/exec/simd/attend_kernel.hpp"
#include "floe/exec/simd/xsimd_lanes.hpp"

namespace floe::simd_detail {

// 16 fp16 -> fp32 (AVX-512F vcvtph2ps); bf16 is the upper half of an fp32.
struct avx512_isa {
  static constexpr index_t accumulators = 16;  // of 32 zmm registers
  static constexpr index_t max_chunks = 8;
  static __m512 load(const half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load(const bfloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  using pair_bits = __m512i;  // 32 bf16
  static void load_pair(const bfloat16* p, __m512i& bits) { bits = _mm512_loadu_si512(p); }
  static __m512 even_of(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
  static __m512 odd_of(__m512i bits) { return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(-65536))); }
  static __m512 interleave_lo(__m512 even, __m512 odd) {
    return _mm512_permutex2var_ps(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
  }
  static __m512 interleave_hi(__m512 even, __m512 odd) {
    return _mm512_permutex2var_ps(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                                  odd);
  }
  static float scalar(half h) { return _cvtsh_ss(h.bits); }
  static float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

  // Lane i = sum of rows[i]: halve 256-, then 128-bit lanes, then a 4x4 transpose-add.
  // (xsimd 8.1's AVX-512 haddp returns the lanes out of order.)
  template <class Batch>
  static __m512 sum_rows(const Batch* rows) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; ++k) {
      const __m512 x = rows[2 * k], y = rows[2 * k + 1];
      a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int k = 0; k < 4; ++k)  // 128-bit lane j of b[k] holds 4 partial sums of row 4k + j
      b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                           _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c0, c1, 0x44), _mm512_shuffle_ps(c0, c1, 0xEE));
    // Element 4j + m of d is the sum of row 4m + j.
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
  }
};

extern constinit const kernel_set avx512_kernel_set;
constinit const kernel_set avx512_kernel_set =
    make_kernel_set<xsimd_lanes<xsimd::avx512bw, avx512_isa>>(simd_arch::avx512);

}  // namespace floe::simd_detail
