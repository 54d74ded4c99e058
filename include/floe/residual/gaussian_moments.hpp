// Residual `gaussian_moments`: each uncovered group g (n_g keys ~ N(mu_g, diag var_g), value
// mean nu_g) contributes D_g = n_g exp(s q.mu_g + f_g s^2/2 sum q_t^2 var_g,t) and N_g = D_g nu_g
// (f_g: the group's fitted factor, mog_config::variance_fit_probes; 1 is the Gaussian's mgf),
// optionally N_g = D_g (nu_g + s C_g q) with the value-key covariance C_g. The estimates are
// merged in the log domain as the partial (log D, 1, N / D). docs/methods/mog.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/mog_index.hpp"

namespace floe::residual {

// A selection that hands over Gaussian groups: the mog_index they belong to, the uncovered
// groups, and their log-masses per head (computed while selecting, so not recomputed here).
template <class Sel>
concept GaussianGroupSelection = requires(const Sel& s) {
  { s.source } -> std::convertible_to<const mog_index*>;
  { s.heads } -> std::convertible_to<index_t>;
  { s.residual_groups[0] } -> std::convertible_to<std::uint32_t>;
  { s.residual_log_mass[0] } -> std::convertible_to<double>;
};

struct gaussian_moments {
  static constexpr std::string_view name = "gaussian_moments";
  bool cross_covariance = false;  // correct the value mean of uncovered clusters by s C_g q

  struct index {  // the moments live in the selector's mog_index
    std::uint64_t bytes() const { return 0; }
  };

  template <KvView KV, class S>
  index build(const KV&, const S&, const typename S::index& sidx) const {
    if constexpr (requires { sidx.has_cross_covariance(); })
      require(!cross_covariance || sidx.has_cross_covariance(), "residual.cross_covariance",
              "the selector's index was built without cross-covariance (set mog_config::cross_covariance)");
    return {};
  }

  template <KvView KV, GaussianGroupSelection Sel, class Exec, class Acc>
  void estimate(const index&, const KV& kv, const query_group& q, const Sel& sel, const Exec&, partial_set<Acc>& parts,
                stats& st) const {
    const index_t groups = sel.residual_groups.size();
    if (groups == 0) return;
    require(sel.source != nullptr && sel.heads == q.heads && sel.residual_log_mass.size() == q.heads * groups,
            "selection", "residual hints do not match the query group (", sel.heads, " heads, ", q.heads, " expected)");
    const mog_index& idx = *sel.source;
    const bool use_cov = cross_covariance && idx.has_cross_covariance();
    const index_t heads = q.heads, dv = kv.dv();

    // Weights exp(lambda - top_h) <= 1 of every group and head, in vector lanes, and the
    // weighted value means in float: a few hundred groups at most a few thousand, far
    // inside float's precision next to an estimate's own error (scalar double made a 128K
    // GQA-4 clustered step 4-9 % slower on the 2-core machine, 13-26 % on the device CPU; docs/methods/mog.md).
    std::vector<float> top(heads, -std::numeric_limits<float>::infinity());
    std::vector<double> l(heads, 0.0);
    thread_local std::vector<float> weight;  // [heads][groups]
    weight.resize(heads * groups);
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    for (index_t h = 0; h < heads; ++h) {
      const float* lam = sel.residual_log_mass.data() + h * groups;
      float* w = weight.data() + h * groups;
      top[h] = *std::max_element(lam, lam + groups);
      const lanes shift(top[h]);
      lanes sum(0.f);
      index_t j = 0;
      for (; j + L <= groups; j += L) {
        const lanes e = xsimd::exp(lanes::load_unaligned(lam + j) - shift);
        e.store_unaligned(w + j);
        sum += e;
      }
      double total = xsimd::hadd(sum);
      for (; j < groups; ++j) total += w[j] = std::exp(lam[j] - top[h]);
      l[h] = total;
    }

    std::vector<float> a(heads * dv, 0.f), shift(dv), value_mean(dv);
    const float* nu = value_mean.data();
    std::uint64_t bytes = groups * (dv * sizeof(half) + sizeof(float));  // fp16 value mean and its scale
    constexpr index_t rows_ahead = 4;  // value means asked for ahead of decoding
    for (index_t j = 0; j < groups; ++j) {
      const index_t g = sel.residual_groups[j];
      if (j + rows_ahead < groups) idx.prefetch_value_mean(sel.residual_groups[j + rows_ahead]);
      idx.decode_value_mean(g, value_mean.data());
      const bool corrected = use_cov && g < idx.clusters();
      if (corrected) bytes += idx.cross_covariance_width() * sizeof(float);
      for (index_t h = 0; h < heads; ++h) {
        const float e = weight[h * groups + j];
        if (!(e > 0.f)) continue;
        float* __restrict ah = a.data() + h * dv;
        if (corrected) {  // the tilted mean of v: nu + s Cov(v, k) q
          idx.cross_covariance_times(g, q.row(h), q.scale, shift.data());
          for (index_t i = 0; i < dv; ++i) ah[i] += e * (nu[i] + shift[i]);
        } else {
          for (index_t i = 0; i < dv; ++i) ah[i] += e * nu[i];
        }
      }
    }
    st.summary_bytes += bytes;

    std::vector<Acc> part(dv);
    for (index_t h = 0; h < heads; ++h) {
      if (!(l[h] > 0.0)) continue;
      for (index_t i = 0; i < dv; ++i) part[i] = static_cast<Acc>(a[h * dv + i]);
      parts.merge(h, static_cast<Acc>(top[h]), static_cast<Acc>(l[h]), part.data());
    }
  }
};

}  // namespace floe::residual
