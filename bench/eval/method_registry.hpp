// The method configurations floe's programs can pick by name (floe-eval --methods,
// examples/smollm --attn). Adding a method is one method<E>(...) line below.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/core/budget.hpp"
#include "floe/estimator.hpp"
#include "floe/residual/cluster_map.hpp"
#include "floe/residual/feature_map.hpp"
#include "floe/residual/feature_maps/optimized_positive_random.hpp"
#include "floe/residual/scan_completion.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/horvitz_thompson.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/exp_threshold.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/select/oracle_topk.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/scorers/page_bounds.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "floe/select/streaming.hpp"

namespace floe::eval {

template <Executor E>
struct method_entry {
  std::string name;
  std::string description;
  bool uses_budget = true;  // false: evaluated once, at the full cache (dense)
  std::function<any_estimator<E>(budget)> make;
};

// make(budget b, index_t n) -> floe::estimator<S, R> for a KV head of n tokens.
template <Executor E, class Make>
method_entry<E> method(std::string name, std::string description, Make make, bool uses_budget = true) {
  auto erase = [name, make](budget b) {
    return any_estimator<E>::from(name, [make, b](index_t n) { return make(b, n); });
  };
  return {std::move(name), std::move(description), uses_budget, std::move(erase)};
}

// A topk_anchors<quantized_scan> selector with 4-bit blocks of `block_dims` elements.
template <class Selector>
Selector quantized_blocks_of(Selector s, index_t block_dims) {
  s.scorer.block_dims = block_dims;
  return s;
}

template <Executor E>
std::vector<method_entry<E>> registered_methods() {
  using floe::estimator;
  namespace sel = floe::select;
  namespace res = floe::residual;
  return {
      method<E>("dense", "every token exact; the accuracy and speed baseline (budget ignored)",
                [](budget, index_t) { return estimator<sel::dense, res::none>{}; }, false),
      method<E>("streaming", "4 sink tokens + the most recent tokens, budget tokens in all; selection only",
                [](budget b, index_t n) { return estimator<sel::streaming, res::none>{sel::streaming::with_budget(b.resolve(n)), {}}; }),
      method<E>("oracle_topk", "exact top-K by true attention weight (GQA group sum); selection only; scans every key",
                [](budget b, index_t n) { return estimator<sel::oracle_topk, res::none>{{b.resolve(n)}, {}}; }),
      method<E>("mog", "MoG: ~sqrt(N) key clusters, ~ln N subclusters; best subclusters exact, the rest from Gaussian moments", [](budget b, index_t n) { return estimator<sel::mog_clusters, res::gaussian_moments>{sel::mog_clusters::with_budget(b, n), {}}; }),
      method<E>("mog:lean_outliers", "mog with exact outliers for at most 10 % of the budget instead of half: lower p90 on the SmolLM2 dumps, higher perplexity at 8K (docs/log/mog.md, \"Outlier share\")", [](budget b, index_t n) { return estimator<sel::mog_clusters, res::gaussian_moments>{sel::mog_clusters::with_budget(b, n, sel::mog_clusters::lean_outlier_share), {}}; }),
      method<E>("mog:per_token", "mog ranking clusters and subclusters by estimated mass per token instead of mass: lower p90 on the synthetic cache and most SmolLM2 dumps, higher perplexity at 8K (docs/log/mog.md, \"Ranking by mass per token\")", [](budget b, index_t n) { auto s = sel::mog_clusters::with_budget(b, n); s.rank_per_token = true; return estimator<sel::mog_clusters, res::gaussian_moments>{s, {}}; }),
      method<E>("mog:token_scan", "mog with 4-bit keys of the clustered tokens in the index (mog_config::token_scan): members of refined clusters (8x the budget) ranked one by one, their unread mass from the 4-bit estimates; index memory 5d/8 bytes per token more (40 at d = 64)", [](budget b, index_t n) { return estimator<sel::mog_clusters, res::gaussian_moments>{sel::mog_clusters::with_budget(b, n).with_token_scan(), {}}; }),
      method<E>("mog:token_scan2", "mog:token_scan ranking by 2-bit codes of each key standardised by its cluster's mean and spread (mog_config::scan_code::residual_2bit; refine 16): index memory d/4 bytes per token and 2d floats per cluster", [](budget b, index_t n) { return estimator<sel::mog_clusters, res::gaussian_moments>{sel::mog_clusters::with_budget(b, n).with_token_scan(mog_config::scan_code::residual_2bit), {}}; }),
      method<E>("mog_clusters+none", "MoG's selection with the residual dropped (ablation of mog)", [](budget b, index_t n) { return estimator<sel::mog_clusters, res::none>{sel::mog_clusters::with_budget(b, n), {}}; }),
      // Retrieval-completion (docs/methods/retrieval-completion.md): 4 sinks, a window of min(64, k/4), Top-K of the middle.
      method<E>("topk_anchors:exact_scan+none", "sink + tail + exact Top-K of the middle (scans every key); selection only",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::exact_scan>, res::none>{sel::topk_anchors<sel::exact_scan>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:exact_scan+feature_map", "as topk_anchors:exact_scan+none, plus the middle's left-out mass from positive random features (M = 64)",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::exact_scan>, res::feature_map<>>{sel::topk_anchors<sel::exact_scan>::with_budget(b.resolve(n)), {{64}}}; }),
      method<E>("topk_anchors:quantized_scan+none", "sink + tail + Top-K by a 4-bit key scan with bounds, exact re-rank of the 1.25 K best estimates; selection only",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::none>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:quantized_scan+feature_map", "as topk_anchors:quantized_scan+none, plus positive random features (M = 64) for the left-out middle",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::feature_map<>>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {{64}}}; }),
      method<E>("topk_anchors:quantized_scan+feature_map:cached", "as topk_anchors:quantized_scan+feature_map with each middle token's features cached (bf16, 128 bytes per token): decode projects no keys",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::feature_map<>>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {{64}, 0.f, true}}; }),
      method<E>("topk_anchors:quantized_scan+feature_map:optimized", "as topk_anchors:quantized_scan+feature_map with the variance-optimised positive features (M = 64)",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::feature_map<res::optimized_positive_random>>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {{64}}}; }),
      method<E>("topk_anchors:exact_scan+feature_map:clusters", "as topk_anchors:exact_scan+none, plus the left-out middle from 64 key clusters, each a Gaussian truncated at the selection threshold",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::exact_scan>, res::cluster_map>{sel::topk_anchors<sel::exact_scan>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:quantized_scan+feature_map:clusters", "as topk_anchors:quantized_scan+none, plus the left-out middle from 64 key clusters, each a Gaussian truncated at the selection threshold",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::cluster_map>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:quantized_scan+scan_completion", "as topk_anchors:quantized_scan+none, plus the left-out middle from the scan's estimates: values of the next 2K tokens read (no keys), the rest as estimated mass x their mean value, varied along 8 principal value directions (16-byte sketch per token)",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::scan_completion>{sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:quantized_scan:b64+none", "as topk_anchors:quantized_scan+none with 4-bit blocks of 64 elements (72 bytes per token at d = 128 instead of 80)",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::none>{quantized_blocks_of(sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), 64), {}}; }),
      method<E>("topk_anchors:quantized_scan:b64+feature_map:cached", "as topk_anchors:quantized_scan+feature_map:cached with 4-bit blocks of 64 elements",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::quantized_scan>, res::feature_map<>>{quantized_blocks_of(sel::topk_anchors<sel::quantized_scan>::with_budget(b.resolve(n)), 64), {{64}, 0.f, true}}; }),
      method<E>("topk_anchors:page_bounds+none", "sink + tail + the pages (16 tokens) of largest Quest bound in the middle; selection only",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::page_bounds>, res::none>{sel::topk_anchors<sel::page_bounds>::with_budget(b.resolve(n)), {}}; }),
      method<E>("topk_anchors:page_bounds+feature_map", "as topk_anchors:page_bounds+none, plus positive random features (M = 64) for the left-out middle",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::page_bounds>, res::feature_map<>>{sel::topk_anchors<sel::page_bounds>::with_budget(b.resolve(n)), {{64}}}; }),
      method<E>("topk_anchors:page_bounds+feature_map:clusters", "as topk_anchors:page_bounds+none, plus the left-out middle from 64 key clusters, each a Gaussian truncated at the selection threshold",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::page_bounds>, res::cluster_map>{sel::topk_anchors<sel::page_bounds>::with_budget(b.resolve(n)), {}}; }),
      method<E>("exp_threshold+horvitz_thompson", "Elastic Threshold: keys sampled with probability 1 - exp(-w/tau) (Exp(1)-perturbed threshold over a 4-bit scan), the deepest threshold level within the budget, Horvitz-Thompson estimate; reports a certificate",
                [](budget b, index_t n) { return estimator<sel::exp_threshold, res::horvitz_thompson>{sel::exp_threshold::with_budget(b.resolve(n)), {}}; }),
      method<E>("exp_threshold:estimate+horvitz_thompson", "as exp_threshold+horvitz_thompson, sampled with the 4-bit estimates' weights: reads only the sample's keys (no candidate keys)",
                [](budget b, index_t n) { auto s = sel::exp_threshold::with_budget(b.resolve(n)); s.exact_weights = false; return estimator<sel::exp_threshold, res::horvitz_thompson>{s, {}}; }),
      method<E>("exp_threshold+none", "exp_threshold's sample renormalised without the Horvitz-Thompson weights (ablation)",
                [](budget b, index_t n) { return estimator<sel::exp_threshold, res::none>{sel::exp_threshold::with_budget(b.resolve(n)), {}}; }),
      method<E>("exp_threshold:certified+horvitz_thompson", "exp_threshold stopping at the first level certified to 10 % relative error (delta 0.05), the budget as a cap; reads every token when no level within the cap is certified",
                [](budget b, index_t n) {  // a budget of the whole cache reads it all, as for every method
                  const index_t k = b.resolve(n);
                  return estimator<sel::exp_threshold, res::horvitz_thompson>{k >= n ? sel::exp_threshold::with_budget(n) : sel::exp_threshold::certified(0.1, k), {}}; }),
      method<E>("page_bounds", "Quest: pages of 16 tokens with the largest min/max score bound, no anchors; selection only",
                [](budget b, index_t n) { return estimator<sel::topk_anchors<sel::page_bounds>, res::none>{{0, 0, budget::tokens(b.resolve(n)), {16}}, {}}; }),
  };
}

// The entry called `name`; an unknown name is an error listing the known ones.
template <Executor E>
const method_entry<E>& find_method(const std::vector<method_entry<E>>& methods, const std::string& name,
                                   const char* argument = "method") {
  std::string known;
  for (const auto& m : methods) {
    if (m.name == name) return m;
    known += known.empty() ? m.name : ", " + m.name;
  }
  throw invalid_argument(argument, floe::detail::concat("unknown method '", name, "'; registered: ", known));
}

// The entry would dangle with the temporary registry.
template <Executor E>
const method_entry<E>& find_method(std::vector<method_entry<E>>&&, const std::string&, const char* = "method") = delete;

}  // namespace floe::eval
