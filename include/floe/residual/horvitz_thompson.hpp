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

namespace floe::residual {

struct horvitz_thompson {
  static constexpr std::string_view name = "horvitz_thompson";
  using index = no_index;

  template <KvView KV, class Selector>
  index build(const KV&, const Selector&, const typename Selector::index&) const {
    static_assert(requires(const typename Selector::selection& s) { s.residual_log_mass; s.residual_mean; s.certificate; },
                  "horvitz_thompson needs a selector whose selection carries inclusion probabilities (exp_threshold)");
    return {};
  }

  // The selector summed sum_S w_i v_i (1 - pi_i) / pi_i while it certified the level
  // (from rows it had read); this merges it, one partial per head.
  template <KvView KV, class Selection, class Exec, class Acc>
  void estimate(const index&, const KV& kv, const query_group& q, const Selection& sel, const Exec&,
                partial_set<Acc>& parts, stats& io) const {
    io.certificate = sel.certificate;
    if (sel.residual_log_mass.empty()) return;
    const index_t dv = kv.dv();
    std::vector<Acc> mean(dv);
    for (index_t h = 0; h < q.heads; ++h) {
      if (!(sel.residual_log_mass[h] > -std::numeric_limits<double>::infinity())) continue;
      for (index_t j = 0; j < dv; ++j) mean[j] = static_cast<Acc>(sel.residual_mean[h * dv + j]);
      parts.merge(h, static_cast<Acc>(sel.residual_log_mass[h]), Acc(1), mean.data());
    }
  }
};

}  // namespace floe::residual
