// The feature-map summary of a region [b, e) of one (layer, KV head):
//   zeta = sum_i phi(k_i - c),  Phi = sum_i phi(k_i - c) v_i^T   (c: the region's key mean)
// kept per feature m in log-scaled form (zeta_m = exp(sigma_m) zeta~_m, likewise the row
// Phi_m), so that masses of e^+-700 and beyond stay finite. Tokens join by rank-one
// updates as they leave the tail window. docs/methods/retrieval-completion.md.
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
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/index/widen.hpp"
#include "floe/residual/feature_maps/gaussian_directions.hpp"

namespace floe {

// The residual of one query head: D^ = exp(log_ref) * mass, N^ = exp(log_ref) * numerator.
// `mass` may be negative (the subtraction is unbiased, not positive); callers clamp.
struct feature_mass {
  double log_ref = 0.0;
  double mass = 0.0;
  std::vector<double> numerator;
};

class feature_map_summary {
 public:
  using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  static constexpr index_t chunk_tokens = 512;  // tokens per GEMM when building or subtracting

  feature_map_summary() = default;

  // Summarises region [b, e) of kv with the map `params`, keys centred on `centre`;
  // append() later takes tokens up to n - window.
  template <KvView KV>
  static feature_map_summary build(const KV& kv, token_range region, index_t window, residual::feature_params params,
                                   Eigen::VectorXf centre) {
    require(region.begin <= region.end && region.end <= kv.n(), "region", "[", region.begin, ", ", region.end,
            ") is not inside the cache of n = ", kv.n());
    require(params.projection.cols() == static_cast<Eigen::Index>(kv.d()) && centre.size() == params.projection.cols(),
            "features", "map drawn for d = ", params.projection.cols(), ", the cache has d = ", kv.d());
    feature_map_summary s;
    s.params_ = std::move(params);
    s.centre_ = std::move(centre);
    s.window_ = window;
    s.d_ = kv.d();
    s.dv_ = kv.dv();
    const auto m = static_cast<Eigen::Index>(s.features());
    s.log_scale_ = Eigen::VectorXf::Constant(m, -std::numeric_limits<float>::infinity());
    s.zeta_ = Eigen::VectorXf::Zero(m);
    s.phi_ = row_matrix::Zero(m, static_cast<Eigen::Index>(kv.dv()));
    s.region_ = {region.begin, region.begin};
    s.add_tokens(kv, region.end);
    return s;
  }

