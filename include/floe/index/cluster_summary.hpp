// The cluster feature map's summary of a region of the cache: the region's keys in M
// k-means clusters, each kept as count, key mean, diagonal key variance and value mean
// (float, what a decode step reads), plus each token's cluster (2 bytes, read only for the
// retrieved tokens). Per step, every cluster's left-out members are estimated as a Gaussian
// in score space truncated at the head's selection threshold tau:
//   D_m = (n_m - r_m) E[e^z | z < tau],  z ~ N(s q.mu_m, s^2 sum_t q_t^2 var_mt)
// with r_m of its members retrieved (their values taken off the value mean).
// docs/methods/retrieval-completion.md, "The cluster map".
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/index/kmeans.hpp"
#include "floe/index/widen.hpp"

namespace floe {

namespace detail {
// log Phi(x), the standard normal CDF, without underflow: erfc down to x = -30, then the
// asymptotic series (relative error < 1e-9 there).
inline double log_normal_cdf(double x) {
  if (x > -30.0) return std::log(0.5 * std::erfc(-x / std::sqrt(2.0)));
  const double r = 1.0 / (x * x);
  return -0.5 * x * x - std::log(-x) - 0.5 * std::log(2.0 * 3.141592653589793) + std::log1p(-r + 3.0 * r * r);
}

// log E[e^z | z < tau] for z ~ N(mean, var): mean + var/2 + log Phi(b - sd) - log Phi(b),
// b = (tau - mean)/sd. Untruncated for tau = +inf or (numerically) zero spread.
inline double truncated_log_mgf(double mean, double var, double tau) {
  const double sd = std::sqrt(std::max(var, 0.0));
  if (!(tau < std::numeric_limits<double>::infinity()) || sd < 1e-6) return mean + 0.5 * var;
  const double b = (tau - mean) / sd;
  return mean + 0.5 * var + log_normal_cdf(b - sd) - log_normal_cdf(b);
}
}  // namespace detail

class cluster_summary {
 public:
  // k-means (floe::kmeans: k-means++ on a sample, `iterations` Lloyd steps) over the keys of
  // `region`; fewer clusters than asked when keys coincide. `window`: tokens append() keeps
  // out (the selector's tail).
  template <KvView KV>
  static cluster_summary build(const KV& kv, token_range region, index_t window, index_t clusters,
                               index_t iterations = 6, std::uint64_t seed = 1,
                               const parallel_for_fn& parallel_for = serial_for) {
    require(clusters >= 1 && clusters <= 65535, "clusters", "must be in [1, 65535], got ", clusters);
    require(region.begin <= region.end && region.end <= kv.n(), "region", "[", region.begin, ", ", region.end,
            ") is not inside the cache of n = ", kv.n());
    cluster_summary s;
    s.region_ = region;
    s.window_ = window;
    s.d_ = kv.d();
    s.dv_ = kv.dv();
    if (region.size() == 0) return s;
    row_matrix keys(static_cast<Eigen::Index>(region.size()), static_cast<Eigen::Index>(kv.d()));
    for (index_t i = region.begin; i < region.end; ++i)
      for (index_t t = 0; t < kv.d(); ++t) {
        const float x = to_float(kv.key_row(i)[t]);
        require(std::isfinite(x), "keys", "key of token ", i, " is not finite (element ", t, ")");
        keys(static_cast<Eigen::Index>(i - region.begin), static_cast<Eigen::Index>(t)) = x;
      }
    kmeans_config cfg;
    cfg.clusters = std::min(clusters, region.size());
    cfg.iterations = iterations;
    cfg.seed = seed;
    const kmeans_result km = kmeans(keys, cfg, parallel_for);
    const index_t m = static_cast<index_t>(km.centroids.rows());
    s.clusters_ = m;
    s.count_.assign(m, 0);
    s.key_sum_.assign(m * s.d_, 0.0);
    s.key_sq_.assign(m * s.d_, 0.0);
    s.value_sum_.assign(m * s.dv_, 0.0);
    s.label_.resize(region.size());
    std::vector<float> value(s.dv_);
    for (index_t i = region.begin; i < region.end; ++i) {
      detail::widen(kv.value_row(i), value.data(), s.dv_);
      s.add_token(i, keys.row(static_cast<Eigen::Index>(i - region.begin)).data(), value.data(),
                  km.labels[i - region.begin]);
    }
    s.publish_all();
    return s;
  }

