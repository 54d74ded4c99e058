// Selector `oracle_topk`: the k tokens of largest true attention weight, found by scoring
// every key. A baseline for "error at equal keys read", not a fast method: it reads every
// key to choose, and its stats say so (docs/evaluation.md, "oracle_topk").
#pragma once

#include <string_view>

#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/select/scorers/group_weights.hpp"

namespace floe::select {

struct oracle_topk {
  static constexpr std::string_view name = "oracle_topk";
  index_t k = 0;  // tokens attended exactly; k >= n attends everything without scoring

  using index = no_index;
  using selection = floe::selection;

  template <KvView KV>
  index build(const KV&) const { return {}; }

  // The GQA group shares one exact set, ranked by group_attention_weights.
  template <KvView KV, class Exec>
  void select(const index&, const KV& kv, const query_group& q, const Exec& exec, selection& out, stats& io) const {
    out.clear();
    const index_t n = kv.n();
    if (k >= n) {
      out.add(0, n);
      return;
    }
    add_group_top_k(kv, q, exec, k, out);
    out.keys_counted = true;
    io.key_bytes += static_cast<std::uint64_t>(n) * kv.d() * sizeof(typename KV::element_type);
  }
};

}  // namespace floe::select
