// Residual `scan_completion`: completes topk_anchors from the score estimates its scorer
// already made for every middle token (quantized_scan: the 4-bit scan), reading no keys.
// Of the middle tokens the exact part left out, the `value_tier` x (exact count) with the
// largest estimated shared score have their values read and enter with their estimated
// weights exp(e_h,i); the rest enter as D^ = sum of exp(e_h,i) times their mean value,
// which an index of the middle's value sum gives exactly (sum minus the rows read).
// docs/methods/retrieval-completion.md, "scan_completion".
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/value_sum.hpp"
#include "floe/index/widen.hpp"
#include "floe/residual/anchored_region.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::residual {

struct scan_completion {
  static constexpr std::string_view name = "scan_completion";
  // Value-only tokens per exact token: 1 reads half the exact part's bytes again.
  double value_tier = 1.0;

  using index = value_sum;

  template <KvView KV, class S>
  index build(const KV& kv, const S& selector, const typename S::index&) const {
    require(std::isfinite(value_tier) && value_tier >= 0.0, "value_tier", "must be finite and >= 0, got ", value_tier);
    return value_sum::build(kv, anchored_region(selector, kv.n()), anchored_window(selector));
  }

  template <KvView KV, class Selection, class Exec, class Acc>
    requires requires(const Selection& s) {
      s.estimates;
      s.middle;
      s.retrieved;
    }
  void estimate(const index& idx, const KV& kv, const query_group& q, const Selection& sel, const Exec&,
                partial_set<Acc>& parts, stats& io) const {
    const token_range mid = sel.middle;
    const index_t n = mid.size(), g = q.heads, dv = kv.dv();
    index_t read_in_middle = 0;
    for (const token_range& r : sel.retrieved) read_in_middle += r.size();
    if (read_in_middle >= n) return;  // the whole middle was read: nothing to add
    require(idx.region() == mid, "index", "value sum over [", idx.region().begin, ", ", idx.region().end,
            ") but the middle is [", mid.begin, ", ", mid.end, "): append the cache's new tokens to the residual index");
    require(sel.estimates.size() == g * n, "selection",
            "scan_completion needs the scorer's score estimates of the middle (quantized_scan or exact_scan), got ",
            sel.estimates.size(), " for ", g, " heads x ", n, " tokens");
    const float* e = sel.estimates.data();
    // 0: left out, 1: read exactly, 2: in the value tier.
    thread_local std::vector<unsigned char> role;
    role.assign(n, 0);
    for (const token_range& r : sel.retrieved)
      for (index_t i = r.begin; i < r.end; ++i) role[i - mid.begin] = 1;

    // Per-head reference c_h (largest left-out estimate) and the group's shared score.
    const float none = -std::numeric_limits<float>::infinity();
    std::vector<float> c(g, none);
    for (index_t h = 0; h < g; ++h)
      for (index_t i = 0; i < n; ++i)
        if (role[i] == 0) c[h] = std::max(c[h], e[h * n + i]);
    thread_local std::vector<float> shared;
    shared.assign(n, none);
    for (index_t h = 0; h < g; ++h)
      for (index_t i = 0; i < n; ++i)
        if (role[i] == 0) shared[i] = std::max(shared[i], e[h * n + i] - c[h]);
    const index_t left = n - read_in_middle;
    const index_t tier = std::min<index_t>(
        left, static_cast<index_t>(std::llround(value_tier * static_cast<double>(sel.count()))));
    if (tier > 0) {
      const float bar = select::ranking::kth_largest(shared.data(), n, tier);
      index_t taken = 0;
      for (index_t i = 0; i < n && taken < tier; ++i)  // above the bar first, then ties in order
        if (role[i] == 0 && shared[i] > bar) role[i] = 2, ++taken;
      for (index_t i = 0; i < n && taken < tier; ++i)
        if (role[i] == 0 && shared[i] == bar) role[i] = 2, ++taken;
    }

    std::vector<double> mass(g, 0.0), rest(g, 0.0), numer(g * dv, 0.0), read_sum(dv, 0.0);
    std::vector<float> v(dv);
    for (index_t i = 0; i < n; ++i) {
      if (role[i] == 0) {
        for (index_t h = 0; h < g; ++h) rest[h] += std::exp(static_cast<double>(e[h * n + i] - c[h]));
        continue;
      }
      floe::detail::widen(kv.value_row(mid.begin + i), v.data(), dv);  // tier rows, and the exact rows read already
      for (index_t j = 0; j < dv; ++j) read_sum[j] += v[j];
      if (role[i] == 1) continue;
      for (index_t h = 0; h < g; ++h) {
        const double w = std::exp(static_cast<double>(e[h * n + i] - c[h]));
        mass[h] += w;
        for (index_t j = 0; j < dv; ++j) numer[h * dv + j] += w * v[j];
      }
    }
    io.value_bytes += static_cast<std::uint64_t>(tier) * dv * sizeof(typename KV::element_type);
    io.summary_bytes += idx.bytes();

    const index_t rest_count = left - tier;
    std::vector<Acc> mean(dv);
    for (index_t h = 0; h < g; ++h) {
      const double total = mass[h] + (rest_count > 0 ? rest[h] : 0.0);
      if (!(total > 0.0)) continue;
      for (index_t j = 0; j < dv; ++j) {
        const double rest_mean = rest_count > 0 ? (idx.sum()[j] - read_sum[j]) / static_cast<double>(rest_count) : 0.0;
        mean[j] = static_cast<Acc>((numer[h * dv + j] + rest[h] * rest_mean) / total);
      }
      parts.merge(h, static_cast<Acc>(static_cast<double>(c[h]) + std::log(total)), Acc(1), mean.data());
    }
  }
};

}  // namespace floe::residual
