// 4-bit keys of one (layer, KV head) with a per-(token, block) offset and scale, and
// the scan that turns them into score estimates with deterministic error bounds.
// docs/methods/retrieval-completion.md, "quantized_scan".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/index/directed_half.hpp"

namespace floe {

// A query group prepared for scanning: scaled rows s*q_h, and per block their sums and
// L1 norms (the offset term and the error radius of the block).
struct quantized_query {
  index_t heads = 0, d = 0, blocks = 0;
  std::vector<float> rows;     // [heads, d]: s * q_h
  std::vector<float> sums;     // [heads, blocks]
  std::vector<float> l1;       // [heads, blocks]
};

class quantized_keys {
 public:
  // Dimensions per block; each block of a token has its own offset and scale.
  static constexpr index_t block_dims = 32;

  quantized_keys() = default;

  template <KvView KV>
  static quantized_keys build(const KV& kv) {
    quantized_keys idx;
    idx.d_ = kv.d();
    idx.blocks_ = (kv.d() + block_dims - 1) / block_dims;
    idx.code_bytes_ = 0;
    for (index_t b = 0; b < idx.blocks_; ++b) idx.code_bytes_ += (idx.block_length(b) + 1) / 2;
    idx.append(kv);
    return idx;
  }

  // Quantises the tokens [tokens(), kv.n()) of a cache that grew by decoding.
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.d() == d_, "kv", "index built for d = ", d_, ", the view has d = ", kv.d());
    require(kv.n() >= n_, "kv", "the view holds ", kv.n(), " tokens, fewer than the ", n_, " the index covers");
    codes_.resize(kv.n() * code_bytes_);
    params_.resize(kv.n() * blocks_ * 2);
    std::vector<float> row(d_);
    for (index_t i = n_; i < kv.n(); ++i) {
      const auto* k = kv.key_row(i);
      for (index_t t = 0; t < d_; ++t) {
        row[t] = to_float(k[t]);
        require(std::isfinite(row[t]) && std::fabs(row[t]) <= 60000.f, "keys", "key ", i, " element ", t, " is ",
                row[t], ": the 4-bit index holds finite keys of magnitude <= 60000");
      }
      quantize_row(row.data(), codes_.data() + i * code_bytes_, params_.data() + i * blocks_ * 2);
    }
    n_ = kv.n();
  }

  index_t tokens() const { return n_; }
  index_t d() const { return d_; }
  // Bytes the scan reads per token: codes plus offset and scale of every block.
  index_t bytes_per_token() const { return code_bytes_ + blocks_ * 2 * sizeof(half); }
  std::uint64_t bytes() const { return static_cast<std::uint64_t>(n_) * bytes_per_token(); }

  quantized_query prepare(const query_group& q) const {
    quantized_query p{q.heads, d_, blocks_, std::vector<float>(q.heads * d_), std::vector<float>(q.heads * blocks_),
                      std::vector<float>(q.heads * blocks_)};
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t b = 0; b < blocks_; ++b) {
        float sum = 0.f, l1 = 0.f;
        for (index_t t = b * block_dims; t < b * block_dims + block_length(b); ++t) {
          const float x = q.scale * q.row(h)[t];
          p.rows[h * d_ + t] = x;
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
  void scan(const quantized_query& p, index_t begin, index_t end, float* center, float* radius, index_t ld) const {
    float codes[block_dims];
    for (index_t i = begin; i < end; ++i) {
      const std::uint8_t* c = codes_.data() + i * code_bytes_;
      const half* prm = params_.data() + i * blocks_ * 2;
      for (index_t h = 0; h < p.heads; ++h) center[h * ld + i - begin] = radius[h * ld + i - begin] = 0.f;
      for (index_t b = 0; b < blocks_; ++b) {
        const index_t len = block_length(b), half_len = (len + 1) / 2;
        for (index_t j = 0; j < half_len; ++j) {
          codes[j] = static_cast<float>(c[j] & 15u);
          codes[j + half_len] = static_cast<float>(c[j] >> 4);
        }
        const float offset = prm[2 * b].to_float(), scale = prm[2 * b + 1].to_float();
        // Rounding to the nearest code leaves scale/2 per element; the rest covers float
        // rounding of the dot products here and in any executor's exact score.
        const float spread = scale * (0.5f + 1e-4f) + 4e-5f * (std::fabs(offset) + 16.f * scale);
        for (index_t h = 0; h < p.heads; ++h) {
          const float* qb = p.rows.data() + h * d_ + b * block_dims;
          const float dot = len == block_dims ? dot32(qb, codes) : dot_n(qb, codes, len);
          center[h * ld + i - begin] += offset * p.sums[h * blocks_ + b] + scale * dot;
          radius[h * ld + i - begin] += spread * p.l1[h * blocks_ + b];
        }
        c += half_len;
      }
    }
  }

 private:
  index_t block_length(index_t b) const { return std::min(block_dims, d_ - b * block_dims); }

  // Block layout: byte j holds element j (low nibble) and element j + ceil(len/2) (high).
  void quantize_row(const float* row, std::uint8_t* codes, half* params) const {
    for (index_t b = 0; b < blocks_; ++b) {
      const float* x = row + b * block_dims;
      const index_t len = block_length(b), half_len = (len + 1) / 2;
      const auto [lo, hi] = std::minmax_element(x, x + len);
      // Offset rounded down and scale rounded up, so every element lies in [offset, offset + 15 scale].
      const half offset = detail::half_not_above(*lo);
      const float off = offset.to_float();
      const half scale = detail::half_not_below((*hi - off) / 15.f * (1.f + 1e-6f));
      const float sc = scale.to_float();
      params[2 * b] = offset;
      params[2 * b + 1] = scale;
      for (index_t j = 0; j < half_len; ++j) {
        const std::uint8_t low = code(x[j], off, sc);
        const std::uint8_t high = j + half_len < len ? code(x[j + half_len], off, sc) : 0;
        codes[j] = static_cast<std::uint8_t>(low | (high << 4));
      }
      codes += half_len;
    }
  }

  static std::uint8_t code(float x, float offset, float scale) {
    if (!(scale > 0.f)) return 0;
    const float c = std::nearbyint((x - offset) / scale);
    return static_cast<std::uint8_t>(std::clamp(c, 0.f, 15.f));
  }

  // Eight independent lanes so that the compiler vectorises without reassociating.
  static float dot32(const float* q, const float* c) {
    float acc[8] = {};
    for (index_t t = 0; t < block_dims; t += 8)
      for (index_t l = 0; l < 8; ++l) acc[l] += q[t + l] * c[t + l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  static float dot_n(const float* q, const float* c, index_t len) {
    float acc = 0.f;
    for (index_t t = 0; t < len; ++t) acc += q[t] * c[t];
    return acc;
  }

  index_t n_ = 0, d_ = 0, blocks_ = 0, code_bytes_ = 0;
  std::vector<std::uint8_t> codes_;  // [n, code_bytes]
  std::vector<half> params_;         // [n, blocks, 2]: offset, scale
};

}  // namespace floe
