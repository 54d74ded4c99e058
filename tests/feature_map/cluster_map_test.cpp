// The cluster feature map: exact when every cluster is one repeated key, the truncated
// Gaussian mass of Gaussian keys matches what Top-K left out, both threshold paths agree,
// append keeps it exact, and bad input is refused naming the argument.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/residual/cluster_map.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "support/random_kv.hpp"
#include "topk/topk_support.hpp"

namespace {
using floe::index_t;
using floe::residual::cluster_map;
using floe::select::exact_scan;
using floe::select::quantized_scan;
using floe::select::topk_anchors;

static_assert(floe::ResidualFor<cluster_map, topk_anchors<quantized_scan>>);

// n tokens whose keys are `distinct` random vectors (each token one of them, at random),
// with random values, or with `tied_values` one random value row per key vector.
struct repeated_keys {
  index_t n, d, dv;
  std::vector<float> keys, values;
  repeated_keys(std::mt19937_64& g, index_t n_, index_t d_, index_t dv_, index_t distinct, bool tied_values = false)
      : n(n_), d(d_), dv(dv_) {
    const auto vectors = floe::testing::random_floats(g, distinct * d, 0.7f);
    const auto rows = floe::testing::random_floats(g, distinct * dv);
    std::uniform_int_distribution<index_t> pick(0, distinct - 1);
    keys.resize(n * d);
    values = floe::testing::random_floats(g, n * dv);
    for (index_t i = 0; i < n; ++i) {
      const index_t v = pick(g);
      std::copy_n(vectors.data() + v * d, d, keys.data() + i * d);
      if (tied_values) std::copy_n(rows.data() + v * dv, dv, values.data() + i * dv);
    }
  }
  floe::kv_view<float> view(index_t tokens = 0) const {
    return {keys.data(), values.data(), tokens ? tokens : n, d, dv};
  }
};

// Output of one decode against dense attention in double: the largest relative row error.
template <class Est>
double error_against_dense(const Est& est, const typename Est::state& st, const floe::kv_view<float>& kv,
                           const floe::query_group& q) {
  floe::stats s;
  const auto got = floe::testing::decode_output(est, st, kv, q, s);
  const auto want = floe::testing::dense_reference(kv, q);
  return floe::testing::worst_head_error(got, want, q.heads, kv.dv());
}
}  // namespace

TEST_CASE("cluster map: clusters of one repeated key are estimated exactly", "[feature_map][clusters]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(301);
  const index_t n = 900, d = 16, dv = 12, distinct = 6;
  const repeated_keys data(g, n, d, dv, distinct);
  const auto kv = data.view();
  for (const index_t heads : {1, 3}) {
    const auto qd = floe::testing::random_floats(g, heads * d, 1.f);
    const auto q = floe::query_group::make(qd.data(), heads, d);
    for (const index_t k : {0, 40, 200}) {
      INFO("heads " << heads << ", middle budget " << k);
      // Zero variance: every left-out token scores as its cluster's mean, whatever is
      // retrieved; their values are the cluster's without the retrieved ones
      // (subtract_values), or, with nothing retrieved, the cluster's (the default).
      cluster_map residual{distinct};
      residual.subtract_values = k > 0;
      const floe::estimator<topk_anchors<exact_scan>, cluster_map> by_scan({4, 16, floe::budget::tokens(k), {}},
                                                                           residual);
      REQUIRE(error_against_dense(by_scan, by_scan.build(kv), kv, q) < 1e-5);
      const floe::estimator<topk_anchors<quantized_scan>, cluster_map> by_4bit({4, 16, floe::budget::tokens(k), {}},
                                                                              residual);
      REQUIRE(error_against_dense(by_4bit, by_4bit.build(kv), kv, q) < 1e-5);
    }
  }
}

