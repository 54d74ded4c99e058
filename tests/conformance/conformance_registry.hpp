// What the conformance suite runs: every estimator configuration at a full budget and
// every executor. Adding a policy or executor to floe means adding one line here.
#pragma once

#include <algorithm>
#include <memory>
#include <tuple>

#include "floe/floe.hpp"

namespace floe::conformance {

// topk_anchors reading everything: one sink, a one-token window, the whole middle.
inline select::topk_anchors<select::quantized_scan> anchored_full(index_t n) {
  if (n < 3) return {0, 0, budget::tokens(n), {}};
  return {1, 1, budget::tokens(n - 2), {}};
}

// anchor_reuse as the one anchor layer of a one-layer plan (a reuse layer needs its anchor
// to run first in the same step: tests/anchor covers it).
inline select::anchor_reuse single_anchor(index_t k) {
  return {k, std::make_shared<select::anchor_store>(select::anchor_plan::from_anchors(1, 1, {0}))};
}

// Factories: n -> an estimator whose budget covers all n tokens.
inline auto full_budget_estimators() {
  return std::tuple{
      [](index_t) { return estimator<select::dense, residual::none>{}; },
      [](index_t n) { return estimator<select::streaming, residual::none>({4, n}, {}); },
      [](index_t n) { return estimator<select::streaming, residual::none>({n, 0}, {}); },
      [](index_t n) { return estimator<select::oracle_topk, residual::none>({n}, {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(1.0), n), {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(1.0), n).with_token_scan(), {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(1.0), n).with_token_scan(mog_config::scan_code::residual_2bit), {}); },
      [](index_t n) { return estimator<select::topk_anchors<select::quantized_scan>, residual::feature_map<>>(anchored_full(n), {}); },
      [](index_t n) { return estimator<select::topk_anchors<select::quantized_scan>, residual::feature_map<>>(anchored_full(n), {{}, 0.f, true}); },
      [](index_t n) { return estimator<select::topk_anchors<select::quantized_scan>, residual::scan_completion>(anchored_full(n), {}); },
      [](index_t n) { return estimator<select::topk_anchors<select::quantized_scan>, residual::cluster_map>(anchored_full(n), {}); },
      [](index_t n) { return estimator<select::exp_threshold, residual::horvitz_thompson>(select::exp_threshold::with_budget(n), {}); },
      [](index_t n) { return estimator<select::anchor_reuse, residual::none>(single_anchor(n), {}); },
  };
}

// Factories: n -> the same kinds of composition reading about a tenth of n exactly, so
// that the selection and the residual matter when executors are compared.
inline auto partial_budget_estimators() {
  const auto k = [](index_t n) { return std::max<index_t>(1, n / 10); };
  using by_4bit = select::topk_anchors<select::quantized_scan>;
  using by_scan = select::topk_anchors<select::exact_scan>;
  using by_page = select::topk_anchors<select::page_bounds>;
  return std::tuple{
      [=](index_t n) { return estimator<select::streaming, residual::none>(select::streaming::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<select::oracle_topk, residual::none>({k(n)}, {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(0.1), n), {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::none>(select::mog_clusters::with_budget(budget::fraction(0.1), n), {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(0.1), n).with_token_scan(), {}); },
      [](index_t n) { return estimator<select::mog_clusters, residual::gaussian_moments>(select::mog_clusters::with_budget(budget::fraction(0.1), n).with_token_scan(mog_config::scan_code::residual_2bit), {}); },
      [=](index_t n) { return estimator<by_scan, residual::feature_map<>>(by_scan::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<by_4bit, residual::feature_map<>>(by_4bit::with_budget(k(n)), {{}, 0.f, true}); },
      [=](index_t n) { return estimator<by_4bit, residual::scan_completion>(by_4bit::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<by_4bit, residual::cluster_map>(by_4bit::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<by_page, residual::feature_map<>>(by_page::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<select::exp_threshold, residual::horvitz_thompson>(select::exp_threshold::with_budget(k(n)), {}); },
      [=](index_t n) { return estimator<select::anchor_reuse, residual::none>(single_anchor(k(n)), {}); },
  };
}

inline auto executors() { return std::tuple{exec::scalar{}, exec::simd{}}; }

}  // namespace floe::conformance
