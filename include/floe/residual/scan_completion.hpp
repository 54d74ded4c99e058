// Residual `scan_completion`: completes topk_anchors from the score estimates its scorer
// already made for every middle token (quantized_scan: the 4-bit scan), reading no keys.
// Of the middle tokens the exact part left out, the `value_tier` x (exact count) with the
// largest estimated shared score have their values read and enter with their estimated
// weights exp(e_h,i); the rest enter as D^ = sum of exp(e_h,i) times their mean value,
// which an index of the middle's value sum gives exactly (sum minus the rows read), plus
// their weighted deviation along the middle's principal value directions (value_sketch).
// docs/methods/retrieval-completion.md, "scan_completion".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
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
#include "floe/index/value_sketch.hpp"
#include "floe/index/value_sum.hpp"
#include "floe/index/widen.hpp"
#include "floe/residual/anchored_region.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::residual {

namespace completion_detail {
using lanes = xsimd::batch<float>;
constexpr index_t L = lanes::size;

// Sum of a[i] * b[i] (b null: of a[i]) over count floats in vector lanes, totalled in double.
inline double dot(const float* a, const float* b, index_t count) {
  lanes acc(0.f);
  index_t i = 0;
  for (; i + L <= count; i += L)
    acc = b ? xsimd::fma(lanes::load_unaligned(a + i), lanes::load_unaligned(b + i), acc) : acc + lanes::load_unaligned(a + i);
  double total = xsimd::hadd(acc);
  for (; i < count; ++i) total += static_cast<double>(a[i]) * (b ? b[i] : 1.f);
  return total;
}

// y[i] += w * x[i] over count floats.
inline void axpy(float w, const float* x, float* __restrict y, index_t count) {
  const lanes wl(w);
  index_t i = 0;
  for (; i + L <= count; i += L)
    xsimd::fma(wl, lanes::load_unaligned(x + i), lanes::load_unaligned(y + i)).store_unaligned(y + i);
  for (; i < count; ++i) y[i] += w * x[i];
}
}  // namespace completion_detail

struct scan_completion {
  static constexpr std::string_view name = "scan_completion";
  // Value-only tokens per exact token: 2 reads as many bytes again as the exact part
  // when d = dv. At equal bytes a larger tier beats more exact tokens on the SmolLM2
  // dumps up to about 4 (docs/methods/retrieval-completion.md, "value tier").
  double value_tier = 2.0;
  // Directions of the value sketch (0: none; at most dv): the rest's values vary with
  // their weights along the middle's principal value directions instead of being one
  // mean. 8 costs 16 bytes per middle token and was the best at equal bytes on the
  // SmolLM2 dumps (docs/methods/retrieval-completion.md, "value sketch").
  index_t value_rank = 8;

  // The middle's value sum, and its value sketch when value_rank > 0.
  struct index {
    value_sum sums;
    value_sketch sketch;
    token_range region() const { return sums.region(); }
    std::uint64_t bytes() const { return sums.bytes() + sketch.bytes(); }
    template <KvView KV>
    void append(const KV& kv) {
      sums.append(kv);
      sketch.append(kv);
    }
  };