TEST_CASE("cluster map: with one value per repeated key the default (cluster value means) is exact too",
          "[feature_map][clusters]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(306);
  const index_t n = 900, d = 16, dv = 12, distinct = 6;
  const repeated_keys data(g, n, d, dv, distinct, true);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, 3 * d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 3, d);
  for (const index_t k : {0, 40, 200}) {
    INFO("middle budget " << k);
    const floe::estimator<topk_anchors<quantized_scan>, cluster_map> est({4, 16, floe::budget::tokens(k), {}},
                                                                        {distinct});
    REQUIRE(error_against_dense(est, est.build(kv), kv, q) < 1e-5);
  }
}

TEST_CASE("cluster map: the truncated Gaussian mass matches what Top-K left out of Gaussian keys",
          "[feature_map][clusters][statistics]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(302);
  const index_t n = 40000, d = 16, dv = 4;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> spread(0.5f, 1.5f), centre(-1.f, 1.f);
  std::vector<float> mu(d), sd(d), keys(n * d);
  for (index_t t = 0; t < d; ++t) mu[t] = centre(g), sd[t] = spread(g);
  for (index_t i = 0; i < n; ++i)
    for (index_t t = 0; t < d; ++t) keys[i * d + t] = mu[t] + sd[t] * normal(g);
  const auto values = floe::testing::random_floats(g, n * dv);
  const floe::kv_view<float> kv(keys.data(), values.data(), n, d, dv);
  // |q| = 8: scores spread by 1-3 (s = 1/4) within the cluster, so the tail Top-K takes matters.
  auto qd = floe::testing::random_floats(g, d, 1.f);
  double norm = 0.0;
  for (float x : qd) norm += double(x) * x;
  for (float& x : qd) x = static_cast<float>(x * 8.0 / std::sqrt(norm));
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const topk_anchors<exact_scan> sel{4, 32, floe::budget::fraction(0.05), {}};
  topk_anchors<exact_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  // The true left-out mass of the middle, relative to e^{z_max}.
  std::vector<float> z(n);
  floe::exec::scalar{}.score(kv, q, 0, {0, n}, z.data());
  std::vector<char> taken(n, 0);
  for (const auto& r : chosen.retrieved)
    for (index_t i = r.begin; i < r.end; ++i) taken[i] = 1;
  double truth = 0.0;
  for (index_t i = chosen.middle.begin; i < chosen.middle.end; ++i)
    if (!taken[i]) truth += std::exp(double(z[i]));
  const cluster_map residual{1};
  const auto idx = residual.build(kv, sel, {});
  floe::partial_set<double> parts(1, dv);
  residual.estimate(idx, kv, q, chosen, floe::exec::scalar{}, parts, s);
  const double estimate = std::exp(parts.m(0)) * parts.l(0);
  INFO("estimated " << estimate << ", true " << truth);
  REQUIRE(std::abs(estimate / truth - 1.0) < 0.05);
  // The untruncated Gaussian counts the retrieved tail again: E[e^z] / E[e^z | z < tau] is
  // Phi(1.64) / Phi(1.64 - sd) >= 1.28 for a 5 % tail and a score spread sd >= 1.
  std::vector<double> untruncated(1, std::numeric_limits<double>::infinity());
  floe::partial_set<double> plain(1, dv);
  idx.estimate(kv, q, std::span<const floe::token_range>(chosen.retrieved), untruncated.data(), plain);
  REQUIRE(std::exp(plain.m(0)) * plain.l(0) / truth > 1.2);
}

TEST_CASE("cluster map: the threshold from the scorer's shared scores equals the one from exact scores",
          "[feature_map][clusters]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(303);
  const index_t n = 700, d = 16, dv = 8, heads = 3;
  floe::testing::random_kv<float> data(g, n, d, dv);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, heads * d, 1.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  const topk_anchors<exact_scan> sel{4, 16, floe::budget::tokens(60), {}};
  topk_anchors<exact_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  REQUIRE(chosen.shared.size() == chosen.middle.size());
  const auto from_scorer = cluster_map::thresholds(kv, q, chosen);
  auto bare = chosen;
  bare.shared.clear();
  bare.offsets.clear();
  const auto from_keys = cluster_map::thresholds(kv, q, bare);
  for (index_t h = 0; h < heads; ++h) {
    REQUIRE(std::isfinite(from_scorer[h]));
    REQUIRE(from_keys[h] == Approx(from_scorer[h]).margin(1e-5));
  }
  bare.retrieved.clear();
  for (double t : cluster_map::thresholds(kv, q, bare)) REQUIRE(t == std::numeric_limits<double>::infinity());
}

