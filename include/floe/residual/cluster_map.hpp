// Residual `cluster_map` ("feature_map:clusters"): the feature-map completion with a
// data-dependent map instead of random features. phi(k) is k's cluster as a one-hot
// vector (M k-means clusters of the middle, built at prefill), so zeta holds the clusters'
// counts and Phi their value sums; the retrieved tokens' own features are taken out
// (counts; value sums optionally). phi_m(q) is cluster m's Gaussian score distribution
// truncated at the selection threshold: the left-out members scored below the retrieved
// ones, so E[e^z | z < tau] and not the untruncated E[e^z], whose tail the retrieval took.
// docs/methods/retrieval-completion.md, "The cluster map".
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/cluster_summary.hpp"
#include "floe/residual/anchored_region.hpp"
#include "floe/select/scorers/gathered_scores.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::residual {

struct cluster_map {
  static constexpr std::string_view name = "feature_map:clusters";
  index_t clusters = 64;   // M
  index_t iterations = 6;  // Lloyd iterations of the build's k-means
  std::uint64_t seed = 1;
  // The left-out members' value mean: false, their cluster's (the e^z weighting favours
  // members near the retrieved ones, whose values the whole cluster's mean keeps: 10-15 %
  // lower p90 on the SmolLM2 dumps, and no value rows read); true, the cluster's without
  // the retrieved members (exact when a cluster's keys coincide).
  bool subtract_values = false;

  using index = cluster_summary;

  template <KvView KV, class S>
  index build(const KV& kv, const S& selector, const typename S::index&) const {
    return cluster_summary::build(kv, anchored_region(selector, kv.n()), anchored_window(selector), clusters,
                                  iterations, seed);
  }

  template <KvView KV, class Selection, class Exec, class Acc>
    requires requires(const Selection& s) {
      s.middle;
      s.retrieved;
    }
  void estimate(const index& idx, const KV& kv, const query_group& q, const Selection& sel, const Exec&,
                partial_set<Acc>& parts, stats& io) const {
    const token_range mid = sel.middle;
    index_t retrieved = 0;
    for (const token_range& r : sel.retrieved) retrieved += r.size();
    if (retrieved >= mid.size()) return;  // the whole middle was read: nothing to add
    require(idx.region() == mid, "index", "clusters over [", idx.region().begin, ", ", idx.region().end,
            ") but the middle is [", mid.begin, ", ", mid.end, "): append the cache's new tokens to the residual index");
    const std::vector<double> tau = thresholds(kv, q, sel);
    idx.estimate(kv, q, std::span<const token_range>(sel.retrieved), tau.data(), parts, subtract_values);
    io.summary_bytes += idx.read_bytes(retrieved);
  }

  // tau_h, the score below which head h's left-out tokens lie: a group's selection keeps
  // the tokens of largest shared score f_i = max_h (z_hi - c_h), so every left-out token
  // has z_hi <= c_h + f_k, f_k the smallest kept shared score. From the scorer's own
  // scores when the selection carries them (c_h its offsets), else from the retrieved
  // keys' exact scores (c_h their largest). +inf when nothing was retrieved.
  template <KvView KV, class Selection>
  static std::vector<double> thresholds(const KV& kv, const query_group& q, const Selection& sel) {
    const index_t g = q.heads;
    std::vector<double> tau(g, std::numeric_limits<double>::infinity());
    const token_range mid = sel.middle;
    if (sel.retrieved.empty()) return tau;
    if constexpr (requires { sel.shared; sel.offsets; }) {
      if (sel.shared.size() == mid.size() && sel.offsets.size() == g) {
        float f = std::numeric_limits<float>::infinity();
        for (const token_range& r : sel.retrieved)
          for (index_t i = r.begin; i < r.end; ++i) f = std::min(f, sel.shared[i - mid.begin]);
        for (index_t h = 0; h < g; ++h) tau[h] = static_cast<double>(sel.offsets[h]) + f;
        return tau;
      }
    }
    std::vector<index_t> tokens;
    for (const token_range& r : sel.retrieved)
      for (index_t i = r.begin; i < r.end; ++i) tokens.push_back(i);
    const index_t m = tokens.size();
    std::vector<float> z(g * m);
    select::ranking::gathered_scores(kv, q, tokens.data(), m, z.data(), m);
    const std::vector<float> c = select::ranking::head_maxima(z.data(), g, m, m);
    std::vector<float> shared(m);
    select::ranking::shared_scores(z.data(), g, m, m, c, shared.data());
    const float f = *std::min_element(shared.begin(), shared.end());
    for (index_t h = 0; h < g; ++h) tau[h] = static_cast<double>(c[h]) + f;
    return tau;
  }
};

}  // namespace floe::residual
