// The portable kernels (one float per lane, no SIMD flags) and the registry of every
// architecture floe::simd was built with. Compiled once, into the floe::simd library
// (cmake/FloeSimd.cmake); include floe/exec/simd.hpp instead.
#pragma once

#if !defined(FLOE_SIMD_BUILDING_LIBRARY)
#error "floe/exec/simd/instantiate_scalar.ipp is compiled only into floe::simd; include floe/exec/simd.hpp"
#endif

#include "floe/exec/simd/attend_kernel.hpp"

namespace floe::simd_detail {

// The same kernels with a lane of one float: the fallback for any CPU.
struct scalar_lanes {
  using vec = float;
  static constexpr index_t width = 1;
  static constexpr index_t accumulators = 8;
  static constexpr index_t max_chunks = 4;
  static constexpr bool pairs = false;

  static float zero() { return 0.f; }
  static float splat(float x) { return x; }
  static float load(const float* p) { return *p; }
  static float load(const half* p) { return p->to_float(); }
  static float load(const bfloat16* p) { return p->to_float(); }
  static float scalar(float x) { return x; }
  static float scalar(half x) { return x.to_float(); }
  static float scalar(bfloat16 x) { return x.to_float(); }
  static void store(float* p, float v) { *p = v; }
  static float fma(float a, float b, float c) { return a * b + c; }
  static float max(float a, float b) { return a > b ? a : b; }
  static float exp(float v) { return __builtin_expf(v); }
  static float hadd(float v) { return v; }
  static float hmax(float v) { return v; }
  static float sum_rows(const float* rows) { return rows[0]; }
};

constinit const kernel_set scalar_kernel_set = make_kernel_set<scalar_lanes>(simd_arch::scalar);

#if FLOE_SIMD_WITH_AVX2
extern constinit const kernel_set avx2_kernel_set;
#endif
#if FLOE_SIMD_WITH_AVX512
extern constinit const kernel_set avx512_kernel_set;
#endif

const kernel_set* compiled_kernels(simd_arch target) noexcept {
  switch (target) {
    case simd_arch::scalar: return &scalar_kernel_set;
#if FLOE_SIMD_WITH_AVX2
    case simd_arch::avx2: return &avx2_kernel_set;
#endif
#if FLOE_SIMD_WITH_AVX512
    case simd_arch::avx512: return &avx512_kernel_set;
#endif
    default: return nullptr;
  }
}

}  // namespace floe::simd_detail