TEST_CASE("cluster map: appended tokens join their clusters and the estimate stays exact",
          "[feature_map][clusters][append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(304);
  const index_t n = 1000, d = 16, dv = 8, distinct = 5;
  const repeated_keys data(g, n, d, dv, distinct);
  const auto qd = floe::testing::random_floats(g, 2 * d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 2, d);
  cluster_map residual{distinct};
  residual.subtract_values = true;
  const floe::estimator<topk_anchors<exact_scan>, cluster_map> est({4, 16, floe::budget::tokens(50), {}}, residual);
  auto st = est.build(data.view(800));
  const index_t before = st.residual_index.region().size();
  // The grown cache is refused until appended, then exact again.
  REQUIRE(floe::testing::argument_of([&] { (void)error_against_dense(est, st, data.view(), q); }) == "index");
  est.append(st, data.view());
  REQUIRE(st.residual_index.region() == floe::token_range{4, n - 16});
  index_t counted = 0;
  for (index_t c = 0; c < st.residual_index.clusters(); ++c) counted += st.residual_index.count(c);
  REQUIRE(counted == st.residual_index.region().size());
  REQUIRE(counted == before + 200);
  REQUIRE(error_against_dense(est, st, data.view(), q) < 1e-5);
}

TEST_CASE("cluster map refuses bad input naming the argument", "[feature_map][clusters][bad_input]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(305);
  const index_t n = 300, d = 16, dv = 8;
  floe::testing::random_kv<float> data(g, n, d, dv);
  const auto kv = data.view();
  const auto arg_of = [](auto&& f) { return floe::testing::argument_of(f); };
  const topk_anchors<exact_scan> sel{4, 16, floe::budget::tokens(20), {}};
  REQUIRE(arg_of([&] { (void)cluster_map{0}.build(kv, sel, {}); }) == "clusters");
  REQUIRE(arg_of([&] { (void)cluster_map{70000}.build(kv, sel, {}); }) == "clusters");
  auto bad = data;
  bad.keys[100 * d + 3] = std::nanf("");
  REQUIRE(arg_of([&] { (void)cluster_map{}.build(bad.view(), sel, {}); }) == "keys");
  // A query with NaN is refused before anything is estimated.
  auto qd = floe::testing::random_floats(g, d, 1.f);
  qd[2] = std::nanf("");
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const floe::estimator<topk_anchors<exact_scan>, cluster_map> est(sel, {});
  const auto st = est.build(kv);
  floe::stats s;
  REQUIRE(arg_of([&] { (void)floe::testing::decode_output(est, st, kv, q, s); }) == "query");
  // A NaN key among the tokens to append: refused, the summary unchanged.
  {
    const topk_anchors<exact_scan> small{4, 16, floe::budget::tokens(20), {}};
    auto grown = data;
    grown.keys[280 * d + 1] = std::nanf("");  // past the 260 tokens summarised
    auto summary = cluster_map{}.build(floe::kv_view<float>(grown.keys.data(), grown.values.data(), 260, d, dv), small, {});
    const auto region = summary.region();
    REQUIRE(arg_of([&] { summary.append(grown.view()); }) == "keys");
    REQUIRE(summary.region() == region);
    index_t counted = 0;
    for (index_t c = 0; c < summary.clusters(); ++c) counted += summary.count(c);
    REQUIRE(counted == region.size());
  }
  // A cache cut below the summarised region.
  auto whole = cluster_map{}.build(kv, sel, {});
  REQUIRE(arg_of([&] { whole.append(floe::kv_view<float>(data.keys.data(), data.values.data(), 200, d, dv)); }) == "kv");
}
