// Residual `gaussian_moments`: each uncovered group g (n_g keys ~ N(mu_g, diag var_g), value
// mean nu_g) contributes D_g = n_g exp(s q.mu_g + s^2/2 sum q_t^2 var_g,t) and N_g = D_g nu_g,
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
    const index_t heads = q.heads, dv = kv.dv(), d = kv.d();

    std::vector<double> top(heads, -std::numeric_limits<double>::infinity()), l(heads, 0.0), a(heads * dv, 0.0);
    for (index_t h = 0; h < heads; ++h)
      for (index_t j = 0; j < groups; ++j) top[h] = std::max(top[h], static_cast<double>(sel.residual_log_mass[h * groups + j]));

    std::vector<double> shift(dv);
    std::vector<float> value_mean(dv);
    const float* nu = value_mean.data();
    std::uint64_t bytes = groups * (dv * sizeof(half) + sizeof(float));  // fp16 value mean and its scale
    for (index_t j = 0; j < groups; ++j) {
      const index_t g = sel.residual_groups[j];
      idx.decode_value_mean(g, value_mean.data());
      const bool corrected = use_cov && g < idx.clusters();
      if (corrected) bytes += dv * d * sizeof(float);
      for (index_t h = 0; h < heads; ++h) {
        const double e = std::exp(static_cast<double>(sel.residual_log_mass[h * groups + j]) - top[h]);
        if (!(e > 0.0)) continue;
        l[h] += e;
        double* ah = a.data() + h * dv;
        if (corrected) {  // the tilted mean of v: nu + s Cov(v, k) q
          const float* cov = idx.cross_covariance(g);
          const float* qh = q.row(h);
          for (index_t i = 0; i < dv; ++i) {
            double dot = 0.0;
            for (index_t t = 0; t < d; ++t) dot += static_cast<double>(cov[i * d + t]) * qh[t];
            shift[i] = q.scale * dot;
          }
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
