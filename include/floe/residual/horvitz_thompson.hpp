// Residual `horvitz_thompson`: for a sample drawn with known inclusion probabilities pi_i
// (exp_threshold), sum_S w_i v_i / pi_i is unbiased for the full sum. The exact part
// already holds sum_S w_i v_i; this adds sum_S w_i v_i (1 - pi_i) / pi_i, which estimates
// the tokens left out, from the sampled rows only (no further reads). It also reports the
// selector's certificate. docs/methods/exp-threshold.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/widen.hpp"

namespace floe::residual {

struct horvitz_thompson {
  static constexpr std::string_view name = "horvitz_thompson";
  using index = no_index;

  template <KvView KV, class Selector>
  index build(const KV&, const Selector&, const typename Selector::index&) const {
    static_assert(requires(const typename Selector::selection& s) { s.sampled; s.odds; s.scores; s.certificate; },
                  "horvitz_thompson needs a selector whose selection carries inclusion probabilities (exp_threshold)");
    return {};
  }

  template <KvView KV, class Selection, class Exec, class Acc>
  void estimate(const index&, const KV& kv, const query_group& q, const Selection& sel, const Exec&,
                partial_set<Acc>& parts, stats& io) const {
    io.certificate = sel.certificate;
    const index_t s = sel.sampled.size(), dv = kv.dv();
    if (s == 0) return;
    // The rows were read by the exact part just before: widened once, shared by the heads.
    thread_local std::vector<float> values;
    values.resize(s * dv);
    for (index_t k = 0; k < s; ++k) floe::detail::widen(kv.value_row(sel.sampled[k]), values.data() + k * dv, dv);
    std::vector<double> log_weight(s), a(dv);
    std::vector<Acc> mean(dv);
    for (index_t h = 0; h < q.heads; ++h) {
      double top = -std::numeric_limits<double>::infinity();
      for (index_t k = 0; k < s; ++k) {
        log_weight[k] = double(sel.scores[h * s + k]) + std::log(sel.odds[k]);
        top = std::max(top, log_weight[k]);
      }
      std::fill(a.begin(), a.end(), 0.0);
      double l = 0;
      for (index_t k = 0; k < s; ++k) {
        const double w = std::exp(log_weight[k] - top);
        l += w;
        for (index_t j = 0; j < dv; ++j) a[j] += w * values[k * dv + j];
      }
      // The partial (log mass, 1, mean value) of the left-out tokens' estimate.
      for (index_t j = 0; j < dv; ++j) mean[j] = static_cast<Acc>(a[j] / l);
      parts.merge(h, static_cast<Acc>(top + std::log(l)), Acc(1), mean.data());
    }
  }
};

}  // namespace floe::residual
