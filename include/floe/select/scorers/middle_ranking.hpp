// What every scorer of topk_anchors shares: how a budget becomes a token count for the
// middle region, the shared score of a GQA group, and picking the top k.
// docs/methods/retrieval-completion.md, "GQA" and "budgets".
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "floe/core/budget.hpp"
#include "floe/core/config.hpp"

namespace floe::select::ranking {

// The head-wise maxima c_h of scores laid out [heads, ld] over `count` tokens.
inline std::vector<float> head_maxima(const float* scores, index_t heads, index_t count, index_t ld) {
  std::vector<float> c(heads, -std::numeric_limits<float>::infinity());
  for (index_t h = 0; h < heads; ++h)
    for (index_t i = 0; i < count; ++i) c[h] = std::max(c[h], scores[h * ld + i]);
  return c;
}

// The group's shared score of token i: max_h (z_h,i - c_h), the log-weight of the token
// relative to the head's largest, for the head that weighs it most. It is monotone in
// every z_h, so bounds on the z_h bound it.
inline void shared_scores(const float* scores, index_t heads, index_t count, index_t ld, const std::vector<float>& c,
                          float* out) {
  for (index_t i = 0; i < count; ++i) out[i] = scores[i] - c[0];
  for (index_t h = 1; h < heads; ++h)
    for (index_t i = 0; i < count; ++i) out[i] = std::max(out[i], scores[h * ld + i] - c[h]);
}

// Orders i before j when its key is larger, ties by position: every ranking is deterministic.
struct larger_first {
  const float* key;
  bool operator()(index_t i, index_t j) const { return key[i] > key[j] || (key[i] == key[j] && i < j); }
};

// The positions (ascending) of the k largest keys among candidates (all of [0, count) when
// `candidates` is null).
inline std::vector<index_t> top_k(const float* key, index_t count, index_t k, const std::vector<index_t>* candidates = nullptr) {
  std::vector<index_t> order;
  if (candidates) order = *candidates;
  else {
    order.resize(count);
    std::iota(order.begin(), order.end(), index_t{0});
  }
  k = std::min<index_t>(k, order.size());
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), larger_first{key});
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

// The k-th largest key (k >= 1), or -inf when k exceeds count.
inline float kth_largest(const float* key, index_t count, index_t k) {
  if (k == 0 || k > count) return -std::numeric_limits<float>::infinity();
  std::vector<float> copy(key, key + count);
  std::nth_element(copy.begin(), copy.begin() + static_cast<std::ptrdiff_t>(k - 1), copy.end(), std::greater<float>{});
  return copy[k - 1];
}

// Top-p: the fewest tokens whose estimated share of the middle's attention reaches p,
// averaged over the group's heads (each head's estimated softmax over the middle), then
// clamped to [floor, cap] and to the middle.
inline index_t top_p_count(const float* scores, index_t heads, index_t count, index_t ld, const budget& b) {
  const std::vector<float> c = head_maxima(scores, heads, count, ld);
  std::vector<double> share(count, 0.0);
  for (index_t h = 0; h < heads; ++h) {
    double total = 0.0;
    for (index_t i = 0; i < count; ++i) total += std::exp(static_cast<double>(scores[h * ld + i]) - c[h]);
    for (index_t i = 0; i < count; ++i)
      share[i] += std::exp(static_cast<double>(scores[h * ld + i]) - c[h]) / (total * static_cast<double>(heads));
  }
  std::sort(share.begin(), share.end(), std::greater<double>{});
  index_t k = 0;
  double reached = 0.0;
  while (k < count && reached < b.value * (1.0 - 1e-12)) reached += share[k++];
  return std::min({std::max(k, b.floor), b.cap, count});
}

// The token count a budget grants the middle region of `count` tokens: counts and
// fractions resolve against the middle (a count larger than the middle is an error);
// mass budgets need the scores (top_p_count) and return 0 here.
inline index_t fixed_count(const budget& b, index_t count) {
  if (b.kind == budget::unit::mass) {
    b.resolve(count);  // checks p, floor and cap
    return 0;
  }
  return b.resolve(count);
}

}  // namespace floe::select::ranking