  template <KvView KV, class S>
  index build(const KV& kv, const S& selector, const typename S::index&) const {
    require(std::isfinite(value_tier) && value_tier >= 0.0, "value_tier", "must be finite and >= 0, got ", value_tier);
    const token_range region = anchored_region(selector, kv.n());
    const index_t window = anchored_window(selector);
    return {value_sum::build(kv, region, window), value_sketch::build(kv, region, window, value_rank)};
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
    // mass, far below an estimate's own error. With a value sketch, the same weights
    // also sum each direction's coordinates (per block of tokens, converted once).
    using completion_detail::lanes, completion_detail::L, completion_detail::dot;
    constexpr index_t flush = 64 * L;
    const index_t rank = idx.sketch.rank();
    constexpr index_t group = 8;  // directions per pass: independent accumulator chains
    const index_t padded_rank = (rank + group - 1) / group * group;
    std::vector<double> rest(g, 0.0), mass(g, 0.0), weighted(g * padded_rank, 0.0);  // [h][padded_rank]
    thread_local std::vector<float> coordinates, block_weight;  // [padded_rank][flush], [flush]
    coordinates.assign(padded_rank * flush, 0.f);               // padding rows stay zero
    block_weight.resize(flush);
    for (index_t i0 = 0; i0 < n; i0 += flush) {
      const index_t i1 = std::min(n, i0 + flush), len = i1 - i0;
      for (index_t k = 0; k < rank; ++k)
        floe::detail::widen(idx.sketch.coordinates(k) + i0, coordinates.data() + k * flush, len);
      for (index_t h = 0; h < g; ++h) {
        const float* eh = e + h * n;
        const lanes ch(c[h]);
        lanes acc(0.f);
        index_t i = i0;
        for (; i + L <= i1; i += L) {
          const lanes w = xsimd::exp(lanes::load_unaligned(eh + i) - ch);
          acc += w;
          if (rank) w.store_unaligned(block_weight.data() + (i - i0));
        }
        double sum = xsimd::hadd(acc);
        for (; i < i1; ++i) {
          const double w = std::exp(static_cast<double>(eh[i] - c[h]));
          sum += w;
          if (rank) block_weight[i - i0] = static_cast<float>(w);
        }
        rest[h] += sum;
        for (index_t k0 = 0; k0 < padded_rank; k0 += group) {
          const float* u = coordinates.data() + k0 * flush;
          lanes dot[group];
          for (auto& x : dot) x = lanes(0.f);
          index_t j = 0;
          for (; j + L <= len; j += L) {
            const lanes w = lanes::load_unaligned(block_weight.data() + j);
            for (index_t k = 0; k < group; ++k) dot[k] = xsimd::fma(w, lanes::load_unaligned(u + k * flush + j), dot[k]);
          }
          for (index_t k = 0; k < group; ++k) {
            double total = xsimd::hadd(dot[k]);
            for (index_t t = j; t < len; ++t) total += static_cast<double>(block_weight[t]) * u[k * flush + t];
            weighted[h * padded_rank + k0 + k] += total;
          }
        }
      }
    }
    // The taken rows' coordinates, gathered once ([rank][taken]).
    thread_local std::vector<half> taken_half;
    thread_local std::vector<float> taken_coordinates;
    taken_half.resize(taken.size());
    taken_coordinates.resize(rank * taken.size());
    for (index_t k = 0; k < rank; ++k) {
      const half* u = idx.sketch.coordinates(k);
      for (index_t j = 0; j < taken.size(); ++j) taken_half[j] = u[taken[j]];
      floe::detail::widen(taken_half.data(), taken_coordinates.data() + k * taken.size(), taken.size());
    }
    thread_local std::vector<float> weight;  // [h][taken]
    weight.resize(g * taken.size());
    for (index_t h = 0; h < g; ++h) {
      const float* eh = e + h * n;
      float* w = weight.data() + h * taken.size();
      for (index_t j = 0; j < taken.size(); ++j) w[j] = eh[taken[j]] - c[h];
      index_t j = 0;
      for (; j + L <= taken.size(); j += L) xsimd::exp(lanes::load_unaligned(w + j)).store_unaligned(w + j);
      for (; j < taken.size(); ++j) w[j] = std::exp(w[j]);
      mass[h] = dot(w + read_rows, nullptr, taken.size() - read_rows);  // the tier's
      rest[h] = std::max(0.0, rest[h] - dot(w, nullptr, taken.size()));
      for (index_t k = 0; k < rank; ++k)
        weighted[h * padded_rank + k] -= dot(w, taken_coordinates.data() + k * taken.size(), taken.size());
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
      completion_detail::axpy(1.f, v.data(), read_sum.data(), dv);
      if (r < read_rows) continue;
      for (index_t h = 0; h < g; ++h)
        completion_detail::axpy(weight[h * taken.size() + r], v.data(), numer.data() + h * dv, dv);
    }
    io.value_bytes += static_cast<std::uint64_t>(tier) * dv * sizeof(typename KV::element_type);
    io.summary_bytes += idx.bytes();

    const index_t rest_count = left - tier;
    // With a sketch: per head, the rest's weighted coordinates less its mass times the
    // rest's mean coordinates, mapped back through the basis (dv values per head).
    std::vector<double> correction(rank > 0 && rest_count > 0 ? g * dv : 0, 0.0);
    if (!correction.empty()) {
      std::vector<double> unweighted(idx.sketch.coordinate_sum());
      for (index_t k = 0; k < rank; ++k) unweighted[k] -= dot(taken_coordinates.data() + k * taken.size(), nullptr, taken.size());
      for (index_t h = 0; h < g; ++h)
        for (index_t k = 0; k < rank; ++k) {
          const double along = weighted[h * padded_rank + k] - rest[h] * unweighted[k] / static_cast<double>(rest_count);
          for (index_t j = 0; j < dv; ++j) correction[h * dv + j] += static_cast<double>(idx.sketch.basis()[j * rank + k]) * along;
        }
    }
    std::vector<Acc> mean(dv);
    const std::vector<double>& sum = idx.sums.sum();
    for (index_t h = 0; h < g; ++h) {
      const double total = mass[h] + (rest_count > 0 ? rest[h] : 0.0);
      if (!(total > 0.0)) continue;
      for (index_t j = 0; j < dv; ++j) {
        const double rest_mean = rest_count > 0 ? (sum[j] - read_sum[j]) / static_cast<double>(rest_count) : 0.0;
        const double varying = correction.empty() ? 0.0 : correction[h * dv + j];
        mean[j] = static_cast<Acc>((numer[h * dv + j] + rest[h] * rest_mean + varying) / total);
      }
      parts.merge(h, static_cast<Acc>(static_cast<double>(c[h]) + std::log(total)), Acc(1), mean.data());
    }
  }
};

}  // namespace floe::residual
