// 2-bit codes of keys standardised by their cluster's Gaussian, u_t = (k_t - mu_t) / sigma_t,
// rounded to the Lloyd-Max levels of N(0, 1): the token scan's cheaper alternative to
// quantized_keys (d/4 bytes a token, no offsets or scales; docs/methods/mog.md, "Token scan").
// The score estimate is s q.mu + sum_t (s q_t sigma_t) level(code_t): the mean and spread of
// each cluster are kept here as built, so that later appends to the summaries leave it intact.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/query.hpp"
#include "floe/index/quantized_scan_kernels.hpp"

namespace floe {

class residual_codes {
 public:
  static constexpr index_t tile_tokens = 16;  // a tile's codes of element t are one 32-bit word
  // Lloyd-Max quantiser of N(0, 1) with four levels (Max, 1960): cells split at 0 and
  // +-0.9816, each level its cell's mean, so the rounding error is uncorrelated with the level.
  static constexpr float inner_level = 0.4528f, outer_level = 1.5104f, split = 0.9816f;
  static constexpr std::array<float, 4> levels{-outer_level, -inner_level, inner_level, outer_level};

  residual_codes() = default;

  // rows: n keys of d floats (row-major, consecutive); cluster c holds rows
  // [cluster_begin[c], cluster_begin[c + 1]), cluster_begin[0] == 0 and the last == n.
  // Each cluster's mean and standard deviation are computed here, over its rows.
  static residual_codes build(const float* rows, index_t n, index_t d, std::span<const index_t> cluster_begin) {
    require(d > 0, "d", "must be positive, got ", d);
    require(!cluster_begin.empty() && cluster_begin.front() == 0 && cluster_begin.back() == n, "cluster_begin",
            "must run from 0 to the ", n, " rows");
    require(n == 0 || rows != nullptr, "rows", "null pointer for ", n, " rows");
    residual_codes out;
    out.d_ = d;
    out.n_ = n;
    out.clusters_ = cluster_begin.size() - 1;
    out.begin_.assign(cluster_begin.begin(), cluster_begin.end());
    out.mean_.assign(out.clusters_ * d, 0.f);
    out.spread_.assign(out.clusters_ * d, 0.f);
    out.codes_.assign((n + tile_tokens - 1) / tile_tokens * d, 0u);
    std::vector<double> sum(d), sq(d);
    for (index_t c = 0; c < out.clusters_; ++c) {
      const index_t first = cluster_begin[c], last = cluster_begin[c + 1];
      require(first <= last, "cluster_begin", "decreases at cluster ", c, ": ", first, " then ", last);
      std::fill(sum.begin(), sum.end(), 0.0);
      std::fill(sq.begin(), sq.end(), 0.0);
      for (index_t i = first; i < last; ++i)
        for (index_t t = 0; t < d; ++t) {
          const double x = rows[i * d + t];
          require(std::isfinite(x), "rows", "key row ", i, " element ", t, " is ", x);
          sum[t] += x;
        }
      const double count = static_cast<double>(std::max<index_t>(last - first, 1));
      float* mu = out.mean_.data() + c * d;
      float* sigma = out.spread_.data() + c * d;
      for (index_t t = 0; t < d; ++t) mu[t] = static_cast<float>(sum[t] / count);
      for (index_t i = first; i < last; ++i)
        for (index_t t = 0; t < d; ++t) {
          const double e = static_cast<double>(rows[i * d + t]) - mu[t];
          sq[t] += e * e;
        }
      for (index_t t = 0; t < d; ++t) sigma[t] = static_cast<float>(std::sqrt(sq[t] / count));
      for (index_t i = first; i < last; ++i) out.encode(rows + i * d, mu, sigma, i);
    }
    return out;
  }