  // Tokens that left the tail window since the build (up to n - window) join their
  // nearest cluster (by key mean): counts, moments and value means updated exactly.
  template <KvView KV>
  void append(const KV& kv) {
    check_view(kv);
    const index_t to = kv.n() > window_ ? kv.n() - window_ : 0;
    if (to <= region_.end || clusters_ == 0) return;
    std::vector<float> fresh((to - region_.end) * d_), value(dv_);  // all checked before any is taken in
    for (index_t i = region_.end; i < to; ++i) {
      float* key = fresh.data() + (i - region_.end) * d_;
      detail::widen(kv.key_row(i), key, d_);
      for (index_t t = 0; t < d_; ++t)
        require(std::isfinite(key[t]), "keys", "key of token ", i, " is not finite (element ", t, ")");
    }
    std::vector<char> touched(clusters_, 0);
    for (index_t i = region_.end; i < to; ++i) {
      const float* key = fresh.data() + (i - region_.end) * d_;
      index_t best = 0;
      double best_d = std::numeric_limits<double>::infinity();
      for (index_t c = 0; c < clusters_; ++c) {
        double dist = 0.0;
        for (index_t t = 0; t < d_; ++t) {
          const double diff = key[t] - key_sum_[c * d_ + t] / static_cast<double>(count_[c]);
          dist += diff * diff;
        }
        if (dist < best_d) {
          best_d = dist;
          best = c;
        }
      }
      label_.push_back(static_cast<std::uint16_t>(best));
      detail::widen(kv.value_row(i), value.data(), dv_);
      add_token(i, key, value.data(), best);
      touched[best] = 1;
    }
    region_.end = to;
    for (index_t c = 0; c < clusters_; ++c)
      if (touched[c]) publish(c);
  }

  token_range region() const { return region_; }
  index_t clusters() const { return clusters_; }
  index_t window() const { return window_; }
  std::uint32_t count(index_t c) const { return count_[c]; }
  std::uint16_t label(index_t token) const { return label_[token - region_.begin]; }

  // Memory held: the published moments and counts, the labels, and the double sums
  // append() updates.
  std::uint64_t bytes() const {
    return read_bytes(0) + sizeof(std::uint16_t) * label_.size() +
           sizeof(double) * (key_sum_.size() + key_sq_.size() + value_sum_.size());
  }
  // What one step reads: every cluster's moments, and the labels of `retrieved` tokens
  // (their value rows too with subtract_values: the exact part read them already).
  std::uint64_t read_bytes(index_t retrieved) const {
    return clusters_ * (sizeof(float) * (2 * d_ + dv_) + sizeof(std::uint32_t)) + sizeof(std::uint16_t) * retrieved;
  }

