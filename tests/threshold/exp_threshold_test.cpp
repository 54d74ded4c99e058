// exp_threshold + horvitz_thompson: full budget equals dense; the sample is exactly the
// threshold sample of the exact weights (the 4-bit bounds miss no member); the
// Horvitz-Thompson mass is unbiased over seeds; certificates hold at their stated rate;
// the cap holds; append equals a rebuild; bad input is refused by name.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/horvitz_thompson.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/exp_threshold.hpp"
#include "support/random_kv.hpp"
#include "support/reference.hpp"
#include "topk/topk_support.hpp"

namespace {
using floe::index_t;
using floe::residual::horvitz_thompson;
using floe::select::exp_threshold;
using floe::testing::dense_reference;
using floe::testing::worst_head_error;
using threshold_ht = floe::estimator<exp_threshold, horvitz_thompson>;

static_assert(floe::Selector<exp_threshold>);
static_assert(floe::ResidualFor<horvitz_thompson, exp_threshold>);
static_assert(floe::ResidualFor<floe::residual::none, exp_threshold>);

// Exact scores s q_h . k_i in double, [heads][n].
template <floe::KvView KV>
std::vector<double> exact_scores(const KV& kv, const floe::query_group& q) {
  std::vector<double> z(q.heads * kv.n());
  for (index_t h = 0; h < q.heads; ++h)
    for (index_t i = 0; i < kv.n(); ++i) {
      double s = 0;
      for (index_t t = 0; t < kv.d(); ++t) s += double(q.row(h)[t]) * double(floe::to_float(kv.key_row(i)[t]));
      z[h * kv.n() + i] = s * q.scale;
    }
  return z;
}

template <class T>
void full_budget_equals_dense(std::uint64_t salt) {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(salt);
  for (auto [n, block, heads] : {std::tuple<index_t, index_t, index_t>{1, 0, 1}, {63, 0, 4}, {700, 16, 4}, {1000, 0, 8}}) {
    floe::testing::random_kv<T> data(g, n, 40, 24, 3, block);
    auto run = [&](const auto& kv) {
      const auto qd = floe::testing::random_floats(g, heads * kv.d(), 1.5f);
      const auto q = floe::query_group::make(qd.data(), heads, kv.d());
      auto by_estimate = exp_threshold::certified(1e-12);
      by_estimate.exact_weights = false;
      for (const threshold_ht& est : {threshold_ht{exp_threshold::with_budget(n), {}},
                                      threshold_ht{exp_threshold::certified(1e-12), {}}, threshold_ht{by_estimate, {}}}) {
        INFO("n " << n << " block " << block << " heads " << heads << " epsilon " << est.selector().epsilon);
        floe::stats s;
        const auto got = floe::testing::decode_output(est, est.build(kv), kv, q, s);
        REQUIRE(worst_head_error(got, dense_reference(kv, q), heads, kv.dv()) <= 1e-12);
        REQUIRE(s.tokens_read == n);
        REQUIRE(s.value_bytes == n * kv.dv() * sizeof(T));
        REQUIRE(s.certificate == 0.0);
      }
    };
    if (data.paged()) run(data.paged_view());
    else run(data.view());
  }
}

// One selection with its scores, for checks that look inside the sample.
struct drawn {
  floe::select::threshold_sample sel;
  floe::stats io;
};
template <floe::KvView KV>
drawn draw(const exp_threshold& sel, const exp_threshold::index& idx, const KV& kv, const floe::query_group& q) {
  drawn d;
  sel.select(idx, kv, q, floe::exec::scalar{}, d.sel, d.io);
  floe::validate_ranges(d.sel.ranges, kv.n());
  return d;
}

bool in_ranges(const std::vector<floe::token_range>& ranges, index_t i) {
  return std::any_of(ranges.begin(), ranges.end(), [&](const auto& r) { return i >= r.begin && i < r.end; });
}
}  // namespace

TEST_CASE("exp_threshold with a full budget equals dense attention", "[threshold]") {
  full_budget_equals_dense<float>(1);
  full_budget_equals_dense<floe::half>(2);
  full_budget_equals_dense<floe::bfloat16>(3);
}

