// The attention weight of every token summed over a GQA group's query heads (each head's
// softmax sums to 1), and its top k: the ranking of oracle_topk and of anchor_reuse's
// anchor layers. Summing over the group minimises the total weight a shared set leaves out.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

// Refuses a cache whose scores are not finite (a NaN or Inf key; the query is checked
// before): the ranking below compares weights, and NaN ones have no order. Named by token.
template <KvView KV>
[[noreturn]] void refuse_nonfinite_scores(const KV& kv, index_t head) {
  for (index_t i = 0; i < kv.n(); ++i)
    for (index_t t = 0; t < kv.d(); ++t)
      require(std::isfinite(to_float(kv.key_row(i)[t])), "kv", "key ", i, " element ", t, " is NaN or Inf");
  throw invalid_argument("kv", floe::detail::concat("the scores of query head ", head, " overflow float"));
}

// weight[i] = sum_h softmax_h(z)_i over the n tokens of kv; z is scratch ([heads, n]).
// Each key comes from memory once: through the executor's score_group where it has one,
// else in tiles that stay in the L2 cache while every head of the group scores them.
template <KvView KV, class Exec>
void group_attention_weights(const KV& kv, const query_group& q, const Exec& exec, std::vector<float>& z,
                             std::vector<float>& weight) {
  using lanes = xsimd::batch<float>;
  constexpr index_t L = lanes::size, tile = 2048;
  const index_t n = kv.n();
  z.resize(static_cast<std::size_t>(q.heads) * n);
  weight.resize(n);
  if constexpr (requires { exec.score_group(kv, q, token_range{}, z.data(), n); }) {
    exec.score_group(kv, q, token_range{0, n}, z.data(), n);
  } else {
    for (index_t b = 0; b < n; b += tile)
      for (index_t h = 0; h < q.heads; ++h)
        exec.score(kv, q, h, token_range{b, std::min(n, b + tile)}, z.data() + h * n);
  }
  // Per head: its maximum, then its exponentials in place and their sum; one last pass
  // adds every head's normalised weights, so `weight` is written once, not once per head.
  thread_local std::vector<float> inv;
  inv.resize(static_cast<std::size_t>(q.heads));
  for (index_t h = 0; h < q.heads; ++h) {
    float* zh = z.data() + static_cast<std::size_t>(h) * n;
    lanes top_lanes(-std::numeric_limits<float>::infinity());
    index_t i = 0;
    for (; i + L <= n; i += L) top_lanes = xsimd::max(top_lanes, lanes::load_unaligned(zh + i));
    alignas(64) float spill[L];  // xsimd 8.1 has no reduce_max
    top_lanes.store_aligned(spill);
    float top = *std::max_element(spill, spill + L);
    for (; i < n; ++i) top = std::max(top, zh[i]);
    lanes sum_lanes(0.f);
    for (i = 0; i + L <= n; i += L) {
      const lanes e = xsimd::exp(lanes::load_unaligned(zh + i) - lanes(top));
      e.store_unaligned(zh + i);
      sum_lanes += e;
    }
    double sum = xsimd::hadd(sum_lanes);
    for (; i < n; ++i) sum += (zh[i] = std::exp(zh[i] - top));
    if (!std::isfinite(sum)) refuse_nonfinite_scores(kv, h);  // each term is at most 1 unless a score is NaN or Inf
    inv[h] = static_cast<float>(1.0 / sum);
  }
  index_t i = 0;
  for (; i + L <= n; i += L) {
    lanes w(0.f);
    for (index_t h = 0; h < q.heads; ++h)
      w = xsimd::fma(lanes::load_unaligned(z.data() + static_cast<std::size_t>(h) * n + i), lanes(inv[h]), w);
    w.store_unaligned(weight.data() + i);
  }
  for (; i < n; ++i) {
    float w = 0.f;
    for (index_t h = 0; h < q.heads; ++h) w += z[static_cast<std::size_t>(h) * n + i] * inv[h];
    weight[i] = w;
  }
}

// The k < weight.size() heaviest of the weights (ties to the lower index), as sorted
// ranges of out: the k-th largest by radix selection, then one pass in token order.
inline void add_top_k(const std::vector<float>& weight, index_t k, selection& out) {
  if (k == 0) return;
  const auto n = static_cast<index_t>(weight.size());
  const float kth = ranking::kth_largest_radix(weight.data(), n, k);
  index_t greater = 0;
  for (float w : weight) greater += w > kth ? 1 : 0;
  index_t ties = k - greater;  // tokens of weight exactly kth to take, lowest index first
  for (index_t i = 0; i < n; ++i)
    if (weight[i] > kth || (weight[i] == kth && ties > 0 && ties--)) out.add(i, i + 1);
}

// The k heaviest tokens of the group's summed weights added to out; the scratch is per
// thread, so a decode step allocates nothing once the thread has seen the longest cache.
// An executor with its own group_top_k (exec::cuda: on the device) ranks instead.
template <KvView KV, class Exec>
void add_group_top_k(const KV& kv, const query_group& q, const Exec& exec, index_t k, selection& out) {
  if constexpr (requires { exec.group_top_k(kv, q, k, out); }) {
    exec.group_top_k(kv, q, k, out);
    return;
  }
  thread_local std::vector<float> z, weight;
  group_attention_weights(kv, q, exec, z, weight);
  add_top_k(weight, k, out);
}

}  // namespace floe::select
