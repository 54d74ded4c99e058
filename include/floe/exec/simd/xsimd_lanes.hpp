// The lane type of the attend kernels for an xsimd architecture A. Isa supplies what needs
// each instruction set's own intrinsics: 16-bit loads and the transposed row sum.
#pragma once

#include <cstdint>

#include <xsimd/xsimd.hpp>

#include "floe/exec/simd/kernel_api.hpp"

namespace floe::simd_detail {

template <class A, class Isa>
struct xsimd_lanes {
  using vec = xsimd::batch<float, A>;
  static constexpr index_t width = vec::size;
  static constexpr index_t accumulators = Isa::accumulators;  // vector accumulators a kernel may keep live
  static constexpr index_t max_chunks = Isa::max_chunks;      // value chunks loaded per token at once
  static constexpr bool pairs = true;                          // has load_pair and unpair

  static vec zero() { return vec(0.f); }
  static vec splat(float x) { return vec(x); }
  static vec load(const float* p) { return vec::load_unaligned(p); }
  static vec load(const half* p) { return vec(Isa::load(p)); }
  static vec load(const bfloat16* p) { return vec(Isa::load(p)); }
  // 2 * width bf16 from p: the even-indexed elements into `even`, the odd into `odd`
  // (one shift and one mask, half the work of widening them in order).
  static void load_pair(const bfloat16* p, vec& even, vec& odd) {
    typename Isa::pair_bits bits;
    Isa::load_pair(p, bits);
    even = vec(Isa::even_of(bits));
    odd = vec(Isa::odd_of(bits));
  }
  // (even, odd) lanes of 2 * width elements back to their order: elements [0, width) into
  // `even`, [width, 2 * width) into `odd`.
  static void unpair(vec& even, vec& odd) {
    const auto lo = Isa::interleave_lo(even, odd), hi = Isa::interleave_hi(even, odd);
    even = vec(lo);
    odd = vec(hi);
  }
  static float scalar(float x) { return x; }
  static float scalar(half x) { return Isa::scalar(x); }
  static float scalar(bfloat16 x) {
    const std::uint32_t bits = static_cast<std::uint32_t>(x.bits) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
  }
  static void store(float* p, const vec& v) { v.store_unaligned(p); }
  static vec fma(const vec& a, const vec& b, const vec& c) { return xsimd::fma(a, b, c); }
  static vec max(const vec& a, const vec& b) { return xsimd::max(a, b); }
  static vec exp(const vec& v) { return xsimd::exp(v); }
  static float hadd(const vec& v) { return xsimd::hadd(v); }
  static float hmax(const vec& v) { return Isa::hmax(v); }
  // Lane i of the result is the sum of the lanes of rows[i], i < width.
  static vec sum_rows(const vec* rows) { return vec(Isa::sum_rows(rows)); }
};

}  // namespace floe::simd_detail
