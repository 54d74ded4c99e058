// The feature-map summary of a region [b, e) of one (layer, KV head):
//   zeta = sum_i phi(k_i - c),  Phi = sum_i phi(k_i - c) v_i^T   (c: the region's key mean)
// kept per feature m in log-scaled form (zeta_m = exp(sigma_m) zeta~_m, likewise the row
// Phi_m), so that masses of e^+-700 and beyond stay finite. Tokens join by rank-one
// updates as they leave the tail window. Optionally each token's features are cached
// (bf16) so that decode subtracts the exact tokens' features without projecting their
// keys. docs/methods/retrieval-completion.md.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/huge_page_allocator.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/index/weighted_rows.hpp"
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
  using numerator_matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  static constexpr index_t chunk_tokens = 512;  // tokens per GEMM when building or subtracting
  // With the cache, sigma_m is raised only when a token's log-feature passes it by this
  // much: each raise rescales the cached column too (re-rounding it), so raises are kept
  // rare; cached values up to e^40 are fine in bf16 and in the float sums.
  static constexpr float cache_headroom = 40.f;

  feature_map_summary() = default;

  // Summarises region [b, e) of kv with the map `params`, keys centred on `centre`;
  // append() later takes tokens up to n - window. With cache_token_features, each token's
  // features are kept (bf16, M per token) and Phi, zeta summed from the rounded values,
  // so that the decode-time subtraction cancels a token's own term exactly.
  template <KvView KV>
  static feature_map_summary build(const KV& kv, token_range region, index_t window, residual::feature_params params,
                                   Eigen::VectorXf centre, bool cache_token_features = false) {
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
    s.caching_ = cache_token_features;
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
    check_view(kv);
    if (kv.n() > region_.end + window_) add_tokens(kv, kv.n() - window_);
  }

  token_range region() const { return region_; }
  index_t features() const { return static_cast<index_t>(params_.projection.rows()); }
  const residual::feature_params& params() const { return params_; }
  const Eigen::VectorXf& centre() const { return centre_; }
  const Eigen::VectorXf& log_scale() const { return log_scale_; }
  const Eigen::VectorXf& zeta() const { return zeta_; }
  const row_matrix& phi() const { return phi_; }

  bool caches_token_features() const { return caching_; }

  // Memory held: map, centre, log scales, zeta and Phi in float, and the feature cache.
  std::uint64_t bytes() const { return summary_bytes() + cached_.size() * sizeof(bfloat16); }

  // What one estimate() reads: the summary, and with the cache the features of the exact
  // tokens inside the region.
  std::uint64_t read_bytes(std::span<const token_range> exact) const {
    std::uint64_t inside = 0;  // counted, not collected: estimate() already clipped the ranges
    if (caching_)
      for (const token_range& r : exact) {
        const index_t begin = std::max(r.begin, region_.begin), end = std::min(r.end, region_.end);
        if (begin < end) inside += end - begin;
      }
    return summary_bytes() + inside * features() * sizeof(bfloat16);
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
  // the region must be exact. `before_chunk(tokens)` runs before each chunk of exact
  // tokens inside the region is read (at most chunk_tokens, ascending), so a caller can
  // attend them there and this pass finds their rows in cache.
  template <KvView KV, class BeforeChunk = void (*)(std::span<const index_t>)>
  std::vector<feature_mass> estimate(const KV& kv, const query_group& q, std::span<const token_range> exact,
                                     BeforeChunk&& before_chunk = [](std::span<const index_t>) {}) const {
    check_view(kv);
    check_covered(exact, {0, region_.begin}, kv.n());
    check_covered(exact, {region_.end, kv.n()}, kv.n());
    const auto [inside, inside_count] = inside_region(exact);
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
    // Row-major: each head's numerator is copied out as one contiguous row below.
    numerator_matrix numer = (weight * phi_).cast<double>();  // [g, dv]
    Eigen::VectorXd mass = (weight * zeta_).cast<double>();
    // Per chunk, u_hr = phi(q_h) . phi(k_r) for its exact tokens, from the cached features
    // or from their keys projected, then their own terms taken out of the summary.
    thread_local row_matrix u;
    if (caching_) {
      thread_local Eigen::RowVectorXf token_features;
      token_features.resize(static_cast<Eigen::Index>(features()));
      for_each_token_chunk(inside, [&](std::span<const index_t> tokens) {
        const index_t m = features();
        constexpr index_t ahead = 16;  // cached rows in flight: scattered gathers are latency-bound
        for (index_t r = 0; r < std::min(ahead, tokens.size()); ++r) detail::prefetch_row(cached_row(tokens[r]), m);
        before_chunk(tokens);
        u.resize(static_cast<Eigen::Index>(g), static_cast<Eigen::Index>(tokens.size()));
        for (index_t r = 0; r < tokens.size(); ++r) {
          if (r + ahead < tokens.size()) detail::prefetch_row(cached_row(tokens[r + ahead]), m);
          detail::widen(cached_row(tokens[r]), token_features.data(), m);
          for (Eigen::Index h = 0; h < u.rows(); ++h) u(h, static_cast<Eigen::Index>(r)) = weight.row(h).dot(token_features);
        }
        subtract_terms(kv, tokens, u, mass, numer);
      });
    } else {
      // One GEMM per chunk (the features, transposed: [M, rows]) and then row updates:
      // Eigen's small-by-large products packed more bytes than they multiplied.
      thread_local row_matrix token_features;
      const Eigen::VectorXf feature_shift = params_.bias - log_scale_;
      for_each_chunk<false>(kv, inside, before_chunk, [&](const auto& keys, std::span<const index_t> tokens) {
        token_features.resize(static_cast<Eigen::Index>(features()), keys.rows());
        token_features.noalias() = params_.projection * keys.transpose();
        const Eigen::RowVectorXf half_sq = (0.5f * params_.scale) * keys.rowwise().squaredNorm().transpose();
        u.setZero(static_cast<Eigen::Index>(g), keys.rows());
        for (Eigen::Index m = 0; m < token_features.rows(); ++m) {
          token_features.row(m) = (token_features.row(m).array() - half_sq.array() + feature_shift[m]).exp();
          for (Eigen::Index h = 0; h < u.rows(); ++h) u.row(h) += weight(h, m) * token_features.row(m);
        }
        subtract_terms(kv, tokens, u, mass, numer);
      });
    }
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

  // The exact ranges clipped to the region, and how many tokens they hold there.
  std::pair<std::vector<token_range>, index_t> inside_region(std::span<const token_range> exact) const {
    std::pair<std::vector<token_range>, index_t> out{{}, 0};
    for (const token_range& r : exact) {
      const token_range x{std::max(r.begin, region_.begin), std::min(r.end, region_.end)};
      if (x.begin < x.end) {
        out.first.push_back(x);
        out.second += x.size();
      }
    }
    return out;
  }

 private:
  std::uint64_t summary_bytes() const {
    const index_t m = features();
    return sizeof(float) * (m * d_ + m + d_ + m + m + m * dv_);
  }

  const bfloat16* cached_row(index_t token) const { return cached_.data() + (token - region_.begin) * features(); }

  // mass_h -= sum_r u_hr and numer_h -= sum_r u_hr v_r: the exact tokens' own terms,
  // taken out of the summary.
  template <KvView KV>
  void subtract_terms(const KV& kv, std::span<const index_t> tokens, const row_matrix& u, Eigen::VectorXd& mass,
                      numerator_matrix& numer) const {
    // The chunk's value rows widened (zero-padded to the block stride) a block at a time,
    // so that the widened rows stay in L1, then summed for all heads at once with the
    // sums in registers.
    constexpr index_t block_rows = 32;
    thread_local std::vector<float> rows, chunk_numer;
    mass -= u.rowwise().sum().cast<double>();
    const index_t stride = detail::weighted_stride(dv_), heads = static_cast<index_t>(u.rows());
    rows.resize(block_rows * stride);
    chunk_numer.assign(heads * stride, 0.f);
    constexpr index_t ahead = 8;  // value rows in flight
    for (index_t r0 = 0; r0 < tokens.size(); r0 += block_rows) {
      const index_t count = std::min(block_rows, tokens.size() - r0);
      for (index_t i = 0; i < count; ++i) {
        const index_t r = r0 + i;
        if (r + ahead < tokens.size()) detail::prefetch_row(kv.value_row(tokens[r + ahead]), dv_);
        detail::widen(kv.value_row(tokens[r]), rows.data() + i * stride, dv_);
        std::fill(rows.data() + i * stride + dv_, rows.data() + (i + 1) * stride, 0.f);
      }
      detail::add_weighted_rows(u.data() + r0, static_cast<index_t>(u.cols()), heads, rows.data(), count, stride,
                                chunk_numer.data(), stride);
    }
    for (index_t h = 0; h < heads; ++h)
      for (index_t j = 0; j < dv_; ++j)
        numer(static_cast<Eigen::Index>(h), static_cast<Eigen::Index>(j)) -= chunk_numer[h * stride + j];
  }

  // Calls f(tokens) for the tokens of `ranges`, chunk_tokens at a time.
  template <class F>
  static void for_each_token_chunk(const std::vector<token_range>& ranges, F&& f) {
    thread_local std::vector<index_t> tokens;
    tokens.clear();
    for (const token_range& r : ranges)
      for (index_t i = r.begin; i < r.end; ++i) tokens.push_back(i);
    for (index_t first = 0; first < tokens.size(); first += chunk_tokens)
      f(std::span<const index_t>(tokens.data() + first, std::min(chunk_tokens, tokens.size() - first)));
  }

  // Rank-k update with the tokens [region.end, to), chunk by chunk: raise sigma_m where a
  // chunk exceeds it (rescaling what is held), then add exp(log phi - sigma).
  template <KvView KV>
  void add_tokens(const KV& kv, index_t to) {
    const std::vector<token_range> todo{{region_.end, to}};
    if (caching_ && cached_.empty()) cached_.reserve((to - region_.begin) * features());  // at build
    for_each_chunk<true>(kv, todo, [](std::span<const index_t>) {}, [&](const auto& keys, const auto& values) {
      const row_matrix l = log_features(keys);
      require(l.allFinite(), "keys", "a key in [", region_.end, ", ", to, ") is NaN or Inf, or its features overflow");
      require(values.allFinite(), "values", "a value in [", region_.end, ", ", to, ") is NaN or Inf");
      const Eigen::VectorXf top = l.colwise().maxCoeff().transpose();
      const float headroom = caching_ ? cache_headroom : 0.f;
      const index_t m = features(), held = cached_.size() / std::max<index_t>(m, 1);
      for (Eigen::Index j = 0; j < l.cols(); ++j)
        if (top[j] > log_scale_[j] + headroom) {
          const float factor = std::exp(log_scale_[j] - top[j]);  // 0 while empty
          zeta_[j] *= factor;
          phi_.row(j) *= factor;
          for (index_t r = 0; r < held; ++r) {
            bfloat16& x = cached_[r * m + static_cast<index_t>(j)];
            x = bfloat16::from_float(x.to_float() * factor);
          }
          log_scale_[j] = top[j];
        }
      row_matrix e = l;
      e.rowwise() -= log_scale_.transpose();
      e = e.array().exp().matrix();
      if (caching_) {  // kept as rounded, and summed as rounded
        cached_.resize(cached_.size() + static_cast<std::size_t>(e.size()));
        bfloat16* out = cached_.data() + held * m;
        for (Eigen::Index r = 0; r < e.rows(); ++r)
          for (Eigen::Index j = 0; j < e.cols(); ++j) {
            *out = bfloat16::from_float(e(r, j));
            e(r, j) = (out++)->to_float();
          }
      }
      zeta_ += e.colwise().sum().transpose();
      phi_ += e.transpose() * values;
    });
    region_.end = to;
  }

  // Calls f(centred keys, values) for the tokens of `ranges`, chunk_tokens rows at a time;
  // without Values, f(centred keys, the chunk's tokens). before(tokens) runs first.
  template <bool Values, KvView KV, class Before, class F>
  void for_each_chunk(const KV& kv, const std::vector<token_range>& ranges, Before&& before, F&& f) const {
    // Per-thread buffers kept between calls: fresh pages every step cost more than the GEMMs.
    thread_local row_matrix keys, values;
    keys.resize(static_cast<Eigen::Index>(chunk_tokens), static_cast<Eigen::Index>(d_));
    if constexpr (Values) values.resize(static_cast<Eigen::Index>(chunk_tokens), static_cast<Eigen::Index>(dv_));
    constexpr index_t ahead = 8;  // rows in flight: scattered gathers are latency-bound
    for_each_token_chunk(ranges, [&](std::span<const index_t> tokens) {
      before(tokens);
      const index_t rows = tokens.size();
      for (index_t r = 0; r < rows; ++r) {
        if (r + ahead < rows) {
          detail::prefetch_row(kv.key_row(tokens[r + ahead]), d_);
          if constexpr (Values) detail::prefetch_row(kv.value_row(tokens[r + ahead]), dv_);
        }
        const auto row = static_cast<Eigen::Index>(r);
        detail::widen(kv.key_row(tokens[r]), &keys(row, 0), d_);
        if constexpr (Values) detail::widen(kv.value_row(tokens[r]), &values(row, 0), dv_);
        keys.row(row) -= centre_.transpose();
      }
      if constexpr (Values)
        f(keys.topRows(static_cast<Eigen::Index>(rows)), values.topRows(static_cast<Eigen::Index>(rows)));
      else
        f(keys.topRows(static_cast<Eigen::Index>(rows)), tokens);
    });
  }

  // The view must have the summary's shape and hold every token it summed (a cache cut
  // back below the region, as after rejected speculative tokens, needs a rebuild).
  template <KvView KV>
  void check_view(const KV& kv) const {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "summary built for d = ", d_, ", dv = ", dv_,
            "; the view has d = ", kv.d(), ", dv = ", kv.dv());
    require_view_covers(kv.n(), region_.end, "the feature-map summary");
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
  bool caching_ = false;
  std::vector<bfloat16, huge_page_allocator<bfloat16>> cached_;  // [region tokens, M], relative to sigma, when caching_
  token_range region_;
  Eigen::VectorXf log_scale_;  // sigma: [M]
  Eigen::VectorXf zeta_;       // [M]
  row_matrix phi_;             // [M, dv]
};

}  // namespace floe
