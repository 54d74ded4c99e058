// Residual `feature_map<Map>`: the completion half of retrieval-completion attention.
// At prefill, a feature-map summary (Phi, zeta) of the middle region between the
// selector's sink and tail window; per step, D^ = phi(q).zeta - sum_{exact i in region}
// phi(q).phi(k_i) and N^ likewise, clamped at D^ >= 0 and merged as the partial
// (log D^, 1, N^/D^). docs/methods/retrieval-completion.md.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <string_view>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/feature_map_summary.hpp"
#include "floe/residual/anchored_region.hpp"
#include "floe/residual/feature_maps/positive_random.hpp"

namespace floe::residual {

namespace detail {
// "feature_map:" followed by the map's name, as one compile-time string.
template <class Map>
struct feature_map_name {
  static constexpr std::string_view prefix = "feature_map:";
  static constexpr auto chars = [] {
    std::array<char, prefix.size() + Map::name.size()> a{};
    std::copy(prefix.begin(), prefix.end(), a.begin());
    std::copy(Map::name.begin(), Map::name.end(), a.begin() + prefix.size());
    return a;
  }();
  static constexpr std::string_view value{chars.data(), chars.size()};
};
}  // namespace detail

template <class Map = positive_random>
struct feature_map {
  static constexpr std::string_view name = detail::feature_map_name<Map>::value;
  Map map{};
  float scale = 0.f;  // score scale the map is drawn for (0: 1/sqrt(d)); other query scales are rescaled
  // Keep each middle token's features (bf16, M per token: 2M bytes more memory per token)
  // so that decode reads them instead of projecting the exact tokens' keys.
  bool cache_token_features = false;

  using index = feature_map_summary;

  template <KvView KV, class S>
  index build(const KV& kv, const S& selector, const typename S::index&) const {
    const token_range region = anchored_region(selector, kv.n());
    const double s = scale > 0.f ? scale : 1.0 / std::sqrt(static_cast<double>(kv.d()));
    require(std::isfinite(s) && s > 0.0, "scale", "must be finite and positive, got ", s);
    // The centre c: the region's key mean, accumulated in double.
    Eigen::VectorXd mean = Eigen::VectorXd::Zero(static_cast<Eigen::Index>(kv.d()));
    double raw_sq = 0.0;
    for (index_t i = region.begin; i < region.end; ++i)
      for (index_t t = 0; t < kv.d(); ++t) {
        const double x = to_float(kv.key_row(i)[t]);
        mean[static_cast<Eigen::Index>(t)] += x;
        raw_sq += x * x;
      }
    const double count = std::max<double>(1.0, static_cast<double>(region.size()));
    mean /= count;
    key_moments moments{kv.d(), s, 0.0, raw_sq / count};
    for (index_t i = region.begin; i < region.end; ++i)
      for (index_t t = 0; t < kv.d(); ++t) {
        const double x = to_float(kv.key_row(i)[t]) - mean[static_cast<Eigen::Index>(t)];
        moments.mean_sq_centred += x * x / count;
      }
    return feature_map_summary::build(kv, region, anchored_window(selector), map.draw(moments), mean.cast<float>(),
                                      cache_token_features);
  }

  template <KvView KV, class Selection, class Exec, class Acc>
  void estimate(const index& idx, const KV& kv, const query_group& q, const Selection& sel, const Exec&,
                partial_set<Acc>& parts, stats& io) const {
    merge(idx, kv.dv(), idx.estimate(kv, q, sel.ranges), sel, parts, io);
  }

  // The exact part and the estimate in one pass (floe::estimator calls this instead of
  // exec.attend and estimate): each chunk of exact tokens inside the region is attended
  // just before its own terms are subtracted, so that the subtraction finds their rows in
  // cache instead of reading them from memory a second time. Executors whose calls carry
  // a fixed cost (a launch, a synchronize) attend everything in one call instead.
  template <KvView KV, class Selection, class Exec, class Acc>
  void attend_and_estimate(const index& idx, const KV& kv, const query_group& q, const Selection& sel,
                           const Exec& exec, partial_set<Acc>& parts, stats& io) const {
    if constexpr (!requires { requires Exec::small_calls_cheap; }) {
      exec.attend(kv, q, sel.ranges, parts);
      estimate(idx, kv, q, sel, exec, parts, io);
    } else {
      floe::selection piece;
      index_t attended = 0;
      const std::vector<feature_mass> masses = idx.estimate(kv, q, sel.ranges, [&](std::span<const index_t> tokens) {
        piece.clear();
        add_sorted_indices(piece, tokens);
        exec.attend(kv, q, std::span<const token_range>(piece.ranges), parts);
        attended += tokens.size();
      });
      if (attended == 0) {  // no chunk ran: the exact set has nothing inside the region, or covers it
        exec.attend(kv, q, sel.ranges, parts);
      } else {  // what is left: the exact tokens outside the region (sinks, tail)
        const token_range region = idx.region();
        piece.clear();
        for (const token_range& r : sel.ranges) {
          piece.add(r.begin, std::min(r.end, region.begin));
          piece.add(std::max(r.begin, region.end), r.end);
        }
        exec.attend(kv, q, std::span<const token_range>(piece.ranges), parts);
      }
      merge(idx, kv.dv(), masses, sel, parts, io);
    }
  }

 private:
  template <class Selection, class Acc>
  static void merge(const index& idx, index_t dv, const std::vector<feature_mass>& masses, const Selection& sel,
                    partial_set<Acc>& parts, stats& io) {
    if (masses.empty()) return;  // the exact set covers the region: nothing read, nothing to add
    io.summary_bytes += idx.read_bytes(sel.ranges);
    std::vector<Acc> mean_value(dv);
    for (index_t h = 0; h < masses.size(); ++h) {
      const feature_mass& f = masses[h];
      if (!(f.mass > 0.0)) continue;  // clamped at zero: nothing to add
      for (index_t j = 0; j < dv; ++j) mean_value[j] = static_cast<Acc>(f.numerator[j] / f.mass);
      parts.merge(h, static_cast<Acc>(f.log_ref + std::log(f.mass)), Acc(1), mean_value.data());
    }
  }
};

}  // namespace floe::residual