  // Takes in the tokens that left the tail window since: [end, kv.n() - window).
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "summary built for d = ", d_, ", dv = ", dv_,
            "; the view has d = ", kv.d(), ", dv = ", kv.dv());
    if (kv.n() > region_.end + window_) add_tokens(kv, kv.n() - window_);
  }

  token_range region() const { return region_; }
  index_t features() const { return static_cast<index_t>(params_.projection.rows()); }
  const residual::feature_params& params() const { return params_; }
  const Eigen::VectorXf& centre() const { return centre_; }
  const Eigen::VectorXf& log_scale() const { return log_scale_; }
  const Eigen::VectorXf& zeta() const { return zeta_; }
  const row_matrix& phi() const { return phi_; }

  // Everything estimate() reads: map, centre, log scales, zeta and Phi, in float.
  std::uint64_t bytes() const {
    const index_t m = features();
    return sizeof(float) * (m * d_ + m + d_ + m + m + m * dv_);
  }

  // log phi(x_r) for the rows of x (already centred when they are keys): [rows, M].
  row_matrix log_features(const Eigen::Ref<const row_matrix>& x) const {
    row_matrix l = x * params_.projection.transpose();
    const Eigen::VectorXf half_sq = 0.5f * params_.scale * x.rowwise().squaredNorm();
    l.colwise() -= half_sq;
    l.rowwise() += params_.bias.transpose();
    return l;
  }

  // D^ and N^ of the summarised tokens outside `exact`, per query head: the summary
  // minus the features of the exact tokens inside the region (keys and values the exact
  // part reads anyway). Empty when the exact set covers the region. Every token outside
  // the region must be exact.
  template <KvView KV>
  std::vector<feature_mass> estimate(const KV& kv, const query_group& q, std::span<const token_range> exact) const {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "summary built for d = ", d_, ", dv = ", dv_,
            "; the view has d = ", kv.d(), ", dv = ", kv.dv());
    check_covered(exact, {0, region_.begin}, kv.n());
    check_covered(exact, {region_.end, kv.n()}, kv.n());
    std::vector<token_range> inside;
    index_t inside_count = 0;
    for (const token_range& r : exact) {
      const token_range x{std::max(r.begin, region_.begin), std::min(r.end, region_.end)};
      if (x.begin < x.end) {
        inside.push_back(x);
        inside_count += x.size();
      }
    }
    if (inside_count == region_.size()) return {};

    const index_t g = q.heads;
    row_matrix qrows(static_cast<Eigen::Index>(g), static_cast<Eigen::Index>(d_));
    // s q.k = s0 (s/s0 q).k: a query of another scale is rescaled to the map's own s0.
    const float rescale = q.scale / params_.scale;
    for (index_t h = 0; h < g; ++h)
      for (index_t t = 0; t < d_; ++t) qrows(h, t) = rescale * q.row(h)[t];
    // weight_hm = exp(log phi_m(q_h) + sigma_m - ref_h) <= 1
    row_matrix weight = log_features(qrows);
    weight.rowwise() += log_scale_.transpose();
    const Eigen::VectorXf ref = weight.rowwise().maxCoeff();
    weight.colwise() -= ref;
    weight = weight.array().exp().matrix();

    std::vector<feature_mass> out(g);
    Eigen::MatrixXd numer = (weight * phi_).cast<double>();  // [g, dv]
    Eigen::VectorXd mass = (weight * zeta_).cast<double>();
    // Per chunk, one GEMM (the features, transposed: [M, rows]) and then row updates:
    // Eigen's small-by-large products packed more bytes than they multiplied.
    thread_local row_matrix token_features, u, chunk_numer;
    const Eigen::VectorXf feature_shift = params_.bias - log_scale_;
    thread_local Eigen::RowVectorXf value_row;
    value_row.resize(static_cast<Eigen::Index>(dv_));
    for_each_chunk<false>(kv, inside, [&](const auto& keys, std::span<const index_t> tokens) {
      const Eigen::Index rows = keys.rows();
      token_features.resize(static_cast<Eigen::Index>(features()), rows);
      token_features.noalias() = params_.projection * keys.transpose();
      const Eigen::RowVectorXf half_sq = (0.5f * params_.scale) * keys.rowwise().squaredNorm().transpose();
      u.setZero(static_cast<Eigen::Index>(g), rows);  // u_hr = phi(q_h) . phi(k_r)
      for (Eigen::Index m = 0; m < token_features.rows(); ++m) {
        token_features.row(m) = (token_features.row(m).array() - half_sq.array() + feature_shift[m]).exp();
        for (Eigen::Index h = 0; h < u.rows(); ++h) u.row(h) += weight(h, m) * token_features.row(m);
      }
      mass -= u.rowwise().sum().cast<double>();
      chunk_numer.setZero(static_cast<Eigen::Index>(g), static_cast<Eigen::Index>(dv_));
      for (Eigen::Index r = 0; r < rows; ++r) {  // value rows widened one at a time, in L1
        detail::widen(kv.value_row(tokens[static_cast<std::size_t>(r)]), value_row.data(), dv_);
        for (Eigen::Index h = 0; h < u.rows(); ++h) chunk_numer.row(h) += u(h, r) * value_row;
      }
      numer -= chunk_numer.cast<double>();
    });
    for (index_t h = 0; h < g; ++h) {
      double shift = 0.0;  // s q_h . c, the score shift the centring removed
      for (index_t t = 0; t < d_; ++t) shift += static_cast<double>(q.row(h)[t]) * centre_[static_cast<Eigen::Index>(t)];
      out[h].log_ref = static_cast<double>(ref[static_cast<Eigen::Index>(h)]) + static_cast<double>(q.scale) * shift;
      out[h].mass = mass[static_cast<Eigen::Index>(h)];
      out[h].numerator.assign(numer.row(static_cast<Eigen::Index>(h)).data(),
                              numer.row(static_cast<Eigen::Index>(h)).data() + dv_);
    }
    return out;
  }

 private:
  // Rank-k update with the tokens [region.end, to), chunk by chunk: raise sigma_m where a
  // chunk exceeds it (rescaling what is held), then add exp(log phi - sigma).
  template <KvView KV>
  void add_tokens(const KV& kv, index_t to) {
    const std::vector<token_range> todo{{region_.end, to}};
    for_each_chunk<true>(kv, todo, [&](const auto& keys, const auto& values) {
      const row_matrix l = log_features(keys);
      require(l.allFinite(), "keys", "a key in [", region_.end, ", ", to, ") is NaN or Inf, or its features overflow");
      require(values.allFinite(), "values", "a value in [", region_.end, ", ", to, ") is NaN or Inf");
      const Eigen::VectorXf top = l.colwise().maxCoeff().transpose();
      for (Eigen::Index j = 0; j < l.cols(); ++j)
        if (top[j] > log_scale_[j]) {
          const float factor = std::exp(log_scale_[j] - top[j]);  // 0 while empty
          zeta_[j] *= factor;
          phi_.row(j) *= factor;
          log_scale_[j] = top[j];
        }
      row_matrix e = l;
      e.rowwise() -= log_scale_.transpose();
      e = e.array().exp().matrix();
      zeta_ += e.colwise().sum().transpose();
      phi_ += e.transpose() * values;
    });
    region_.end = to;
  }

  // Calls f(centred keys, values) for the tokens of `ranges`, chunk_tokens rows at a time;
  // without Values, f(centred keys, the chunk's tokens), their value rows prefetched.
  template <bool Values, KvView KV, class F>
  void for_each_chunk(const KV& kv, const std::vector<token_range>& ranges, F&& f) const {
    // Per-thread buffers kept between calls: fresh pages every step cost more than the GEMMs.
    thread_local row_matrix keys, values;
    keys.resize(static_cast<Eigen::Index>(chunk_tokens), static_cast<Eigen::Index>(d_));
    if constexpr (Values) values.resize(static_cast<Eigen::Index>(chunk_tokens), static_cast<Eigen::Index>(dv_));
    thread_local std::vector<index_t> tokens;
    tokens.clear();
    for (const token_range& r : ranges)
      for (index_t i = r.begin; i < r.end; ++i) tokens.push_back(i);
    constexpr index_t ahead = 8;  // rows in flight: scattered gathers are latency-bound
    for (index_t first = 0; first < tokens.size(); first += chunk_tokens) {
      const index_t rows = std::min(chunk_tokens, tokens.size() - first);
      for (index_t r = 0; r < rows; ++r) {
        if (first + r + ahead < tokens.size()) {
          detail::prefetch_row(kv.key_row(tokens[first + r + ahead]), d_);
          detail::prefetch_row(kv.value_row(tokens[first + r + ahead]), dv_);
        }
        const auto row = static_cast<Eigen::Index>(r);
        detail::widen(kv.key_row(tokens[first + r]), &keys(row, 0), d_);
        if constexpr (Values) detail::widen(kv.value_row(tokens[first + r]), &values(row, 0), dv_);
        keys.row(row) -= centre_.transpose();
      }
      if constexpr (Values)
        f(keys.topRows(static_cast<Eigen::Index>(rows)), values.topRows(static_cast<Eigen::Index>(rows)));
      else
        f(keys.topRows(static_cast<Eigen::Index>(rows)), std::span<const index_t>(tokens.data() + first, rows));
    }
  }

  static void check_covered(std::span<const token_range> exact, token_range need, index_t n) {
    index_t pos = need.begin;
    for (const token_range& r : exact) {
      if (pos >= need.end) break;
      if (r.end <= pos) continue;
      if (r.begin > pos) break;
      pos = r.end;
    }
    require(pos >= need.end, "index", "token ", pos, " of the cache (n = ", n,
            ") is neither attended exactly nor in the feature-map summary; append the tokens that left the "
            "tail window to the residual index");
  }

  residual::feature_params params_;
  Eigen::VectorXf centre_;
  index_t window_ = 0, d_ = 0, dv_ = 0;
  token_range region_;
  Eigen::VectorXf log_scale_;  // sigma: [M]
  Eigen::VectorXf zeta_;       // [M]
  row_matrix phi_;             // [M, dv]
};

}  // namespace floe
