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
#include <cstring>
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
  static constexpr index_t tile_tokens = 16;  // tokens of a tile: the VNNI kernel's lanes
  // Lloyd-Max quantiser of N(0, 1) with four levels (Max, 1960): cells split at 0 and
  // +-0.9816, levels +-0.4528 and +-1.5104 (each its cell's mean, so the rounding error is
  // uncorrelated with the level). Here the levels are 3 and 10 units of 0.15104 (inner
  // 0.45312, 0.07 % off), so that the VNNI kernel adds them as the integers 0, 7, 13, 20 less 10.
  static constexpr float level_unit = 0.15104f, split = 0.9816f;
  static constexpr int level_bias = 10;
  static constexpr std::array<float, 4> levels{-10 * level_unit, -3 * level_unit, 3 * level_unit, 10 * level_unit};

  residual_codes() = default;

  // rows: n keys of d floats (row-major, consecutive); cluster c holds rows
  // [cluster_begin[c], cluster_begin[c + 1]), cluster_begin[0] == 0 and the last == n.
  // Each cluster's mean and standard deviation are computed here, over its rows.
  static residual_codes build(const float* rows, index_t n, index_t d, std::span<const index_t> cluster_begin) {
    require(d > 0, "d", "must be positive, got ", d);
    require(!cluster_begin.empty() && cluster_begin.front() == 0 && cluster_begin.back() == n, "cluster_begin",
            "must run from 0 to the ", n, " rows");
    require(n == 0 || rows != nullptr, "rows", "null pointer for ", n, " rows");
    for (index_t c = 0; c + 1 < cluster_begin.size(); ++c)  // before any row is read: so all lie within [0, n]
      require(cluster_begin[c] <= cluster_begin[c + 1], "cluster_begin", "decreases at cluster ", c, ": ",
              cluster_begin[c], " then ", cluster_begin[c + 1]);
    residual_codes out;
    out.d_ = d;
    out.n_ = n;
    out.clusters_ = cluster_begin.size() - 1;
    out.begin_.assign(cluster_begin.begin(), cluster_begin.end());
    out.mean_.assign(out.clusters_ * d, 0.f);
    out.spread_.assign(out.clusters_ * d, 0.f);
    out.codes_.assign((n + tile_tokens - 1) / tile_tokens * out.blocks() * tile_tokens, 0u);
    std::vector<double> sum(d), sq(d);
    for (index_t c = 0; c < out.clusters_; ++c) {
      const index_t first = cluster_begin[c], last = cluster_begin[c + 1];
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
  // Bytes the scan reads: the codes of a token, and a cluster's mean and spread once per scan.
  index_t bytes_per_token() const { return blocks() * static_cast<index_t>(sizeof(std::uint32_t)); }  // d/4 rounded up to 4
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
  // takes the AVX-512 VNNI kernel where the CPU has it and FLOE_QUANTIZED_SCAN does not cap
  // the choice at portable or avx2 (the weights w_t = s q_t sigma_t rounded to int8 per head:
  // |error| <= step/2 sum_t |level_t|, step = max_t |w_t| / 127), else the portable one
  // (float weights); portable and avx512_vnni force one.
  void scan(const query_group& q, index_t c, index_t begin, index_t end, float* center, index_t ld,
            float* maxima = nullptr, scan_kernel kernel = scan_kernel::automatic) const {
    require(q.d == d_, "query", "dimension ", q.d, " does not match the codes' d = ", d_);
    require(c < clusters_, "cluster", c, " is not one of the ", clusters_, " coded clusters");
    require(begin_[c] <= begin && begin <= end && end <= begin_[c + 1], "range", "[", begin, ", ", end,
            ") is not within cluster ", c, "'s rows [", begin_[c], ", ", begin_[c + 1], ")");
    require(kernel != scan_kernel::avx2 && (kernel != scan_kernel::avx512_vnni || quantized_tile::vnni_available()),
            "kernel", "scan kernel ", static_cast<int>(kernel), " is not one this CPU runs for 2-bit codes");
    const index_t padded = blocks() * block_dims;
    thread_local std::vector<float> weight;  // [heads][padded]: s q_t sigma_t, zero past d
    weight.assign(q.heads * padded, 0.f);
    const float* mu = mean(c);
    const float* sigma = spread(c);
    thread_local std::vector<float> base, step;  // per head; thread_local: the scan runs per cluster each step
    thread_local std::vector<std::int32_t> offset;
    base.assign(q.heads, 0.f);
    for (index_t h = 0; h < q.heads; ++h) {
      double dot = 0.0;
      for (index_t t = 0; t < d_; ++t) {
        const float x = q.scale * q.row(h)[t];
        weight[h * padded + t] = x * sigma[t];
        require(std::isfinite(x) && std::isfinite(weight[h * padded + t]), "query", "head ", h, " element ", t, " is ",
                q.row(h)[t], ": the scan needs finite s q_t and s q_t sigma_t");
        dot += static_cast<double>(x) * mu[t];
      }
      base[h] = static_cast<float>(dot);
    }
    const bool vnni = kernel == scan_kernel::avx512_vnni ||  // automatic: as quantized_keys, FLOE_QUANTIZED_SCAN caps it
                      (kernel == scan_kernel::automatic && quantized_tile::resolve(kernel) == scan_kernel::avx512_vnni);
    thread_local std::vector<std::int8_t> codes;  // [heads][padded]: the weights in steps, for the VNNI kernel
    if (vnni) {
      step.assign(q.heads, 0.f);  // z = base + step (dot + offset), offset = -10 sum of codes
      offset.assign(q.heads, 0);
      codes.assign(q.heads * padded, 0);
      for (index_t h = 0; h < q.heads; ++h) {
        float top = 0.f;
        for (index_t t = 0; t < d_; ++t) top = std::max(top, std::fabs(weight[h * padded + t]));
        const float unit = top / 127.f;
        std::int32_t sum = 0;
        for (index_t t = 0; t < d_ && unit > 0.f; ++t) {
          const auto k = static_cast<std::int8_t>(std::clamp(std::nearbyint(weight[h * padded + t] / unit), -127.f, 127.f));
          codes[h * padded + t] = k;
          sum += k;
        }
        step[h] = unit * level_unit;
        offset[h] = -level_bias * sum;
      }
    }
    // Each lane's largest estimate per head, reduced once at the end: a running maximum per
    // token would chain every store to the next load.
    thread_local std::vector<float> lane_max;  // [heads][tile_tokens]
    lane_max.assign(q.heads * tile_tokens, -std::numeric_limits<float>::infinity());
    alignas(64) float lanes[4 * tile_tokens];  // [head of the pass][token of the tile]
    const index_t tiles = codes_.size() / (blocks() * tile_tokens);
    // An empty range writes nothing (not even a pointer into `center` is formed).
    for (index_t tile = begin / tile_tokens; begin < end && tile * tile_tokens < end; ++tile) {
      const index_t first = std::max(begin, tile * tile_tokens), last = std::min(end, (tile + 1) * tile_tokens);
      const index_t lo = first - tile * tile_tokens, hi = last - tile * tile_tokens;
      const std::uint32_t* words = codes_.data() + tile * blocks() * tile_tokens;
      // Codes come cold from memory and a tile's arithmetic is short: ask for them prefetch_tiles ahead.
      if (tile + prefetch_tiles < tiles)
        for (index_t line = 0; line < blocks() * tile_tokens * sizeof(std::uint32_t); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(words + prefetch_tiles * blocks() * tile_tokens) + line);
      for (index_t h0 = 0; h0 < q.heads; h0 += 4) {
        const index_t hn = std::min<index_t>(4, q.heads - h0);
        float* dst = center + h0 * ld + (first - begin);
#ifdef FLOE_QUANTIZED_SCAN_X86
        if (vnni) {
          const tile_output o{step.data() + h0, base.data() + h0, offset.data() + h0, lo, hi,
                              dst, ld, lane_max.data() + h0 * tile_tokens};
          tile_vnni_heads(words, blocks(), codes.data() + h0 * padded, padded, hn, o);
          continue;
        }
#endif
        tile_portable(words, blocks(), weight.data() + h0 * padded, padded, hn, lo, hi, lanes);
        for (index_t h = 0; h < hn; ++h) {
          float* m = lane_max.data() + (h0 + h) * tile_tokens;
          for (index_t j = lo; j < hi; ++j) {
            const float z = base[h0 + h] + lanes[h * tile_tokens + j];
            dst[h * ld + j - lo] = z;
            m[j] = std::max(m[j], z);
          }
        }
      }
    }
    if (maxima)
      for (index_t h = 0; h < q.heads; ++h)
        maxima[h] = *std::max_element(lane_max.begin() + h * tile_tokens, lane_max.begin() + (h + 1) * tile_tokens);
  }

 private:
  static constexpr index_t block_dims = 16;  // elements of one 32-bit word per token
  static constexpr index_t prefetch_tiles = 8;  // how far ahead the scan asks for codes (4 KiB at d = 128)
  index_t blocks() const { return (d_ + block_dims - 1) / block_dims; }
  static std::uint8_t level_code(float u) {
    return static_cast<std::uint8_t>(u < -split ? 0 : u < 0.f ? 1 : u < split ? 2 : 3);
  }
  // Element t of a token sits in word t / 16 of its tile, byte t % 4, bits 2 ((t % 16) / 4):
  // shifting a word right by 2k and masking each byte's low two bits leaves elements
  // 4k .. 4k + 3 of the block in bytes 0 .. 3, the order of a VNNI dot product.
  static unsigned bit_of(index_t t) { return static_cast<unsigned>(8 * (t % 4) + 2 * ((t % block_dims) / 4)); }
  std::uint8_t code(index_t i, index_t t) const {
    const std::uint32_t word = codes_[(i / tile_tokens * blocks() + t / block_dims) * tile_tokens + i % tile_tokens];
    return static_cast<std::uint8_t>((word >> bit_of(t)) & 3u);
  }
  // A zero spread (every member equal in that element) codes u = 0: the level times 0 adds nothing.
  void encode(const float* key, const float* mu, const float* sigma, index_t i) {
    std::uint32_t* words = codes_.data() + i / tile_tokens * blocks() * tile_tokens + i % tile_tokens;
    for (index_t t = 0; t < d_; ++t) {
      const float u = sigma[t] > 0.f ? (key[t] - mu[t]) / sigma[t] : 0.f;
      words[t / block_dims * tile_tokens] |= static_cast<std::uint32_t>(level_code(u)) << bit_of(t);
    }
  }

  // out[h * 16 + j] = sum_t w[h * ld + t] level(code of token j, element t), tokens [first, last) of the tile.
  static void tile_portable(const std::uint32_t* words, index_t blocks, const float* w, index_t ld, index_t heads,
                            index_t first, index_t last, float* out) {
    for (index_t h = 0; h < heads; ++h)
      for (index_t j = first; j < last; ++j) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four sums: one chain of adds would bound the loop by latency
        for (index_t t = 0; t < blocks * block_dims; ++t)
          acc[t % 4] += w[h * ld + t] * levels[(words[t / block_dims * tile_tokens + j] >> bit_of(t)) & 3u];
        out[h * tile_tokens + j] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
  }

#ifdef FLOE_QUANTIZED_SCAN_X86
  // Where a tile's estimates go: z = base + step (dot + offset) for lanes [lo, hi) of each head
  // of the pass, stored at dst[h * ld + lane - lo], and each lane's maximum kept in max[h * 16 + lane].
  struct tile_output {
    const float* step;
    const float* base;
    const std::int32_t* offset;
    index_t lo, hi;
    float* dst;
    index_t ld;
    float* max;
  };
  // The 16 tokens in lanes: a block's word shifted by 2k and masked gives four elements' codes
  // per lane, a byte shuffle turns them into the levels' integers + 10 (0, 7, 13, 20), and
  // one dpbusd per head adds them times four int8 weights (dot: sum_t w_t (level_t + 10) per lane).
  static void tile_vnni_heads(const std::uint32_t* words, index_t blocks, const std::int8_t* w, index_t ld,
                              index_t heads, const tile_output& o) {
    switch (heads) {  // the accumulators stay in registers only with their count known
      case 1: return tile_vnni<1>(words, blocks, w, ld, o);
      case 2: return tile_vnni<2>(words, blocks, w, ld, o);
      case 3: return tile_vnni<3>(words, blocks, w, ld, o);
      default: return tile_vnni<4>(words, blocks, w, ld, o);
    }
  }
  template <int heads>
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_vnni(const std::uint32_t* words, index_t blocks,
                                                                               const std::int8_t* w, index_t ld,
                                                                               const tile_output& o) {
    const __mmask16 all16 = 0xffff;  // masked forms: GCC 12 warns on the unmasked ones' undefined source (PR 105593)
    const __mmask64 all64 = ~__mmask64{0};
    const __m512i low_bits = _mm512_set1_epi32(0x03030303);
    const __m512i table = _mm512_set1_epi32(0x140d0700);  // bytes 0, 7, 13, 20 at the start of every 128-bit lane
    __m512i acc[heads][2];  // two chains a head: one chain of dpbusd would bound a head by its latency
    for (int h = 0; h < heads; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_si512();
    for (index_t b = 0; b < blocks; ++b) {
      const __m512i z = _mm512_loadu_si512(words + b * tile_tokens);
      for (int k = 0; k < 4; ++k) {
        const __m512i idx = _mm512_and_si512(_mm512_maskz_srli_epi32(all16, z, static_cast<unsigned>(2 * k)), low_bits);
        const __m512i lv = _mm512_maskz_shuffle_epi8(all64, table, idx);
        for (int h = 0; h < heads; ++h) {
          std::int32_t four;
          std::memcpy(&four, w + h * ld + b * block_dims + 4 * k, sizeof four);
          acc[h][k & 1] = _mm512_dpbusd_epi32(acc[h][k & 1], lv, _mm512_set1_epi32(four));
        }
      }
    }
    const auto valid = static_cast<__mmask16>((0xffffu >> (tile_tokens - (o.hi - o.lo))) << o.lo);
    const auto low = static_cast<__mmask16>(0xffffu >> (tile_tokens - (o.hi - o.lo)));
    for (int h = 0; h < heads; ++h) {
      const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(acc[h][0], acc[h][1]), _mm512_set1_epi32(o.offset[h]));
      const __m512 est =
          _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all16, dot), _mm512_set1_ps(o.step[h]), _mm512_set1_ps(o.base[h]));
      float* m = o.max + h * tile_tokens;
      _mm512_storeu_ps(m, _mm512_mask_max_ps(_mm512_loadu_ps(m), valid, _mm512_loadu_ps(m), est));
      if (valid == all16) _mm512_storeu_ps(o.dst + h * o.ld, est);
      else _mm512_mask_storeu_ps(o.dst + h * o.ld, low, _mm512_maskz_compress_ps(valid, est));  // lanes lo.. to dst[0..]
    }
  }
#endif

  index_t d_ = 0, n_ = 0, clusters_ = 0;
  std::vector<index_t> begin_;      // [clusters + 1] first row of each cluster
  std::vector<float> mean_, spread_;  // [clusters, d]
  std::vector<std::uint32_t> codes_;  // [tiles of 16 tokens][blocks of 16 elements][token]: see bit_of
};

}  // namespace floe