  index_t tokens() const { return n_; }
  index_t d() const { return d_; }
  index_t clusters() const { return clusters_; }
  index_t first_row(index_t c) const { return begin_[c]; }
  // Bytes the scan reads: the codes of a token, and a cluster's mean and spread once per scan.
  index_t bytes_per_token() const { return (d_ + 3) / 4; }
  index_t bytes_per_cluster() const { return 2 * d_ * static_cast<index_t>(sizeof(float)); }
  std::uint64_t bytes() const {
    return static_cast<std::uint64_t>(n_) * bytes_per_token() + static_cast<std::uint64_t>(clusters_) * bytes_per_cluster();
  }
  const float* mean(index_t c) const { return mean_.data() + c * d_; }
  const float* spread(index_t c) const { return spread_.data() + c * d_; }
  // The key the code of row i stands for, element t: mu_t + sigma_t level(code).
  float decoded(index_t i, index_t c, index_t t) const {
    return mean(c)[t] + spread(c)[t] * levels[code(i, t)];
  }

  // For rows [begin, end) of cluster c and every head h: center[h * ld + i - begin] estimates
  // s q_h . k_i. A non-null `maxima` gets each head's largest estimate. `kernel`: automatic
  // takes AVX-512 where the CPU has it; portable and avx512_vnni (AVX-512F here) force one.
  void scan(const query_group& q, index_t c, index_t begin, index_t end, float* center, index_t ld,
            float* maxima = nullptr, scan_kernel kernel = scan_kernel::automatic) const {
    require(q.d == d_, "query", "dimension ", q.d, " does not match the codes' d = ", d_);
    require(c < clusters_, "cluster", c, " is not one of the ", clusters_, " coded clusters");
    require(begin_[c] <= begin && begin <= end && end <= begin_[c + 1], "range", "[", begin, ", ", end,
            ") is not within cluster ", c, "'s rows [", begin_[c], ", ", begin_[c + 1], ")");
    require(kernel != scan_kernel::avx2 && (kernel != scan_kernel::avx512_vnni || avx512_available()), "kernel",
            "scan kernel ", static_cast<int>(kernel), " is not one this CPU runs for 2-bit codes");
    thread_local std::vector<float> weight;  // [heads][d]: s q_t sigma_t
    weight.assign(q.heads * d_, 0.f);
    const float* mu = mean(c);
    const float* sigma = spread(c);
    std::vector<float> base(q.heads);
    for (index_t h = 0; h < q.heads; ++h) {
      double dot = 0.0;
      for (index_t t = 0; t < d_; ++t) {
        const float x = q.scale * q.row(h)[t];
        weight[h * d_ + t] = x * sigma[t];
        dot += static_cast<double>(x) * mu[t];
      }
      base[h] = static_cast<float>(dot);
      if (maxima) maxima[h] = -std::numeric_limits<float>::infinity();
    }
    alignas(64) float lanes[4 * tile_tokens];  // [head of the pass][token of the tile]
    const bool wide = kernel == scan_kernel::avx512_vnni || (kernel == scan_kernel::automatic && avx512_available());
    for (index_t tile = begin / tile_tokens; tile * tile_tokens < end; ++tile) {
      const index_t first = std::max(begin, tile * tile_tokens), last = std::min(end, (tile + 1) * tile_tokens);
      const std::uint32_t* words = codes_.data() + tile * d_;
      for (index_t h0 = 0; h0 < q.heads; h0 += 4) {
        const index_t hn = std::min<index_t>(4, q.heads - h0);
#ifdef FLOE_QUANTIZED_SCAN_X86
        if (wide) tile_avx512_heads(words, d_, weight.data() + h0 * d_, hn, lanes);
        else
#endif
          tile_portable(words, d_, weight.data() + h0 * d_, hn, first - tile * tile_tokens, last - tile * tile_tokens, lanes);
        for (index_t h = 0; h < hn; ++h)
          for (index_t i = first; i < last; ++i) {
            const float z = base[h0 + h] + lanes[h * tile_tokens + i - tile * tile_tokens];
            center[(h0 + h) * ld + i - begin] = z;
            if (maxima) maxima[h0 + h] = std::max(maxima[h0 + h], z);
          }
      }
    }
  }

  // True when this CPU runs the AVX-512 tile kernel.
  static bool avx512_available() {
#ifdef FLOE_QUANTIZED_SCAN_X86
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
#else
    return false;
#endif
  }

