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

namespace floe {

class residual_codes {
 public:
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
    out.codes_.assign(n * out.bytes_per_token(), 0);
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
  // s q_h . k_i. A non-null `maxima` gets each head's largest estimate.
  void scan(const query_group& q, index_t c, index_t begin, index_t end, float* center, index_t ld,
            float* maxima = nullptr) const {
    require(q.d == d_, "query", "dimension ", q.d, " does not match the codes' d = ", d_);
    require(c < clusters_, "cluster", c, " is not one of the ", clusters_, " coded clusters");
    require(begin_[c] <= begin && begin <= end && end <= begin_[c + 1], "range", "[", begin, ", ", end,
            ") is not within cluster ", c, "'s rows [", begin_[c], ", ", begin_[c + 1], ")");
    const index_t bytes = bytes_per_token(), padded = bytes * 4;
    thread_local std::vector<float> weight, lane;  // weight: [heads][padded] s q sigma; lane: one row's levels
    weight.assign(q.heads * padded, 0.f);
    lane.assign(padded, 0.f);
    const float* mu = mean(c);
    const float* sigma = spread(c);
    std::vector<float> base(q.heads);
    for (index_t h = 0; h < q.heads; ++h) {
      double dot = 0.0;
      for (index_t t = 0; t < d_; ++t) {
        const float x = q.scale * q.row(h)[t];
        weight[h * padded + t] = x * sigma[t];
        dot += static_cast<double>(x) * mu[t];
      }
      base[h] = static_cast<float>(dot);
      if (maxima) maxima[h] = -std::numeric_limits<float>::infinity();
    }
    for (index_t i = begin; i < end; ++i) {
      const std::uint8_t* row = codes_.data() + i * bytes;
      for (index_t b = 0; b < bytes; ++b) {
        const auto& four = byte_levels()[row[b]];
        std::copy(four.begin(), four.end(), lane.begin() + 4 * b);
      }
      for (index_t h = 0; h < q.heads; ++h) {
        const float* w = weight.data() + h * padded;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four sums: one chain of adds would bound the loop by latency
        for (index_t t = 0; t < padded; t += 4)
          for (index_t k = 0; k < 4; ++k) acc[k] += w[t + k] * lane[t + k];
        const float z = base[h] + ((acc[0] + acc[1]) + (acc[2] + acc[3]));
        center[h * ld + i - begin] = z;
        if (maxima) maxima[h] = std::max(maxima[h], z);
      }
    }
  }

 private:
  static std::uint8_t level_code(float u) {
    return static_cast<std::uint8_t>(u < -split ? 0 : u < 0.f ? 1 : u < split ? 2 : 3);
  }
  std::uint8_t code(index_t i, index_t t) const {
    return static_cast<std::uint8_t>((codes_[i * bytes_per_token() + t / 4] >> (2 * (t % 4))) & 3u);
  }
  // A zero spread (every member equal in that element) codes u = 0: the level times 0 adds nothing.
  void encode(const float* key, const float* mu, const float* sigma, index_t i) {
    std::uint8_t* row = codes_.data() + i * bytes_per_token();
    for (index_t t = 0; t < d_; ++t) {
      const float u = sigma[t] > 0.f ? (key[t] - mu[t]) / sigma[t] : 0.f;
      row[t / 4] = static_cast<std::uint8_t>(row[t / 4] | (level_code(u) << (2 * (t % 4))));
    }
  }
  // The four levels a code byte stands for, element 4b + k from bits 2k, 2k + 1.
  static const std::array<std::array<float, 4>, 256>& byte_levels() {
    static const auto table = [] {
      std::array<std::array<float, 4>, 256> t{};
      for (unsigned b = 0; b < 256; ++b)
        for (unsigned k = 0; k < 4; ++k) t[b][k] = levels[(b >> (2 * k)) & 3u];
      return t;
    }();
    return table;
  }

  index_t d_ = 0, n_ = 0, clusters_ = 0;
  std::vector<index_t> begin_;      // [clusters + 1] first row of each cluster
  std::vector<float> mean_, spread_;  // [clusters, d]
  std::vector<std::uint8_t> codes_;   // [n, ceil(d / 4)]: element t in bits 2 (t % 4) of byte t / 4
};

}  // namespace floe
