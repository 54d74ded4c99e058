// residual::scan_completion: equals dense when the estimates are exact and cover what was
// left out, matches its formula, reads the bytes it reports, beats selection only at
// equal bytes on flat attention, appends as it rebuilds, and refuses bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "floe/residual/scan_completion.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/scorers/page_bounds.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "support/random_kv.hpp"
#include "topk/topk_support.hpp"

namespace {
using floe::index_t;
using floe::residual::scan_completion;
using floe::select::exact_scan;
using floe::select::page_bounds;
using floe::select::quantized_scan;
using floe::select::topk_anchors;

static_assert(floe::ResidualFor<scan_completion, topk_anchors<quantized_scan>>);
static_assert(floe::ResidualFor<scan_completion, topk_anchors<exact_scan>>);

template <class Scorer>
using completed = floe::estimator<topk_anchors<Scorer>, scan_completion>;

// What a value sketch of `rank` directions over m tokens reads per step: fp16 coordinates
// per token, the basis and centre in float, the coordinate sums in double.
std::uint64_t sketch_bytes(index_t rank, index_t m, index_t dv) {
  return rank == 0 ? 0 : m * rank * 2 + (dv * rank + dv) * sizeof(float) + rank * sizeof(double);
}

TEST_CASE("scan_completion with exact estimates and a tier over everything left out equals dense", "[topk][scan_completion]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(21);
  floe::testing::random_kv<floe::half> data(g, 900, 64, 48, 0, 0, 1.5f);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, 3 * 64, 1.5f);
  const auto q = floe::query_group::make(qd.data(), 3, 64);
  const auto want = floe::testing::dense_reference(kv, q);
  for (double budget : {0.05, 0.3}) {
    completed<exact_scan> est({4, 32, floe::budget::fraction(budget), {}}, {1000.0});
    floe::stats s;
    const auto got = floe::testing::decode_output(est, est.build(kv), kv, q, s);
    INFO("budget " << budget);
    REQUIRE(floe::testing::worst_head_error(got, want, 3, 48) <= 1e-6);  // float scores as estimates
  }
  // No tier: the rest as one mean value is far off on random values; a sketch of every
  // value direction (rank = dv) leaves only its int8 rounding.
  {
    completed<exact_scan> mean_only({4, 32, floe::budget::fraction(0.05), {}}, {0.0, 0});
    completed<exact_scan> sketched({4, 32, floe::budget::fraction(0.05), {}}, {0.0, 48});
    floe::stats s1, s2;
    const double err_mean = floe::testing::worst_head_error(floe::testing::decode_output(mean_only, mean_only.build(kv), kv, q, s1), want, 3, 48);
    const double err_sketch = floe::testing::worst_head_error(floe::testing::decode_output(sketched, sketched.build(kv), kv, q, s2), want, 3, 48);
    INFO("worst-head error: one mean " << err_mean << ", full-rank sketch " << err_sketch);
    REQUIRE(err_sketch <= 1e-2);
    REQUIRE(err_sketch < 0.1 * err_mean);
  }
  // Full budget: nothing left out, nothing added, dense.
  completed<quantized_scan> full({4, 32, floe::budget::fraction(1.0), {}}, {});
  floe::stats s;
  REQUIRE(floe::testing::worst_head_error(floe::testing::decode_output(full, full.build(kv), kv, q, s), want, 3, 48) <= 1e-12);
}