  // Adds, for each head h, the region's tokens outside `retrieved` (ranges inside the
  // region, ascending) as one partial, with head h's scores truncated at tau[h]
  // (+inf: untruncated). Their value mean is their cluster's, or with `subtract_values`
  // the cluster's without the retrieved members (their value rows read again).
  template <KvView KV, class Acc>
  void estimate(const KV& kv, const query_group& q, std::span<const token_range> retrieved, const double* tau,
                partial_set<Acc>& parts, bool subtract_values = false) const {
    check_view(kv);
    if (clusters_ == 0) return;
    // Four interleaved histograms: consecutive tokens often share a cluster, and one
    // counter would chain every increment through a store and a reload.
    thread_local std::vector<std::uint32_t> taken, lanes;
    thread_local std::vector<double> taken_values;
    thread_local std::vector<float> row;
    lanes.assign(4 * clusters_, 0);
    taken_values.assign(subtract_values ? clusters_ * dv_ : 0, 0.0);
    row.resize(dv_);
    for (const token_range& r : retrieved) {
      require(r.begin >= region_.begin && r.end <= region_.end, "selection", "retrieved [", r.begin, ", ", r.end,
              ") is outside the summarised region [", region_.begin, ", ", region_.end, ")");
      const std::uint16_t* lab = label_.data() + (r.begin - region_.begin);
      const index_t len = r.size();
      index_t i = 0;
      for (; i + 4 <= len; i += 4)
        for (index_t u = 0; u < 4; ++u) ++lanes[u * clusters_ + lab[i + u]];
      for (; i < len; ++i) ++lanes[lab[i]];
      if (!subtract_values) continue;
      for (index_t t = r.begin; t < r.end; ++t) {
        detail::widen(kv.value_row(t), row.data(), dv_);
        double* sum = taken_values.data() + label(t) * dv_;
        for (index_t j = 0; j < dv_; ++j) sum[j] += row[j];
      }
    }
    taken.resize(clusters_);
    for (index_t c = 0; c < clusters_; ++c)
      taken[c] = lanes[c] + lanes[clusters_ + c] + lanes[2 * clusters_ + c] + lanes[3 * clusters_ + c];
    // Every head's score mean q.mu_m and spread sum_t q_t^2 var_mt in two float products
    // ([M, d] by [d, g]); a step's error here is far below the Gaussian model's.
    using rows = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    const auto m = static_cast<Eigen::Index>(clusters_), dd = static_cast<Eigen::Index>(d_);
    const Eigen::Map<const Eigen::MatrixXf, 0, Eigen::OuterStride<>> queries(
        q.data, dd, static_cast<Eigen::Index>(q.heads), Eigen::OuterStride<>(static_cast<Eigen::Index>(q.row_stride())));
    thread_local Eigen::MatrixXf score_mean, score_spread;
    score_mean.noalias() = rows(mean_.data(), m, dd) * queries;
    score_spread.noalias() = rows(var_.data(), m, dd) * queries.cwiseAbs2();
    thread_local std::vector<double> log_mass, mean_value;
    thread_local std::vector<Acc> out;
    log_mass.resize(clusters_);
    mean_value.resize(dv_);
    out.resize(dv_);
    for (index_t h = 0; h < q.heads; ++h) {
      const double s = q.scale;
      const auto hh = static_cast<Eigen::Index>(h);
      double top = -std::numeric_limits<double>::infinity();
      for (index_t c = 0; c < clusters_; ++c) {
        log_mass[c] = -std::numeric_limits<double>::infinity();
        if (taken[c] >= count_[c]) continue;
        const auto cc = static_cast<Eigen::Index>(c);
        const double mean = score_mean(cc, hh), var = score_spread(cc, hh);
        log_mass[c] = std::log(static_cast<double>(count_[c] - taken[c])) +
                      detail::truncated_log_mgf(s * mean, s * s * var, tau[h]);
        top = std::max(top, log_mass[c]);
      }
      if (!(top > -std::numeric_limits<double>::infinity())) continue;
      double total = 0.0;
      std::fill(mean_value.begin(), mean_value.end(), 0.0);
      for (index_t c = 0; c < clusters_; ++c) {
        if (!(log_mass[c] > -std::numeric_limits<double>::infinity())) continue;
        const double w = std::exp(log_mass[c] - top), left = static_cast<double>(count_[c] - taken[c]);
        total += w;
        const float* nu = value_mean_.data() + c * dv_;
        if (subtract_values)
          for (index_t j = 0; j < dv_; ++j) mean_value[j] += w * (count_[c] * nu[j] - taken_values[c * dv_ + j]) / left;
        else
          for (index_t j = 0; j < dv_; ++j) mean_value[j] += w * nu[j];
      }
      for (index_t j = 0; j < dv_; ++j) out[j] = static_cast<Acc>(mean_value[j] / total);
      parts.merge(h, static_cast<Acc>(top + std::log(total)), Acc(1), out.data());
    }
  }

 private:
  template <KvView KV>
  void check_view(const KV& kv) const {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "summary built for d = ", d_, ", dv = ", dv_, ", the cache has d = ",
            kv.d(), ", dv = ", kv.dv());
    require(kv.n() >= region_.end, "kv", "the cache has ", kv.n(), " tokens, the summary covers up to ", region_.end);
  }

  // Token i (its key and value widened) into cluster c's sums.
  void add_token(index_t i, const float* key, const float* value, index_t c) {
    if (label_.size() > i - region_.begin) label_[i - region_.begin] = static_cast<std::uint16_t>(c);
    ++count_[c];
    for (index_t t = 0; t < d_; ++t) {
      const double x = key[t];
      key_sum_[c * d_ + t] += x;
      key_sq_[c * d_ + t] += x * x;
    }
    for (index_t j = 0; j < dv_; ++j) value_sum_[c * dv_ + j] += value[j];
  }

  void publish_all() {
    mean_.resize(clusters_ * d_);
    var_.resize(clusters_ * d_);
    value_mean_.resize(clusters_ * dv_);
    for (index_t c = 0; c < clusters_; ++c) publish(c);
  }
  // The published moments of cluster c from its double sums (variance clamped at 0 against rounding).
  void publish(index_t c) {
    const double n = static_cast<double>(count_[c]);
    for (index_t t = 0; t < d_; ++t) {
      const double mu = key_sum_[c * d_ + t] / n;
      mean_[c * d_ + t] = static_cast<float>(mu);
      var_[c * d_ + t] = static_cast<float>(std::max(0.0, key_sq_[c * d_ + t] / n - mu * mu));
    }
    for (index_t j = 0; j < dv_; ++j) value_mean_[c * dv_ + j] = static_cast<float>(value_sum_[c * dv_ + j] / n);
  }

  token_range region_{};
  index_t window_ = 0, d_ = 0, dv_ = 0, clusters_ = 0;
  std::vector<float> mean_, var_, value_mean_;  // [M, d], [M, d], [M, dv]: what a step reads
  std::vector<std::uint32_t> count_;
  std::vector<std::uint16_t> label_;             // [region tokens]
  std::vector<double> key_sum_, key_sq_, value_sum_;  // exact sums, for append()
};

}  // namespace floe
