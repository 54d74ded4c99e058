// Scorer `exact_scan` for topk_anchors: scores every key of the middle region exactly and
// keeps the top k. Reads every middle key, so it is the accuracy ceiling of Top-K, not a
// way to save reads. docs/methods/retrieval-completion.md.
#pragma once

#include <algorithm>
#include <string_view>
#include <utility>
#include <vector>

#include "floe/core/budget.hpp"
#include "floe/core/default_init_vector.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

struct exact_scan {
  static constexpr std::string_view name = "exact_scan";

  // Nothing is built; every token is always covered.
  struct index {
    std::uint64_t bytes() const { return 0; }
    index_t tokens() const { return std::numeric_limits<index_t>::max(); }
    template <KvView KV>
    void append(const KV&) {}
  };

  template <KvView KV>
  index build(const KV&) const { return {}; }

  // Adds the chosen tokens of `middle` to `out` in increasing order: the k of largest
  // shared score (k from the budget when it is a mass budget). Returns true: the keys
  // of every chosen token were read, and counted, while choosing.
  // A selection with `estimates`, `shared` and `offsets` members keeps the exact scores,
  // the shared scores and the head maxima there.
  template <KvView KV, class Exec, class Selection>
  bool choose(const index&, const KV& kv, const query_group& q, const Exec& exec, token_range middle, index_t k,
              const budget& b, Selection& out, stats& io) const {
    const index_t n = middle.size();
    default_init_vector<float> z(q.heads * n);
    for (index_t h = 0; h < q.heads; ++h) exec.score(kv, q, h, middle, z.data() + h * n);
    io.key_bytes += static_cast<std::uint64_t>(n) * kv.d() * sizeof(typename KV::element_type);
    if (b.kind == budget::unit::mass) k = ranking::top_p_count(z.data(), q.heads, n, n, b);
    default_init_vector<float> shared(n);
    std::vector<float> offsets = ranking::head_maxima(z.data(), q.heads, n, n);
    ranking::shared_scores(z.data(), q.heads, n, n, offsets, shared.data());
    for (index_t i : ranking::top_k(shared.data(), n, k)) out.add(middle.begin + i, middle.begin + i + 1);
    if constexpr (requires { out.estimates; }) out.estimates = std::move(z);
    if constexpr (requires { out.shared; }) out.shared = std::move(shared);
    if constexpr (requires { out.offsets; }) out.offsets = std::move(offsets);
    return true;
  }
};

}  // namespace floe::select
