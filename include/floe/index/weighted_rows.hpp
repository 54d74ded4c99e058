// out[h, :] += sum_r u[h, r] * rows[r, :]: the weighted sum of a chunk of rows for a few
// heads at once, with each block of 4 heads x 4 vectors of columns kept in registers
// across the rows (a row-by-row update in memory loads and stores every output vector
// once per row: the feature-map subtraction spent most of its time there).
#pragma once

#include <algorithm>
#include <utility>
#include <xsimd/xsimd.hpp>

#include "floe/core/numeric_types.hpp"

namespace floe::detail {

using weighted_lanes = xsimd::batch<float>;
// Row strides of `rows` and `out` are multiples of this many floats (zero-padded columns).
constexpr index_t weighted_block_floats = 4 * weighted_lanes::size;

// Rounds a row width up to the stride add_weighted_rows needs.
constexpr index_t weighted_stride(index_t width) {
  return (width + weighted_block_floats - 1) / weighted_block_floats * weighted_block_floats;
}

template <std::size_t... H>
inline void add_weighted_head_block(const float* u, index_t u_stride, const float* rows, index_t count, index_t stride,
                                    float* out, index_t out_stride, std::index_sequence<H...>) {
  using lanes = weighted_lanes;
  constexpr index_t L = lanes::size;
  for (index_t c = 0; c < stride; c += 4 * L) {
    lanes acc[sizeof...(H)][4];
    for (auto& head : acc)
      for (auto& x : head) x = lanes(0.f);
    for (index_t r = 0; r < count; ++r) {
      const float* row = rows + r * stride + c;
      const lanes v0 = lanes::load_unaligned(row), v1 = lanes::load_unaligned(row + L),
                  v2 = lanes::load_unaligned(row + 2 * L), v3 = lanes::load_unaligned(row + 3 * L);
      auto one_head = [&](auto h) {
        const lanes w(u[h * u_stride + r]);
        acc[h][0] = xsimd::fma(w, v0, acc[h][0]);
        acc[h][1] = xsimd::fma(w, v1, acc[h][1]);
        acc[h][2] = xsimd::fma(w, v2, acc[h][2]);
        acc[h][3] = xsimd::fma(w, v3, acc[h][3]);
      };
      (one_head(std::integral_constant<std::size_t, H>{}), ...);
    }
    for (std::size_t h = 0; h < sizeof...(H); ++h)
      for (index_t k = 0; k < 4; ++k) {
        float* o = out + h * out_stride + c + k * L;
        (lanes::load_unaligned(o) + acc[h][k]).store_unaligned(o);
      }
  }
}

// out[h * out_stride + j] += sum_{r < count} u[h * u_stride + r] * rows[r * stride + j]
// for h < heads and j < stride; stride and out_stride from weighted_stride().
inline void add_weighted_rows(const float* u, index_t u_stride, index_t heads, const float* rows, index_t count,
                              index_t stride, float* out, index_t out_stride) {
  for (index_t h0 = 0; h0 < heads; h0 += 4) {
    const float* uh = u + h0 * u_stride;
    float* oh = out + h0 * out_stride;
    switch (std::min<index_t>(4, heads - h0)) {
      case 1: add_weighted_head_block(uh, u_stride, rows, count, stride, oh, out_stride, std::make_index_sequence<1>{}); break;
      case 2: add_weighted_head_block(uh, u_stride, rows, count, stride, oh, out_stride, std::make_index_sequence<2>{}); break;
      case 3: add_weighted_head_block(uh, u_stride, rows, count, stride, oh, out_stride, std::make_index_sequence<3>{}); break;
      default: add_weighted_head_block(uh, u_stride, rows, count, stride, oh, out_stride, std::make_index_sequence<4>{});
    }
  }
}

}  // namespace floe::detail
