// Selector `oracle_topk`: the k tokens of largest true attention weight, found by scoring
// every key. A baseline for "error at equal keys read", not a fast method: it reads every
// key to choose, and its stats say so (docs/evaluation.md, "oracle_topk").
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string_view>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/no_index.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"

namespace floe::select {

struct oracle_topk {
  static constexpr std::string_view name = "oracle_topk";
  index_t k = 0;  // tokens attended exactly; k >= n attends everything without scoring

  using index = no_index;
  using selection = floe::selection;

  template <KvView KV>
  index build(const KV&) const { return {}; }

  // The GQA group shares one exact set: tokens are ranked by their attention weight summed
  // over the group's query heads, which minimises the total weight left out.
  template <KvView KV, class Exec>
  void select(const index&, const KV& kv, const query_group& q, const Exec& exec, selection& out, stats& io) const {
    out.clear();
    const index_t n = kv.n();
    if (k >= n) {
      out.add(0, n);
      return;
    }
    std::vector<float> z(n);
    std::vector<float> weight(n, 0.f);
    for (index_t h = 0; h < q.heads; ++h) {
      exec.score(kv, q, h, token_range{0, n}, z.data());
      const float top = *std::max_element(z.begin(), z.end());
      double sum = 0.0;
      for (index_t i = 0; i < n; ++i) sum += (z[i] = std::exp(z[i] - top));
      const float inv = static_cast<float>(1.0 / sum);
      for (index_t i = 0; i < n; ++i) weight[i] += z[i] * inv;
    }
    std::vector<index_t> order(n);
    std::iota(order.begin(), order.end(), index_t{0});
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                     [&](index_t a, index_t b) { return weight[a] > weight[b] || (weight[a] == weight[b] && a < b); });
    order.resize(k);
    std::sort(order.begin(), order.end());
    add_sorted_indices(out, order);
    out.keys_counted = true;
    io.key_bytes += static_cast<std::uint64_t>(n) * kv.d() * sizeof(typename KV::element_type);
  }
};

}  // namespace floe::select
