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
#include "floe/core/default_init_vector.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/quantized_keys.hpp"
#include "floe/select/scorers/gathered_scores.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

struct quantized_scan {
  static constexpr std::string_view name = "quantized_scan";
  // Re-rank only the admitted tokens among the ceil(rerank_factor * k) best by estimate;
  // 0 re-ranks every token the bounds admit (then the exact top k is always found); 1
  // or less keeps the k best by estimate with no bounds and no re-rank (reads no keys).
  double rerank_factor = 1.25;
  // Key elements per 4-bit offset and scale (quantized_keys::build). 64 reads 10 % fewer
  // bytes at d = 128 and ranks as well; 32 keeps the estimates scan_completion sums tighter.
  index_t block_dims = quantized_tile::default_block_dims;

  using index = quantized_keys;

  template <KvView KV>
  index build(const KV& kv) const { return quantized_keys::build(kv, block_dims); }

  // The tokens of `middle` (absolute positions, ascending) whose shared-score upper bound
  // reaches the k-th largest lower bound, cut to the best by estimate when capped.
  struct candidate_set {
    index_t k = 0;                // tokens to keep (resolved from a mass budget)
    std::vector<index_t> tokens;
    std::vector<float> offsets;   // c_h: head h's largest estimate
  };

  // The estimates go to `keep` ([heads, middle.size()]) when given, else to scratch; the
  // shared scores (when k > 0) to `keep_shared` when given.
  candidate_set candidates(const index& idx, const query_group& q, token_range middle, index_t k, const budget& b,
                           stats& io, default_init_vector<float>* keep = nullptr,
                           default_init_vector<float>* keep_shared = nullptr) const {
    struct estimate_tag;
    struct radius_tag;
    struct lower_tag;
    struct upper_tag;
    struct shared_tag;
    const index_t n = middle.size(), g = q.heads;
    candidate_set cs;
    if (keep) keep->resize(g * n);
    float* estimate = keep ? keep->data() : ranking::scratch<estimate_tag>(g * n);
    const bool by_estimate = rerank_factor > 0 && rerank_factor <= 1;
    float* radius = by_estimate ? nullptr : ranking::scratch<radius_tag>(g * n);
    cs.offsets.resize(g);
    idx.scan(idx.prepare(q), middle.begin, middle.end, estimate, radius, n, scan_kernel::automatic, cs.offsets.data());
    io.summary_bytes += static_cast<std::uint64_t>(n) * idx.bytes_per_token();
    if (b.kind == budget::unit::mass) k = ranking::top_p_count(estimate, g, n, n, b);
    cs.k = k;
    if (k == 0) return cs;
    if (keep_shared) keep_shared->resize(n);
    float* shared = keep_shared ? keep_shared->data() : ranking::scratch<shared_tag>(n);
    if (by_estimate) {  // the k best by shared estimate are the choice
      ranking::shared_scores(estimate, g, n, n, cs.offsets, shared);
      cs.tokens = ranking::top_k(shared, n, k);
      for (index_t& t : cs.tokens) t += middle.begin;
      return cs;
    }
    float* lower = ranking::scratch<lower_tag>(n);
    float* upper = ranking::scratch<upper_tag>(n);
    constexpr index_t span = 256;  // tokens per pass over the heads: the rows stay in L1
    for (index_t i0 = 0; i0 < n; i0 += span) {
      const index_t i1 = std::min(n, i0 + span);
      for (index_t i = i0; i < i1; ++i) lower[i] = upper[i] = shared[i] = -std::numeric_limits<float>::infinity();
      for (index_t h = 0; h < g; ++h) {
        const float* __restrict e = estimate + h * n;
        const float* __restrict r = radius + h * n;
        const float c = cs.offsets[h];
        for (index_t i = i0; i < i1; ++i) {
          lower[i] = std::max(lower[i], e[i] - r[i] - c);
          upper[i] = std::max(upper[i], e[i] + r[i] - c);
          shared[i] = std::max(shared[i], e[i] - c);
        }
      }
    }
    const float threshold = ranking::kth_largest(lower, n, k);
    const auto cap = static_cast<index_t>(std::ceil(rerank_factor * static_cast<double>(k)));
    const float best = rerank_factor > 0 && cap < n ? ranking::kth_largest(shared, n, cap)
                                                    : -std::numeric_limits<float>::infinity();
    thread_local std::vector<index_t> passed;
    if (passed.size() < n) passed.resize(n);
    index_t m = 0;
    for (index_t i = 0; i < n; ++i) {  // branch-free: about one token in twenty passes
      passed[m] = middle.begin + i;
      m += upper[i] >= threshold && shared[i] >= best ? 1 : 0;
    }
    cs.tokens.assign(passed.begin(), passed.begin() + static_cast<std::ptrdiff_t>(m));
    return cs;
  }

  // Adds the chosen tokens of `middle` to `out` in increasing order. Returns true when
  // the exact keys of every chosen token were read (and counted) for the re-rank.
  // A selection with `estimates`, `shared` and `offsets` members keeps the scan's
  // estimates, the shared scores and the head maxima there.
  template <KvView KV, class Exec, class Selection>
  bool choose(const index& idx, const KV& kv, const query_group& q, const Exec&, token_range middle, index_t k,
              const budget& b, Selection& out, stats& io) const {
    require(idx.d() == kv.d(), "index", "4-bit keys of d = ", idx.d(), " for a cache of d = ", kv.d());
    default_init_vector<float>* keep = nullptr;
    default_init_vector<float>* keep_shared = nullptr;
    if constexpr (requires { out.estimates; }) keep = &out.estimates;
    if constexpr (requires { out.shared; }) keep_shared = &out.shared;
    const candidate_set cs = candidates(idx, q, middle, k, b, io, keep, keep_shared);
    if constexpr (requires { out.offsets; })
      if (keep_shared && keep_shared->size() == middle.size()) out.offsets = cs.offsets;
    k = cs.k;
    if (k >= middle.size()) {
      out.add(middle.begin, middle.end);
      return false;
    }
    const std::vector<index_t>& cand = cs.tokens;
    if (cand.size() <= k) {  // nothing to re-rank: attend them all
      for (index_t t : cand) out.add(t, t + 1);
      return false;
    }
    // Exact scores of the candidates, each key widened once and dotted with every head.
    const index_t m = cand.size();
    std::vector<float> z(q.heads * m);
    io.key_bytes += ranking::gathered_scores(kv, q, cand.data(), m, z.data(), m);
    std::vector<float> exact(cand.size());
    ranking::shared_scores(z.data(), q.heads, m, m, cs.offsets, exact.data());
    for (index_t j : ranking::top_k(exact.data(), cand.size(), k)) out.add(cand[j], cand[j] + 1);
    return true;
  }
};

}  // namespace floe::select
