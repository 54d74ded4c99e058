// The attention weight of every token summed over a GQA group's query heads (each head's
// softmax sums to 1), and its top k: the ranking of oracle_topk and of anchor_reuse's
// anchor layers. Summing over the group minimises the total weight a shared set leaves out.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"

namespace floe::select {

// weight[i] = sum_h softmax_h(z)_i over the n tokens of kv; z is scratch.
template <KvView KV, class Exec>
void group_attention_weights(const KV& kv, const query_group& q, const Exec& exec, std::vector<float>& z,
                             std::vector<float>& weight) {
  const index_t n = kv.n();
  z.resize(n);
  weight.assign(n, 0.f);
  for (index_t h = 0; h < q.heads; ++h) {
    exec.score(kv, q, h, token_range{0, n}, z.data());
    const float top = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (index_t i = 0; i < n; ++i) sum += (z[i] = std::exp(z[i] - top));
    const float inv = static_cast<float>(1.0 / sum);
    for (index_t i = 0; i < n; ++i) weight[i] += z[i] * inv;
  }
}

// The k < weight.size() heaviest tokens (ties to the lower index), as sorted ranges of out.
inline void add_top_k(const std::vector<float>& weight, index_t k, selection& out) {
  std::vector<index_t> order(weight.size());
  std::iota(order.begin(), order.end(), index_t{0});
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                   [&](index_t a, index_t b) { return weight[a] > weight[b] || (weight[a] == weight[b] && a < b); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  add_sorted_indices(out, order);
}

}  // namespace floe::select
