// 4-bit keys of one (layer, KV head) with a per-(token, block) offset and scale, and
// the scan that turns them into score estimates with deterministic error bounds.
// Tokens are stored in tiles of 16, element-major inside a tile, so that the scan runs
// across the 16 tokens of a tile in vector lanes without reassociating any sum.
// docs/methods/retrieval-completion.md, "quantized_scan".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/index/directed_half.hpp"
#include "floe/index/widen.hpp"

namespace floe {

// A query group prepared for scanning: scaled rows s*q_h (zero-padded to whole blocks),
// and per block their sums and L1 norms (the offset term and the error radius).
struct quantized_query {
  index_t heads = 0, padded_d = 0, blocks = 0;
  std::vector<float> rows;  // [heads, padded_d]: s * q_h
  std::vector<float> sums;  // [heads, blocks]
  std::vector<float> l1;    // [heads, blocks]
};

class quantized_keys {
 public:
  static constexpr index_t block_dims = 32;  // elements per block: one offset and scale each
  static constexpr index_t tile_tokens = 16;

  quantized_keys() = default;

  template <KvView KV>
  static quantized_keys build(const KV& kv) {
    quantized_keys idx;
    idx.d_ = kv.d();
    idx.blocks_ = (kv.d() + block_dims - 1) / block_dims;
    idx.append(kv);
    return idx;
  }

