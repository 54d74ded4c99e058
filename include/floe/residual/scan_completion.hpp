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

#include <xsimd/xsimd.hpp>

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
  // Value-only tokens per exact token: 2 reads as many bytes again as the exact part
  // when d = dv. At equal bytes a larger tier beats more exact tokens on the SmolLM2
  // dumps up to about 4 (docs/methods/retrieval-completion.md, "value tier").
  double value_tier = 2.0;

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

    // skip[i]: 0 for a left-out token, -inf for one read, added to its estimates so the
    // passes below run branch-free in vector lanes.
    const float none = -std::numeric_limits<float>::infinity();
    thread_local std::vector<float> skip;
    skip.resize(n);
    for (index_t i = 0; i < n; ++i) skip[i] = role[i] == 0 ? 0.f : none;
    // Per-head reference c_h (largest left-out estimate) and the group's shared score.
    std::vector<float> c(g, none);
    for (index_t h = 0; h < g; ++h) {
      float top[16];  // independent lanes, so the loop vectorises
      std::fill(top, top + 16, none);
      index_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (index_t l = 0; l < 16; ++l) top[l] = std::max(top[l], e[h * n + i + l] + skip[i + l]);
      for (; i < n; ++i) top[0] = std::max(top[0], e[h * n + i] + skip[i]);
      c[h] = *std::max_element(top, top + 16);
    }
    thread_local std::vector<float> shared;
    shared.assign(n, none);
    for (index_t h = 0; h < g; ++h) {
      const float* __restrict eh = e + h * n;
      float* __restrict out = shared.data();
      const float* __restrict sk = skip.data();
      for (index_t i = 0; i < n; ++i) out[i] = std::max(out[i], eh[i] - c[h] + sk[i]);
    }
    const index_t left = n - read_in_middle;
    const index_t tier = std::min<index_t>(
        left, static_cast<index_t>(std::llround(value_tier * static_cast<double>(sel.count()))));
    if (tier > 0) {
      const float bar = select::ranking::kth_largest(shared.data(), n, tier);
      index_t taken = 0;
      for (index_t i = 0; i < n; ++i) {  // every one above the bar (fewer than `tier`), branch-free
        const bool above = shared[i] > bar;  // never for a read token: its shared score is -inf
        role[i] = above ? 2 : role[i];
        skip[i] = above ? none : skip[i];
        taken += above ? 1 : 0;
      }
      for (index_t i = 0; i < n && taken < tier; ++i)  // then ties, in order
        if (role[i] == 0 && shared[i] == bar) role[i] = 2, skip[i] = none, ++taken;
    }

    // Estimated mass of the tokens neither read nor in the tier, per head: vector lanes
    // over the middle, exp of estimates <= 0, float partial sums flushed to double.
    std::vector<double> rest(g, 0.0);
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size, flush = 64 * L;
    for (index_t h = 0; h < g; ++h) {
      const float* eh = e + h * n;
      const lanes ch(c[h]), zero(0.f);
      for (index_t i0 = 0; i0 < n; i0 += flush) {
        const index_t i1 = std::min(n, i0 + flush);
        lanes acc(0.f);
        index_t i = i0;
        for (; i + L <= i1; i += L)  // exp(-inf) = 0 for the skipped; min keeps the rest <= 1
          acc += xsimd::exp(xsimd::min(lanes::load_unaligned(eh + i) - ch + lanes::load_unaligned(skip.data() + i), zero));
        double sum = xsimd::hadd(acc);
        for (; i < i1; ++i)
          if (role[i] == 0) sum += std::exp(static_cast<double>(eh[i] - c[h]));
        rest[h] += sum;
      }
    }
    // The tier's rows enter with their estimated weights; they and the rows the exact
    // part read are taken off the middle's value sum.
    // Float sums (weights <= 1, a few thousand rows): an estimate's own error is larger.
    std::vector<double> mass(g, 0.0);
    std::vector<float> numer(g * dv, 0.f), read_sum(dv, 0.f), v(dv);
    thread_local std::vector<index_t> rows;
    rows.resize(n);
    index_t count = 0;
    for (index_t i = 0; i < n; ++i) {  // branch-free compaction
      rows[count] = i;
      count += role[i] != 0 ? 1 : 0;
    }
    constexpr index_t ahead = 16;  // rows in flight: the gather is latency-bound
    for (index_t r = 0; r < count; ++r) {
      if (r + ahead < count) floe::detail::prefetch_row(kv.value_row(mid.begin + rows[r + ahead]), dv);
      const index_t i = rows[r];
      floe::detail::widen(kv.value_row(mid.begin + i), v.data(), dv);
      for (index_t j = 0; j < dv; ++j) read_sum[j] += v[j];
      if (role[i] == 1) continue;
      for (index_t h = 0; h < g; ++h) {
        const float w = std::exp(e[h * n + i] - c[h]);
        mass[h] += w;
        float* out = numer.data() + h * dv;
        for (index_t j = 0; j < dv; ++j) out[j] += w * v[j];
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