TEST_CASE("exp_threshold samples exactly the tokens whose perturbed exact weight reaches the threshold", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(11);
  const index_t n = 3000, d = 48, heads = 4;
  floe::testing::random_kv<floe::half> data(g, n, d, 16);
  const auto kv = data.view();
  // The grid starts log2(n) ~ 11.6 levels above the heaviest token.
  for (auto [levels, exact] : {std::pair<index_t, bool>{12, true}, {16, true}, {20, true}, {16, false}, {20, false}}) {
    exp_threshold sel = exp_threshold::with_budget(n - 1);
    sel.levels = levels;
    sel.exact_weights = exact;
    const auto idx = sel.build(kv);
    for (int trial = 0; trial < 6; ++trial) {
      const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
      const auto q = floe::query_group::make(qd.data(), heads, d);
      const auto z = exact_scores(kv, q);
      const auto r = draw(sel, idx, kv, q);
      INFO("levels " << levels << " exact weights " << exact << " trial " << trial << " sample " << r.sel.count());
      // Sampled with the exact weights, or with those of the 4-bit estimates (as the selector
      // computes them, in float).
      std::vector<float> center(heads * n), radius(heads * n);
      idx.keys.scan(idx.keys.prepare(q), 0, n, center.data(), radius.data(), n);
      REQUIRE(r.sel.level < levels);  // the deepest level, or the last within the cap
      REQUIRE(r.sel.count() < n);
      const std::uint64_t stream = sel.perturbation_stream(q);
      const double t = r.sel.log_threshold, log_certain = std::log(sel.certain);
      index_t checked = 0, sampled = 0;
      for (index_t i = 0; i < n; ++i) {
        double u = -std::numeric_limits<double>::infinity();
        float estimate = -std::numeric_limits<float>::infinity();
        for (index_t h = 0; h < heads; ++h) {
          u = std::max(u, z[h * n + i] - r.sel.offsets[h]);
          estimate = std::max(estimate, center[h * n + i] - static_cast<float>(r.sel.offsets[h]));
        }
        if (!exact) u = estimate;
        const double key = exp_threshold::gumbel(stream, i) + u;
        const bool certain = u >= t + log_certain;
        const auto at = std::lower_bound(r.sel.sampled.begin(), r.sel.sampled.end(), i);
        const bool listed = at != r.sel.sampled.end() && *at == i;
        sampled += listed;
        const double margin = std::min(std::fabs(key - t), std::fabs(u - t - log_certain));
        if (margin < (exact ? 1e-4 : 1e-6)) continue;  // float and double may decide a near-tie differently
        ++checked;
        REQUIRE(in_ranges(r.sel.ranges, i) == (key >= t || certain));
        REQUIRE(listed == (key >= t && !certain));
        if (listed) {
          REQUIRE(r.sel.odds[at - r.sel.sampled.begin()] == Approx(1.0 / std::expm1(std::exp(u - t))).epsilon(1e-3));
        }
      }
      REQUIRE(checked > n - 10);
      REQUIRE(r.io.key_bytes >= (exact ? r.sel.count() : 0) * d * sizeof(floe::half));
      // With the estimates' weights only the sample's keys are read (and a few of tokens
      // that arrive at a level boundary, read one level early to be safe).
      if (!exact) REQUIRE(r.io.key_bytes <= (r.sel.count() * 101 / 100 + 2) * d * sizeof(floe::half));
      REQUIRE(sampled == r.sel.sampled.size());
    }
  }
}