 private:
  static std::uint8_t level_code(float u) {
    return static_cast<std::uint8_t>(u < -split ? 0 : u < 0.f ? 1 : u < split ? 2 : 3);
  }
  std::uint8_t code(index_t i, index_t t) const {
    return static_cast<std::uint8_t>((codes_[i / tile_tokens * d_ + t] >> (2 * (i % tile_tokens))) & 3u);
  }
  // A zero spread (every member equal in that element) codes u = 0: the level times 0 adds nothing.
  void encode(const float* key, const float* mu, const float* sigma, index_t i) {
    std::uint32_t* words = codes_.data() + i / tile_tokens * d_;
    const unsigned shift = 2 * static_cast<unsigned>(i % tile_tokens);
    for (index_t t = 0; t < d_; ++t) {
      const float u = sigma[t] > 0.f ? (key[t] - mu[t]) / sigma[t] : 0.f;
      words[t] |= static_cast<std::uint32_t>(level_code(u)) << shift;
    }
  }

  // out[h * 16 + j] = sum_t w[h * d + t] level(code of token j, element t), tokens [first, last) of the tile.
  static void tile_portable(const std::uint32_t* words, index_t d, const float* w, index_t heads, index_t first,
                            index_t last, float* out) {
    for (index_t h = 0; h < heads; ++h)
      for (index_t j = first; j < last; ++j) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four sums: one chain of adds would bound the loop by latency
        const unsigned shift = 2 * static_cast<unsigned>(j);
        for (index_t t = 0; t < d; ++t) acc[t % 4] += w[h * d + t] * levels[(words[t] >> shift) & 3u];
        out[h * tile_tokens + j] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
  }

#ifdef FLOE_QUANTIZED_SCAN_X86
  // The 16 tokens in lanes: per element, its word shifted by 2j in lane j indexes a table of
  // 16 levels (entry e = level(e & 3), so the bits above the code need no mask).
  static void tile_avx512_heads(const std::uint32_t* words, index_t d, const float* w, index_t heads, float* out) {
    switch (heads) {  // the accumulators stay in registers only with their count known
      case 1: return tile_avx512<1>(words, d, w, out);
      case 2: return tile_avx512<2>(words, d, w, out);
      case 3: return tile_avx512<3>(words, d, w, out);
      default: return tile_avx512<4>(words, d, w, out);
    }
  }
  template <int heads>
  __attribute__((target("avx512f"))) static void tile_avx512(const std::uint32_t* words, index_t d, const float* w,
                                                             float* out) {
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512 table = _mm512_setr_ps(levels[0], levels[1], levels[2], levels[3], levels[0], levels[1], levels[2],
                                        levels[3], levels[0], levels[1], levels[2], levels[3], levels[0], levels[1],
                                        levels[2], levels[3]);
    __m512 acc[heads];
    for (int h = 0; h < heads; ++h) acc[h] = _mm512_setzero_ps();
    const __mmask16 all = 0xffff;  // masked forms: GCC 12 warns on the unmasked ones' undefined source (PR 105593)
    for (index_t t = 0; t < d; ++t) {
      const __m512i idx = _mm512_maskz_srlv_epi32(all, _mm512_set1_epi32(static_cast<int>(words[t])), shifts);
      const __m512 lv = _mm512_maskz_permutexvar_ps(all, idx, table);
      for (int h = 0; h < heads; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(w[h * d + t]), lv, acc[h]);
    }
    for (int h = 0; h < heads; ++h) _mm512_store_ps(out + h * tile_tokens, acc[h]);
  }
#endif

  index_t d_ = 0, n_ = 0, clusters_ = 0;
  std::vector<index_t> begin_;      // [clusters + 1] first row of each cluster
  std::vector<float> mean_, spread_;  // [clusters, d]
  std::vector<std::uint32_t> codes_;  // [tiles of 16 tokens, d]: token j's code of element t in bits 2j, 2j + 1
};

}  // namespace floe