TEST_CASE("scan_completion matches its formula and counts the tier's value bytes", "[topk][scan_completion]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(22);
  const index_t n = 2000, d = 64, dv = 32, heads = 2;
  floe::testing::random_kv<floe::half> data(g, n, d, dv, 0, 0, 2.f);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  const topk_anchors<quantized_scan> sel{4, 32, floe::budget::tokens(60), {}};
  for (const index_t rank : {index_t{0}, index_t{4}}) {
  INFO("value_rank " << rank);
  const scan_completion res{0.5, rank};  // tier 0.5, not the default: exercises the tier cut
  completed<quantized_scan> est(sel, res);
  floe::stats with, without;
  const auto state = est.build(kv);
  const auto got = floe::testing::decode_output(est, state, kv, q, with);
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::none> plain(sel, {});
  (void)floe::testing::decode_output(plain, plain.build(kv), kv, q, without);

  // The formula, in double: exact part with exact scores; the tier (the best left-out by
  // shared estimate, relative to each head's largest estimate over the whole middle, as
  // the scorer ranks) with estimated weights; the rest as their estimated mass times
  // their mean value.
  topk_anchors<quantized_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  const floe::token_range mid = chosen.middle;
  std::vector<int> role(n, 0);  // 1 exact, 2 tier
  for (const auto& r : chosen.ranges)
    for (index_t i = r.begin; i < r.end; ++i) role[i] = 1;
  const index_t m = mid.size(), tier = static_cast<index_t>(std::llround(0.5 * chosen.count()));
  std::vector<double> c(heads, -1e300), shared(m, -1e300);
  for (index_t h = 0; h < heads; ++h)
    for (index_t i = 0; i < m; ++i)
      c[h] = std::max<double>(c[h], chosen.estimates[h * m + i]);
  std::vector<index_t> order;
  for (index_t i = 0; i < m; ++i)
    if (!role[mid.begin + i]) {
      for (index_t h = 0; h < heads; ++h) shared[i] = std::max<double>(shared[i], chosen.estimates[h * m + i] - c[h]);
      order.push_back(i);
    }
  std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return shared[a] > shared[b]; });
  for (index_t j = 0; j < tier; ++j) role[mid.begin + order[j]] = 2;
  std::vector<double> rest_mean(dv, 0.0);
  index_t rest_count = 0;
  for (index_t i = mid.begin; i < mid.end; ++i)
    if (!role[i]) {
      ++rest_count;
      for (index_t j = 0; j < dv; ++j) rest_mean[j] += kv.value_row(i)[j].to_float();
    }
  for (auto& x : rest_mean) x /= rest_count;
  std::vector<float> z(n);
  for (index_t h = 0; h < heads; ++h) {
    floe::exec::scalar{}.score(kv, q, h, {0, n}, z.data());
    double den = 0;
    std::vector<double> num(dv, 0.0);
    for (index_t i = 0; i < n; ++i) {
      const double w = role[i] == 1 ? std::exp(double(z[i]))
                                    : std::exp(double(chosen.estimates[h * m + i - mid.begin]));
      den += w;
      for (index_t j = 0; j < dv; ++j) num[j] += w * (role[i] ? kv.value_row(i)[j].to_float() : rest_mean[j]);
    }
    // With a sketch, the rest's values also vary with their weights along its directions:
    // U (sum of w_i u_i - (sum of w_i) * mean u) over the rest, u_i its decoded coordinates.
    const auto& sketch = state.residual_index.sketch;
    REQUIRE(sketch.rank() == rank);
    if (rank > 0) {
      std::vector<double> weighted(rank, 0.0), plain_sum(rank, 0.0);
      double weight = 0;
      index_t count = 0;
      for (index_t i = mid.begin; i < mid.end; ++i)
        if (!role[i]) {
          const double w = std::exp(double(chosen.estimates[h * m + i - mid.begin]));
          weight += w;
          ++count;
          for (index_t k = 0; k < rank; ++k) {
            const double u = sketch.coordinate(k, i - mid.begin);
            weighted[k] += w * u;
            plain_sum[k] += u;
          }
        }
      for (index_t j = 0; j < dv; ++j)
        for (index_t k = 0; k < rank; ++k)
          num[j] += double(sketch.basis()[j * rank + k]) * (weighted[k] - weight * plain_sum[k] / count);
    }
    for (index_t j = 0; j < dv; ++j) num[j] /= den;
    INFO("head " << h);
    REQUIRE(floe::testing::relative_l2(got.data() + h * dv, num.data(), dv) <= 1e-5);
  }
  REQUIRE(with.value_bytes - without.value_bytes == tier * dv * sizeof(floe::half));
  REQUIRE(with.key_bytes == without.key_bytes);
  REQUIRE(with.summary_bytes - without.summary_bytes == dv * sizeof(double) + sketch_bytes(rank, m, dv));
  }
}