TEST_CASE("exp_threshold+horvitz_thompson outputs the Horvitz-Thompson ratio of its sample, for every head", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(17);
  const index_t n = 4000, d = 64, dv = 48, heads = 4;
  floe::testing::random_kv<floe::bfloat16> data(g, n, d, dv, 5);
  const auto kv = data.view();
  int sampled_somewhere = 0;
  for (bool exact : {true, false})
    for (index_t cap : {40, 300, 1500}) {
      auto sel = exp_threshold::with_budget(cap);
      sel.exact_weights = exact;
      const threshold_ht est{sel, {}};
      const auto state = est.build(kv);
      const auto qd = floe::testing::random_floats(g, heads * d, 2.5f);
      const auto q = floe::query_group::make(qd.data(), heads, d);
      const auto z = exact_scores(kv, q);
      const auto r = draw(sel, state.selector_index, kv, q);
      sampled_somewhere += !r.sel.sampled.empty();
      for (const auto& exec_out : {std::pair{0, std::vector<double>{}}, std::pair{1, std::vector<double>{}}}) {
        floe::stats s;
        const auto got = exec_out.first == 0 ? floe::testing::decode_output(est, state, kv, q, s)
                                             : floe::testing::decode_output(est, state, kv, q, s, floe::exec::simd{});
        for (index_t h = 0; h < heads; ++h) {
          double top = -std::numeric_limits<double>::infinity();
          for (index_t i = 0; i < n; ++i) top = std::max(top, z[h * n + i]);
          std::vector<double> num(dv, 0.0);
          double den = 0;
          auto add = [&](index_t i, double factor) {
            const double w = std::exp(z[h * n + i] - top) * factor;
            den += w;
            for (index_t e = 0; e < dv; ++e) num[e] += w * floe::to_float(kv.value_row(i)[e]);
          };
          for (const auto& range : r.sel.ranges)
            for (index_t i = range.begin; i < range.end; ++i) add(i, 1.0);
          for (index_t k = 0; k < r.sel.sampled.size(); ++k) add(r.sel.sampled[k], r.sel.odds[k]);
          if (den == 0) {  // nothing sampled within the cap: the output is zeros
            REQUIRE(std::all_of(got.begin() + h * dv, got.begin() + (h + 1) * dv, [](double x) { return x == 0; }));
            continue;
          }
          for (double& x : num) x /= den;
          INFO("exact weights " << exact << " cap " << cap << " head " << h << " executor " << exec_out.first);
          REQUIRE(floe::testing::relative_l2(got.data() + h * dv, num.data(), dv) <= 1e-5);
        }
      }
    }
  REQUIRE(sampled_somewhere >= 4);  // most cases have a residual to check
}

TEST_CASE("exp_threshold's Horvitz-Thompson mass and output numerator are unbiased over seeds", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(12);
  const index_t n = 2000, d = 32, heads = 2;
  floe::testing::random_kv<float> data(g, n, d, 8);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  const auto z = exact_scores(kv, q);
  const int draws = 600;
  for (bool exact : {true, false})
  for (index_t h = 0; h < heads; ++h) {
    exp_threshold sel = exp_threshold::with_budget(n - 1);
    sel.levels = 17;  // about 6 levels below the heaviest token's weight
    sel.exact_weights = exact;
    const auto idx = sel.build(kv);
    double top = -std::numeric_limits<double>::infinity();
    for (index_t i = 0; i < n; ++i) top = std::max(top, z[h * n + i]);
    double mass = 0, numerator = 0, scale = 0;  // truth: D, coordinate 0 of N, and |N|
    for (index_t i = 0; i < n; ++i) {
      mass += std::exp(z[h * n + i] - top);
      numerator += std::exp(z[h * n + i] - top) * kv.value_row(i)[0];
    }
    for (index_t e = 0; e < kv.dv(); ++e) {
      double x = 0;
      for (index_t i = 0; i < n; ++i) x += std::exp(z[h * n + i] - top) * kv.value_row(i)[e];
      scale += x * x;
    }
    scale = std::sqrt(scale);
    std::vector<double> rel_mass, rel_num;
    double mean_sample = 0;
    for (int k = 0; k < draws; ++k) {
      sel.seed = 1000 + k;
      const auto r = draw(sel, idx, kv, q);
      double m = 0, a = 0;
      for (const auto& range : r.sel.ranges)
        for (index_t i = range.begin; i < range.end; ++i) {
          m += std::exp(z[h * n + i] - top);
          a += std::exp(z[h * n + i] - top) * kv.value_row(i)[0];
        }
      for (index_t s = 0; s < r.sel.sampled.size(); ++s) {
        const index_t i = r.sel.sampled[s];
        m += std::exp(z[h * n + i] - top) * r.sel.odds[s];
        a += std::exp(z[h * n + i] - top) * r.sel.odds[s] * kv.value_row(i)[0];
      }
      rel_mass.push_back(m / mass - 1);
      rel_num.push_back((a - numerator) / scale);  // relative to |N|: coordinate 0 may be near 0
      mean_sample += double(r.sel.count()) / draws;
    }
    for (const auto* x : {&rel_mass, &rel_num}) {
      double mean = 0, sq = 0;
      for (double v : *x) mean += v / draws;
      for (double v : *x) sq += (v - mean) * (v - mean);
      const double se = std::sqrt(sq / (draws - 1) / draws);
      INFO("exact weights " << exact << " head " << h << (x == &rel_mass ? " mass" : " numerator") << ": mean relative bias " << mean
                   << ", standard error " << se << ", mean sample " << mean_sample << " of " << n);
      REQUIRE(se > 1e-4);  // the estimate does vary: the test is not of an exact read
      REQUIRE(std::fabs(mean) <= 4 * se);  // 8 checks per run: 4 standard errors keep false alarms rare
    }
    REQUIRE(mean_sample < 0.8 * n);
  }
}