  // Quantises the tokens [tokens(), kv.n()) of a cache that grew by decoding.
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.d() == d_, "kv", "index built for d = ", d_, ", the view has d = ", kv.d());
    require(kv.n() >= n_, "kv", "the view holds ", kv.n(), " tokens, fewer than the ", n_, " the index covers");
    const index_t tiles = (kv.n() + tile_tokens - 1) / tile_tokens;
    codes_.resize(tiles * tile_code_bytes(), 0);
    params_.resize(tiles * tile_params(), half{});
    std::vector<float> row(blocks_ * block_dims, 0.f);
    for (index_t i = n_; i < kv.n(); ++i) {
      const auto* k = kv.key_row(i);
      for (index_t t = 0; t < d_; ++t) {
        row[t] = to_float(k[t]);
        require(std::isfinite(row[t]) && std::fabs(row[t]) <= 60000.f, "keys", "key ", i, " element ", t, " is ",
                row[t], ": the 4-bit index holds finite keys of magnitude <= 60000");
      }
      quantize_row(row.data(), i);
    }
    n_ = kv.n();
  }

  index_t tokens() const { return n_; }
  index_t d() const { return d_; }
  // Bytes the scan reads per token: codes plus the offset and scale of every block.
  index_t bytes_per_token() const { return blocks_ * (block_dims / 2 + 2 * sizeof(half)); }
  std::uint64_t bytes() const { return static_cast<std::uint64_t>(n_) * bytes_per_token(); }

  quantized_query prepare(const query_group& q) const {
    const index_t pd = blocks_ * block_dims;
    quantized_query p{q.heads, pd, blocks_, std::vector<float>(q.heads * pd, 0.f),
                      std::vector<float>(q.heads * blocks_), std::vector<float>(q.heads * blocks_)};
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t b = 0; b < blocks_; ++b) {
        float sum = 0.f, l1 = 0.f;
        for (index_t t = b * block_dims; t < std::min(d_, (b + 1) * block_dims); ++t) {
          const float x = q.scale * q.row(h)[t];
          p.rows[h * pd + t] = x;
          sum += x;
          l1 += std::fabs(x);
        }
        p.sums[h * blocks_ + b] = sum;
        p.l1[h * blocks_ + b] = l1;
      }
    return p;
  }

  // For tokens [begin, end) and every head h: center[h * ld + i - begin] estimates the
  // score z = s q_h . k_i, and |z - center| <= radius (same layout), however z is rounded.
  // Vectorised across the 16 tokens of a tile (xsimd, the instruction set compiled for),
  // up to 4 heads per pass so that their sums stay in registers.
  void scan(const quantized_query& p, index_t begin, index_t end, float* center, float* radius, index_t ld) const {
    constexpr index_t T = tile_tokens;
    alignas(64) float out_c[heads_per_pass * T], out_r[heads_per_pass * T];
    for (index_t tile = begin / T; tile * T < end; ++tile) {
      const index_t first = std::max(begin, tile * T), last = std::min(end, (tile + 1) * T);
      for (index_t h0 = 0; h0 < p.heads; h0 += heads_per_pass) {
        const index_t hn = std::min(heads_per_pass, p.heads - h0);
        switch (hn) {
          case 1: scan_tile<1>(p, h0, tile, out_c, out_r); break;
          case 2: scan_tile<2>(p, h0, tile, out_c, out_r); break;
          case 3: scan_tile<3>(p, h0, tile, out_c, out_r); break;
          default: scan_tile<4>(p, h0, tile, out_c, out_r); break;
        }
        for (index_t h = 0; h < hn; ++h)
          for (index_t i = first; i < last; ++i) {
            center[(h0 + h) * ld + i - begin] = out_c[h * T + i - tile * T];
            radius[(h0 + h) * ld + i - begin] = out_r[h * T + i - tile * T];
          }
      }
    }
  }

 private:
  static constexpr index_t heads_per_pass = 4;

  // Centers and radii of heads [h0, h0 + H) for the 16 tokens of one tile.
  template <index_t H>
  void scan_tile(const quantized_query& p, index_t h0, index_t tile, float* out_c, float* out_r) const {
    using lanes = xsimd::batch<float>;
    constexpr index_t T = tile_tokens, L = lanes::size, V = T / L;
    static_assert(T % L == 0, "a tile must hold whole vectors");
    const std::uint8_t* c = codes_.data() + tile * tile_code_bytes();
    const half* prm = params_.data() + tile * tile_params();
    alignas(64) float offset[T], scale[T], spread[T], even[T], odd[T];
    lanes centers[H][V], radii[H][V];
    for (index_t h = 0; h < H; ++h)
      for (index_t v = 0; v < V; ++v) centers[h][v] = radii[h][v] = lanes(0.f);
    for (index_t b = 0; b < blocks_; ++b) {
      widen(prm + b * 2 * T, offset);
      widen(prm + b * 2 * T + T, scale);
      // Rounding to the nearest code leaves scale/2 per element; the rest covers float
      // rounding of the dot products here and in any executor's exact score.
      for (index_t j = 0; j < T; ++j)
        spread[j] = scale[j] * (0.5f + 1e-4f) + 4e-5f * (std::fabs(offset[j]) + 16.f * scale[j]);
      lanes dot[H][V], dot_odd[H][V];  // two chains per head: FMA latency, not throughput, binds
      for (index_t h = 0; h < H; ++h)
        for (index_t v = 0; v < V; ++v) dot[h][v] = dot_odd[h][v] = lanes(0.f);
      const std::uint8_t* cb = c + b * (block_dims / 2) * T;
      for (index_t pair = 0; pair < block_dims / 2; ++pair) {
        for (index_t j = 0; j < T; ++j) {
          const int byte = cb[pair * T + j];  // signed: converts to float in vector lanes
          even[j] = static_cast<float>(byte & 15);
          odd[j] = static_cast<float>(byte >> 4);
        }
        for (index_t v = 0; v < V; ++v) {
          const lanes e = lanes::load_aligned(even + v * L), o = lanes::load_aligned(odd + v * L);
          for (index_t h = 0; h < H; ++h) {
            const float* qb = p.rows.data() + (h0 + h) * p.padded_d + b * block_dims + 2 * pair;
            dot[h][v] = xsimd::fma(lanes(qb[0]), e, dot[h][v]);
            dot_odd[h][v] = xsimd::fma(lanes(qb[1]), o, dot_odd[h][v]);
          }
        }
      }
      for (index_t h = 0; h < H; ++h) {
        const lanes sum(p.sums[(h0 + h) * blocks_ + b]), l1(p.l1[(h0 + h) * blocks_ + b]);
        for (index_t v = 0; v < V; ++v) {
          dot[h][v] += dot_odd[h][v];
          centers[h][v] = xsimd::fma(lanes::load_aligned(offset + v * L), sum,
                                     xsimd::fma(lanes::load_aligned(scale + v * L), dot[h][v], centers[h][v]));
          radii[h][v] = xsimd::fma(lanes::load_aligned(spread + v * L), l1, radii[h][v]);
        }
      }
    }
    for (index_t h = 0; h < H; ++h)
      for (index_t v = 0; v < V; ++v) {
        centers[h][v].store_aligned(out_c + h * T + v * L);
        radii[h][v].store_aligned(out_r + h * T + v * L);
      }
  }

  // Codes of a tile: [element pair][16 bytes]; byte j holds token j's even element (low
  // nibble) and odd element (high nibble). Params of a tile: [block][offset x16, scale x16].
  index_t tile_code_bytes() const { return blocks_ * (block_dims / 2) * tile_tokens; }
  index_t tile_params() const { return blocks_ * 2 * tile_tokens; }

  // Offsets and scales are finite by construction (keys are checked at append).
  static void widen(const half* src, float* dst) { detail::widen_finite(src, dst, tile_tokens); }

  // Offset rounded down and scale rounded up, so every element lies in [offset, offset + 15 scale].
  void quantize_row(const float* row, index_t i) {
    const index_t tile = i / tile_tokens, j = i % tile_tokens;
    std::uint8_t* c = codes_.data() + tile * tile_code_bytes();
    half* prm = params_.data() + tile * tile_params();
    for (index_t b = 0; b < blocks_; ++b) {
      const float* x = row + b * block_dims;
      const index_t len = std::min(block_dims, d_ - b * block_dims);
      const auto [lo, hi] = std::minmax_element(x, x + len);
      const half offset = detail::half_not_above(*lo);
      const float off = offset.to_float();
      const half scale = detail::half_not_below((*hi - off) / 15.f * (1.f + 1e-6f));
      const float sc = scale.to_float();
      prm[b * 2 * tile_tokens + j] = offset;
      prm[b * 2 * tile_tokens + tile_tokens + j] = scale;
      for (index_t t = 0; t < len; ++t) {
        std::uint8_t& byte = c[(b * block_dims + t) / 2 * tile_tokens + j];
        const std::uint8_t q = code(x[t], off, sc);
        byte = t % 2 == 0 ? static_cast<std::uint8_t>((byte & 0xf0u) | q)
                          : static_cast<std::uint8_t>((byte & 0x0fu) | (q << 4));
      }
    }
  }

  static std::uint8_t code(float x, float offset, float scale) {
    if (!(scale > 0.f)) return 0;
    const float c = std::nearbyint((x - offset) / scale);
    return static_cast<std::uint8_t>(std::clamp(c, 0.f, 15.f));
  }

  index_t n_ = 0, d_ = 0, blocks_ = 0;
  std::vector<std::uint8_t> codes_;  // [tiles, tile_code_bytes]
  std::vector<half> params_;         // [tiles, tile_params]
};

}  // namespace floe