TEST_CASE("scan_completion beats selection only at equal bytes on flat attention", "[topk][scan_completion]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(23);
  const index_t n = 4000, d = 64, dv = 64;
  floe::testing::random_kv<float> data(g, n, d, dv, 0, 0, 0.7f);
  for (auto& x : data.values) x += 0.5f;  // a shared value direction, as real heads have
  const auto kv = data.view();
  // tier 1 reads half the exact bytes again: compare with selection only at 1.5x.
  completed<quantized_scan> est(topk_anchors<quantized_scan>::with_budget(200), {1.0});
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::none> plain(topk_anchors<quantized_scan>::with_budget(300), {});
  const auto st = est.build(kv);
  const auto sp = plain.build(kv);
  double err_completed = 0, err_plain = 0, bytes_completed = 0, bytes_plain = 0;
  for (int step = 0; step < 8; ++step) {
    const auto qd = floe::testing::random_floats(g, 4 * d, 1.f);
    const auto q = floe::query_group::make(qd.data(), 4, d);
    const auto want = floe::testing::dense_reference(kv, q);
    floe::stats a, b;
    err_completed += floe::testing::worst_head_error(floe::testing::decode_output(est, st, kv, q, a), want, 4, dv);
    err_plain += floe::testing::worst_head_error(floe::testing::decode_output(plain, sp, kv, q, b), want, 4, dv);
    bytes_completed += a.key_bytes + a.value_bytes;
    bytes_plain += b.key_bytes + b.value_bytes;
  }
  INFO("mean worst-head error: completed " << err_completed / 8 << ", selection only " << err_plain / 8
                                           << "; KV bytes " << bytes_completed << " vs " << bytes_plain);
  REQUIRE(bytes_completed <= 1.02 * bytes_plain);
  REQUIRE(err_completed < 0.5 * err_plain);
}

TEST_CASE("scan_completion appends as it rebuilds and refuses bad input", "[topk][scan_completion][bad_input]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(24);
  const index_t n = 700, d = 32, dv = 16;
  floe::testing::random_kv<floe::bfloat16> data(g, n, d, dv);
  const floe::kv_view<floe::bfloat16> early(data.keys.data(), data.values.data(), 500, d, dv);
  const auto kv = data.view();
  completed<quantized_scan> est({4, 32, floe::budget::fraction(0.1), {}}, {});
  auto grown = est.build(early);
  for (index_t m = 501; m <= n; m += 13)
    est.append(grown, floe::kv_view<floe::bfloat16>(data.keys.data(), data.values.data(), m, d, dv));
  est.append(grown, kv);
  const auto whole = est.build(kv);
  REQUIRE(grown.residual_index.region() == whole.residual_index.region());
  REQUIRE(grown.residual_index.sums.sum() == whole.residual_index.sums.sum());
  // The sketch keeps the basis and centre of its build: appended tokens are projected on
  // them (a rebuild would find new directions).
  const auto& sketch = grown.residual_index.sketch;
  REQUIRE(sketch.region() == whole.residual_index.sketch.region());
  REQUIRE(sketch.rank() == 8);
  for (index_t i = sketch.region().begin; i < sketch.region().end; i += 17)
    for (index_t k = 0; k < sketch.rank(); ++k) {
      double u = 0;
      for (index_t j = 0; j < dv; ++j)
        u += (double(kv.value_row(i)[j].to_float()) - sketch.centre()[j]) * sketch.basis()[j * sketch.rank() + k];
      REQUIRE(std::fabs(sketch.coordinate(k, i - sketch.region().begin) - u) <= 2e-3 * (std::fabs(u) + 1.0));
    }

  const auto qd = floe::testing::random_floats(g, d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const auto arg_of = [](auto&& f) { return floe::testing::argument_of(f); };
  std::vector<double> out(dv, -7.0);
  floe::stats s;
  const auto stale = est.build(early);  // a state not appended to: its middle ends at 468
  REQUIRE(arg_of([&] { est.decode(stale, kv, q, floe::exec::scalar{}, floe::output_group<double>{out.data(), 1, dv, 0}, s); }) == "index");
  completed<quantized_scan> negative({4, 32, floe::budget::fraction(0.1), {}}, {-1.0});
  REQUIRE(arg_of([&] { (void)negative.build(kv); }) == "value_tier");
  REQUIRE(out == std::vector<double>(dv, -7.0));  // the caller's output untouched
  // A cache cut back below what the value sum and sketch hold (their region ends at 668).
  const floe::kv_view<floe::bfloat16> cut(data.keys.data(), data.values.data(), 600, d, dv);
  auto sums = whole.residual_index.sums;
  auto sketch_copy = whole.residual_index.sketch;
  REQUIRE(arg_of([&] { sums.append(cut); }) == "kv");
  REQUIRE(arg_of([&] { sketch_copy.append(cut); }) == "kv");
  REQUIRE(sums.sum() == whole.residual_index.sums.sum());  // nothing changed by the refusal
  // page_bounds makes no per-token estimates.
  floe::estimator<topk_anchors<page_bounds>, scan_completion> pages({4, 32, floe::budget::fraction(0.1), {16}}, {});
  REQUIRE(arg_of([&] { pages.decode(pages.build(kv), kv, q, floe::exec::scalar{}, floe::output_group<double>{out.data(), 1, dv, 0}, s); }) == "selection");
  REQUIRE(out == std::vector<double>(dv, -7.0));
}

}  // namespace