TEST_CASE("exp_threshold's certificates hold at least at their stated rate, and reads stay within the cap", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(13);
  const index_t n = 6000, d = 64, dv = 32, heads = 4;
  floe::testing::random_kv<floe::bfloat16> data(g, n, d, dv);
  // Values with a common direction, so that the output is not near zero.
  for (index_t i = 0; i < n; ++i) data.values[i * dv] = floe::bfloat16::from_float(3.f + floe::to_float(data.values[i * dv]));
  const auto kv = data.view();
  const double epsilon = 0.25;
  for (bool exact : {true, false}) {
  auto sel = exp_threshold::certified(epsilon, n / 2);
  sel.exact_weights = exact;
  threshold_ht est{sel, {}};
  const auto state = est.build(kv);
  int heads_checked = 0, violations = 0, certified = 0;
  std::vector<double> tightness;  // error / certificate, where certified
  for (int trial = 0; trial < 60; ++trial) {
    const auto qd = floe::testing::random_floats(g, heads * d, 3.f);
    const auto q = floe::query_group::make(qd.data(), heads, d);
    floe::stats s;
    const auto got = floe::testing::decode_output(est, state, kv, q, s);
    const auto want = dense_reference(kv, q);
    INFO("trial " << trial << " read " << s.tokens_read << " certificate " << s.certificate);
    REQUIRE(s.tokens_read <= n);
    if (s.tokens_read == n) {  // not certified within the cap: read everything
      REQUIRE(s.certificate == 0.0);
    } else {
      REQUIRE(s.tokens_read <= n / 2);
      certified += s.certificate <= epsilon;  // else the deepest level within the cap, its certificate reported
    }
    for (index_t h = 0; h < heads; ++h, ++heads_checked) {
      const double err = floe::testing::relative_l2(got.data() + h * dv, want.data() + h * dv, dv);
      violations += err > s.certificate;
      if (s.certificate > 0 && s.certificate <= epsilon) tightness.push_back(err / s.certificate);
    }
  }
  INFO("exact weights " << exact << ": certified " << certified << " of 60 steps; " << violations << " of "
                         << heads_checked << " head errors above the certificate; median error / certificate "
                         << (tightness.empty() ? 0.0 : floe::testing::median(tightness)));
  REQUIRE(certified >= 10);
  REQUIRE(violations <= 0.05 * heads_checked + 3 * std::sqrt(0.05 * 0.95 * heads_checked));
  }
}

TEST_CASE("exp_threshold with a cap samples at most that many tokens", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(14);
  const index_t n = 5000, d = 32, heads = 4;
  floe::testing::random_kv<float> data(g, n, d, d);
  const auto kv = data.view();
  for (index_t cap : {1, 50, 400, 2500}) {
    threshold_ht est{exp_threshold::with_budget(cap), {}};
    const auto state = est.build(kv);
    const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
    floe::stats s;
    const auto got = floe::testing::decode_output(est, state, kv, floe::query_group::make(qd.data(), heads, d), s);
    INFO("cap " << cap << " read " << s.tokens_read);
    REQUIRE(s.tokens_read <= cap);
    REQUIRE(std::all_of(got.begin(), got.end(), [](double x) { return std::isfinite(x); }));
    if (cap >= 400) REQUIRE(s.tokens_read > cap / 4);  // the deepest level within the cap is used
  }
}

