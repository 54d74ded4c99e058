// Scorer `quantized_scan` for topk_anchors: scans the 4-bit keys of the middle region for
// score estimates with deterministic bounds, keeps every token whose upper bound reaches
// the k-th largest lower bound (a superset of the true top k), and re-ranks those with
// their exact keys. docs/methods/retrieval-completion.md, "quantized_scan".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "floe/core/budget.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/quantized_keys.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

struct quantized_scan {
  static constexpr std::string_view name = "quantized_scan";
  // Re-rank at most ceil(rerank_factor * k) candidates, the best by estimate, when the
  // bounds admit more; 0 re-ranks all the bounds admit (then the exact top k is found).
  double rerank_factor = 2.0;

  using index = quantized_keys;

  template <KvView KV>
  index build(const KV& kv) const { return quantized_keys::build(kv); }

  // The tokens of `middle` (absolute positions, ascending) whose shared-score upper bound
  // reaches the k-th largest lower bound, before any cap; and the estimates behind them.
  struct candidate_set {
    index_t k = 0;                // tokens to keep (resolved from a mass budget)
    std::vector<index_t> tokens;
    std::vector<float> estimate;  // [heads, middle]: estimated scores
    std::vector<float> offsets;   // c_h: head h's largest estimate
    std::vector<float> shared;    // [middle]: shared score of the estimates
  };

  candidate_set candidates(const index& idx, const query_group& q, token_range middle, index_t k, const budget& b,
                           stats& io) const {
    const index_t n = middle.size(), g = q.heads;
    candidate_set cs;
    cs.estimate.resize(g * n);
    std::vector<float> radius(g * n);
    idx.scan(idx.prepare(q), middle.begin, middle.end, cs.estimate.data(), radius.data(), n);
    io.summary_bytes += static_cast<std::uint64_t>(n) * idx.bytes_per_token();
    if (b.kind == budget::unit::mass) k = ranking::top_p_count(cs.estimate.data(), g, n, n, b);
    cs.offsets = ranking::head_maxima(cs.estimate.data(), g, n, n);
    cs.shared.resize(n);
    ranking::shared_scores(cs.estimate.data(), g, n, n, cs.offsets, cs.shared.data());
    cs.k = k;
    if (k == 0) return cs;
    std::vector<float> lower(n), upper(n);
    for (index_t i = 0; i < n; ++i) {
      lower[i] = cs.estimate[i] - radius[i] - cs.offsets[0];
      upper[i] = cs.estimate[i] + radius[i] - cs.offsets[0];
    }
    for (index_t h = 1; h < g; ++h)
      for (index_t i = 0; i < n; ++i) {
        lower[i] = std::max(lower[i], cs.estimate[h * n + i] - radius[h * n + i] - cs.offsets[h]);
        upper[i] = std::max(upper[i], cs.estimate[h * n + i] + radius[h * n + i] - cs.offsets[h]);
      }
    const float threshold = ranking::kth_largest(lower.data(), n, k);
    for (index_t i = 0; i < n; ++i)
      if (upper[i] >= threshold) cs.tokens.push_back(middle.begin + i);
    return cs;
  }

  // Adds the chosen tokens of `middle` to `out` in increasing order. Returns true when
  // the exact keys of every chosen token were read (and counted) for the re-rank.
  template <KvView KV, class Exec>
  bool choose(const index& idx, const KV& kv, const query_group& q, const Exec& exec, token_range middle, index_t k,
              const budget& b, selection& out, stats& io) const {
    require(idx.d() == kv.d(), "index", "4-bit keys of d = ", idx.d(), " for a cache of d = ", kv.d());
    candidate_set cs = candidates(idx, q, middle, k, b, io);
    k = cs.k;
    if (k >= middle.size()) {
      out.add(middle.begin, middle.end);
      return false;
    }
    std::vector<index_t>& cand = cs.tokens;
    const auto cap = static_cast<index_t>(std::ceil(rerank_factor * static_cast<double>(k)));
    if (rerank_factor > 0 && cand.size() > cap) {
      for (index_t& t : cand) t -= middle.begin;
      cand = ranking::top_k(cs.shared.data(), middle.size(), cap, &cand);
      for (index_t& t : cand) t += middle.begin;
    }
    if (cand.size() <= k) {  // nothing to re-rank: attend them all
      for (index_t t : cand) out.add(t, t + 1);
      return false;
    }
    // Exact shared scores of the candidates, scored run by run.
    const index_t m = cand.size();
    std::vector<float> z(q.heads * m), exact(m);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t j = 0; j < m;) {
        index_t e = j + 1;
        while (e < m && cand[e] == cand[e - 1] + 1) ++e;
        exec.score(kv, q, h, token_range{cand[j], cand[e - 1] + 1}, z.data() + h * m + j);
        j = e;
      }
    io.key_bytes += static_cast<std::uint64_t>(m) * kv.d() * sizeof(typename KV::element_type);
    ranking::shared_scores(z.data(), q.heads, m, m, cs.offsets, exact.data());
    for (index_t j : ranking::top_k(exact.data(), m, k)) out.add(cand[j], cand[j] + 1);
    return true;
  }
};

}  // namespace floe::select
