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
      s.shared;
      s.offsets;
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
    // c_h: head h's largest estimate over the whole middle, as the scorer ranks (taken from
    // the selection when the scorer kept it). The shared score ranks the tier; read tokens
    // get -inf.
    const bool given = sel.shared.size() == n && sel.offsets.size() == g;  // the scorer made them
    const std::vector<float> c = given ? sel.offsets : select::ranking::head_maxima(e, g, n, n);
    thread_local std::vector<float> shared;
    if (given) shared.assign(sel.shared.begin(), sel.shared.end());
    else {
      shared.resize(n);
      select::ranking::shared_scores(e, g, n, n, c, shared.data());
    }
    for (const token_range& r : sel.retrieved)
      std::fill(shared.begin() + (r.begin - mid.begin), shared.begin() + (r.end - mid.begin),
                -std::numeric_limits<float>::infinity());
    const index_t left = n - read_in_middle;
    const index_t tier = std::min<index_t>(
        left, static_cast<index_t>(std::llround(value_tier * static_cast<double>(sel.count()))));
    // The tier: the `tier` best left-out tokens by shared score, ascending, ties by position.
    const std::vector<index_t> tier_rows = tier > 0 ? select::ranking::top_k(shared.data(), n, tier) : std::vector<index_t>{};

    // Rows read by the exact part or the tier, relative to the middle: their estimated
    // weights come off the middle's total, their values off the middle's value sum.
    thread_local std::vector<index_t> taken;
    taken.clear();
    for (const token_range& r : sel.retrieved)
      for (index_t i = r.begin; i < r.end; ++i) taken.push_back(i - mid.begin);
    const index_t read_rows = taken.size();
    taken.insert(taken.end(), tier_rows.begin(), tier_rows.end());

    // Per head: the estimated mass of the whole middle (vector lanes, float partial sums of
    // at most 64 L terms <= 1 flushed to double), less that of the taken rows; the tier's
    // weights are kept for the value pass. The difference loses ~1e-7 of the middle's
    // mass, far below an estimate's own error.
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size, flush = 64 * L;
    std::vector<double> rest(g, 0.0), mass(g, 0.0);
    thread_local std::vector<float> weight;  // [h][taken]
    weight.resize(g * taken.size());
    for (index_t h = 0; h < g; ++h) {
      const float* eh = e + h * n;
      const lanes ch(c[h]);
      for (index_t i0 = 0; i0 < n; i0 += flush) {
        const index_t i1 = std::min(n, i0 + flush);
        lanes acc(0.f);
        index_t i = i0;
        for (; i + L <= i1; i += L) acc += xsimd::exp(lanes::load_unaligned(eh + i) - ch);
        double sum = xsimd::hadd(acc);
        for (; i < i1; ++i) sum += std::exp(static_cast<double>(eh[i] - c[h]));
        rest[h] += sum;
      }
      float* w = weight.data() + h * taken.size();
      for (index_t j = 0; j < taken.size(); ++j) w[j] = eh[taken[j]] - c[h];
      index_t j = 0;
      for (; j + L <= taken.size(); j += L) xsimd::exp(lanes::load_unaligned(w + j)).store_unaligned(w + j);
      for (; j < taken.size(); ++j) w[j] = std::exp(w[j]);
      double off = 0.0;
      for (j = 0; j < taken.size(); ++j) off += w[j];
      for (j = read_rows; j < taken.size(); ++j) mass[h] += w[j];
      rest[h] = std::max(0.0, rest[h] - off);
    }

    // Values: every taken row into the read sum; the tier's rows also into the numerators
    // with their weights. Exact rows were just read by the exact part (cache-warm); the
    // tier's are scattered, so rows are asked for ahead.
    // Float sums (weights <= 1, a few thousand rows): an estimate's own error is larger.
    std::vector<float> numer(g * dv, 0.f), read_sum(dv, 0.f), v(dv);
    constexpr index_t ahead = 16;  // rows in flight: the gather is latency-bound
    for (index_t r = 0; r < taken.size(); ++r) {
      if (r + ahead < taken.size()) floe::detail::prefetch_row(kv.value_row(mid.begin + taken[r + ahead]), dv);
      floe::detail::widen(kv.value_row(mid.begin + taken[r]), v.data(), dv);
      {
        index_t j = 0;
        for (; j + L <= dv; j += L)
          (lanes::load_unaligned(read_sum.data() + j) + lanes::load_unaligned(v.data() + j)).store_unaligned(read_sum.data() + j);
        for (; j < dv; ++j) read_sum[j] += v[j];
      }
      if (r < read_rows) continue;
      for (index_t h = 0; h < g; ++h) {
        const float w = weight[h * taken.size() + r];
        float* __restrict out = numer.data() + h * dv;
        const lanes wl(w);
        index_t j = 0;
        for (; j + L <= dv; j += L)
          xsimd::fma(wl, lanes::load_unaligned(v.data() + j), lanes::load_unaligned(out + j)).store_unaligned(out + j);
        for (; j < dv; ++j) out[j] += w * v[j];
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