TEST_CASE("exp_threshold's index after append equals a rebuild", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(15);
  const index_t n = 1500, d = 32, heads = 4;
  floe::testing::random_kv<floe::half> data(g, n, d, d);
  threshold_ht est{exp_threshold::with_budget(300), {}};
  const floe::kv_view<floe::half> part(data.keys.data(), data.values.data(), 1100, d, d);
  auto grown = est.build(part);
  est.append(grown, data.view());
  const auto fresh = est.build(data.view());
  REQUIRE(grown.selector_index.value_norm_max == fresh.selector_index.value_norm_max);
  const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  floe::stats a, b;
  REQUIRE(floe::testing::decode_output(est, grown, data.view(), q, a) ==
          floe::testing::decode_output(est, fresh, data.view(), q, b));
  REQUIRE(a.tokens_read == b.tokens_read);
  // An index that lags the cache reads the unindexed tokens exactly.
  floe::stats c;
  const auto lagging = est.build(part);
  const auto out = floe::testing::decode_output(est, lagging, data.view(), q, c);
  REQUIRE(std::all_of(out.begin(), out.end(), [](double x) { return std::isfinite(x); }));
  REQUIRE(c.tokens_read >= n - 1100);
}

TEST_CASE("exp_threshold refuses bad parameters and bad caches by name", "[threshold]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(16);
  floe::testing::random_kv<float> data(g, 200, 16, 16);
  const auto kv = data.view();
  using floe::testing::argument_of;
  auto with = [](auto change) {
    exp_threshold s;
    change(s);
    return s;
  };
  const exp_threshold bad[] = {with([](auto& s) { s.epsilon = -0.1; }), with([](auto& s) { s.epsilon = std::nan(""); }),
                               with([](auto& s) { s.delta = 0; }),      with([](auto& s) { s.delta = 1; }),
                               with([](auto& s) { s.ratio = 1; }),      with([](auto& s) { s.levels = 0; }),
                               with([](auto& s) { s.certain = 0; })};
  const char* names[] = {"epsilon", "epsilon", "delta", "delta", "ratio", "levels", "certain"};
  const exp_threshold good;
  const auto idx = good.build(kv);
  const auto qd = floe::testing::random_floats(g, 16, 1.f);
  const auto q = floe::query_group::make(qd.data(), 1, 16);
  for (std::size_t k = 0; k < std::size(bad); ++k) {
    REQUIRE(argument_of([&] { (void)bad[k].build(kv); }) == names[k]);
    floe::select::threshold_sample out;
    floe::stats s;
    REQUIRE(argument_of([&] { bad[k].select(idx, kv, q, floe::exec::scalar{}, out, s); }) == names[k]);
  }
  // NaN values are refused at build with the token; an index of another d is refused.
  auto poisoned = data;
  poisoned.values[37 * 16 + 5] = std::nanf("");
  REQUIRE(argument_of([&] { (void)good.build(poisoned.view()); }) == "values");
  floe::testing::random_kv<float> other(g, 200, 8, 16);
  floe::select::threshold_sample out;
  floe::stats s;
  REQUIRE(argument_of([&] { good.select(good.build(other.view()), kv, q, floe::exec::scalar{}, out, s); }) == "index");
  // A NaN query is refused before the output is written.
  threshold_ht est{exp_threshold::with_budget(50), {}};
  auto nan_query = qd;
  nan_query[3] = std::nanf("");
  std::vector<float> untouched(16, -3.f);
  floe::stats t;
  REQUIRE(argument_of([&] {
            est.decode(est.build(kv), kv, floe::query_group::make(nan_query.data(), 1, 16), floe::exec::simd{},
                       floe::output_group<float>{untouched.data(), 1, 16, 0}, t);
          }) == "query");
  REQUIRE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return x == -3.f; }));
}
