// The feature-map residual: its middle-mass estimate is unbiased over draws of the map,
// appending equals rebuilding, it completes what Top-K leaves out, extreme scores stay
// finite, and bad input is refused naming the argument.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>

#include "floe/residual/feature_map.hpp"
#include "floe/residual/feature_maps/optimized_positive_random.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/streaming.hpp"
#include "floe/select/topk_anchors.hpp"
#include "support/random_kv.hpp"
#include "topk/topk_support.hpp"

namespace {
using floe::index_t;
using floe::residual::feature_map;
using floe::residual::optimized_positive_random;
using floe::residual::positive_random;
using floe::select::exact_scan;
using floe::select::quantized_scan;
using floe::select::topk_anchors;

static_assert(floe::ResidualFor<feature_map<positive_random>, topk_anchors<exact_scan>>);
static_assert(floe::ResidualFor<feature_map<optimized_positive_random>, floe::select::streaming>);

// The exact mass sum_{i in [b, e), i not exact} exp(s q.k_i).
template <floe::KvView KV>
double left_out_mass(const KV& kv, const floe::query_group& q, const floe::selection& sel, floe::token_range region) {
  std::vector<char> exact(kv.n(), 0);
  for (const auto& r : sel.ranges)
    for (index_t i = r.begin; i < r.end; ++i) exact[i] = 1;
  std::vector<float> z(kv.n());
  floe::exec::scalar{}.score(kv, q, 0, {0, kv.n()}, z.data());
  double mass = 0;
  for (index_t i = region.begin; i < region.end; ++i)
    if (!exact[i]) mass += std::exp(double(z[i]));
  return mass;
}

// Mean relative bias of D^ over fresh draws of the map, and its standard error.
template <class Map>
std::pair<double, double> relative_bias(const floe::kv_view<float>& kv, const floe::query_group& q, index_t draws,
                                        index_t features, std::uint64_t salt) {
  const topk_anchors<exact_scan> sel{4, 32, floe::budget::fraction(0.1), {}};
  topk_anchors<exact_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  const double truth = left_out_mass(kv, q, chosen, chosen.middle);
  double sum = 0, sum_sq = 0;
  for (index_t r = 0; r < draws; ++r) {
    feature_map<Map> fm;
    fm.map.features = features;
    fm.map.seed = floe::testing::seed() ^ (salt + 0x9e37 * r);
    const auto idx = fm.build(kv, sel, {});
    const auto est = idx.estimate(kv, q, chosen.ranges);
    const double rel = std::exp(est[0].log_ref) * est[0].mass / truth - 1.0;
    sum += rel;
    sum_sq += rel * rel;
  }
  const double mean = sum / draws, var = (sum_sq / draws - mean * mean) * draws / (draws - 1);
  return {mean, std::sqrt(var / draws)};
}

// 3-standard-error test; a miss is re-tested once on fresh, independent draws, so an
// unbiased map fails with probability ~0.27%^2 while a biased one still fails both.
template <class Map>
bool unbiased_in_two_stages(const floe::kv_view<float>& kv, const floe::query_group& q, std::uint64_t salt) {
  for (std::uint64_t stage = 0; stage < 2; ++stage) {
    const auto [bias, se] = relative_bias<Map>(kv, q, 300, 64, salt + 1000 * stage);
    UNSCOPED_INFO("stage " << stage << ": mean relative bias " << bias << ", standard error " << se);
    REQUIRE(se < 0.05);  // enough draws for the test to mean something
    if (std::fabs(bias) <= 3 * se) return true;
  }
  return false;
}
}  // namespace

TEST_CASE("the feature-map middle mass is unbiased over draws of the map", "[feature_map][statistics]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(20);
  // Small norms (s|q|^2 ~ s|k|^2 ~ 0.6) keep the draws' distribution close enough to normal
  // for a 3-standard-error test; small sizes keep 600 builds quick in the sanitizer build.
  const index_t n = 300, d = 16;
  floe::testing::random_kv<float> data(g, n, d, 8, 0, 0, 0.4f);
  const auto qd = floe::testing::random_floats(g, d, 0.4f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  {
    REQUIRE(unbiased_in_two_stages<positive_random>(data.view(), q, 1));
  }
  {
    REQUIRE(unbiased_in_two_stages<optimized_positive_random>(data.view(), q, 2));
  }
}

TEST_CASE("appending tokens as they leave the tail equals rebuilding", "[feature_map][append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(21);
  const index_t n0 = 1000, n1 = 1200, d = 24, dv = 12;
  floe::testing::random_kv<floe::half> data(g, n1, d, dv, 2, 0, 1.f);
  auto view = [&](index_t n) {
    return floe::kv_view<floe::half>(data.keys.data(), data.values.data(), n, d, dv, d + 2, dv + 2);
  };
  const topk_anchors<quantized_scan> sel{4, 64, floe::budget::fraction(0.05), {}};
  feature_map<positive_random> fm;
  fm.map.features = 96;
  auto grown = fm.build(view(n0), sel, {});
  REQUIRE(grown.region() == floe::token_range{4, n0 - 64});
  for (index_t n = n0 + 1; n <= n1; ++n) grown.append(view(n));  // one token per step
  REQUIRE(grown.region() == floe::token_range{4, n1 - 64});
  const auto rebuilt = floe::feature_map_summary::build(view(n1), {4, n1 - 64}, 64, grown.params(), grown.centre());
  for (Eigen::Index m = 0; m < 96; ++m) {
    const double a = std::exp(double(grown.log_scale()[m])) * grown.zeta()[m];
    const double b = std::exp(double(rebuilt.log_scale()[m])) * rebuilt.zeta()[m];
    REQUIRE(std::fabs(a - b) <= 1e-5 * b);
    for (Eigen::Index j = 0; j < Eigen::Index(dv); ++j) {
      const double pa = std::exp(double(grown.log_scale()[m])) * grown.phi()(m, j);
      const double pb = std::exp(double(rebuilt.log_scale()[m])) * rebuilt.phi()(m, j);
      REQUIRE(std::fabs(pa - pb) <= 1e-5 * b);  // relative to the feature's total weight
    }
  }
  // And the decode outputs agree.
  const auto qd = floe::testing::random_floats(g, 2 * d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 2, d);
  topk_anchors<quantized_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(view(n1)), view(n1), q, floe::exec::scalar{}, chosen, s);
  const auto e1 = grown.estimate(view(n1), q, chosen.ranges), e2 = rebuilt.estimate(view(n1), q, chosen.ranges);
  for (index_t h = 0; h < 2; ++h) {
    REQUIRE(std::fabs(e1[h].log_ref + std::log(e1[h].mass) - e2[h].log_ref - std::log(e2[h].mass)) <= 1e-5);
  }
}

TEST_CASE("feature_map completes the mass Top-K leaves out when attention is flat", "[feature_map][accuracy]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(22);
  const index_t n = 4000, d = 32, dv = 16, heads = 4;
  floe::testing::random_kv<float> data(g, n, d, dv, 0, 0, 0.5f);
  // Values that follow the keys: the tokens Top-K leaves out hold values unlike those it
  // reads, so renormalising over what was read is biased.
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < dv; ++j) data.values[i * dv + j] = data.keys[i * d + j] + 0.1f * data.values[i * dv + j];
  const auto kv = data.view();
  const topk_anchors<quantized_scan> sel{4, 64, floe::budget::fraction(0.05), {}};
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::none> only(sel, {});
  floe::estimator<topk_anchors<quantized_scan>, feature_map<positive_random>> completed(sel, {});
  const auto s1 = only.build(kv);
  const auto s2 = completed.build(kv);
  // Per (query, head) errors; their medians, because the map's variance gives a rare
  // query a large error and a mean over 64 would let one such draw decide the test.
  std::vector<double> err_only, err_completed;
  for (int t = 0; t < 16; ++t) {
    const auto qd = floe::testing::random_floats(g, heads * d, 0.5f);
    const auto q = floe::query_group::make(qd.data(), heads, d);
    const auto want = floe::testing::dense_output(kv, q);
    floe::stats a, b;
    const auto o1 = floe::testing::decode_output(only, s1, kv, q, a);
    const auto o2 = floe::testing::decode_output(completed, s2, kv, q, b);
    for (index_t h = 0; h < heads; ++h) {
      err_only.push_back(floe::testing::relative_l2(o1.data() + h * dv, want.data() + h * dv, dv));
      err_completed.push_back(floe::testing::relative_l2(o2.data() + h * dv, want.data() + h * dv, dv));
    }
    REQUIRE(a.key_bytes + a.value_bytes == b.key_bytes + b.value_bytes);  // no extra KV reads
    REQUIRE(b.summary_bytes == a.summary_bytes + s2.residual_index.bytes());
  }
  const double median_only = floe::testing::median(err_only), median_completed = floe::testing::median(err_completed);
  INFO("median relative L2 error: selection only " << median_only << ", with feature_map " << median_completed);
  REQUIRE(median_completed < 0.5 * median_only);
}

TEST_CASE("a query of another scale is rescaled to the map's own", "[feature_map]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(25);
  const index_t n = 500, d = 16, dv = 8;
  floe::testing::random_kv<float> data(g, n, d, dv, 0, 0, 0.5f);
  const auto kv = data.view();
  auto qd = floe::testing::random_floats(g, d, 0.5f);
  auto q = floe::query_group::make(qd.data(), 1, d);
  q.scale *= 3;  // e.g. a model whose softmax scale is not 1/sqrt(d)
  auto tripled = qd;
  for (auto& x : tripled) x *= 3;
  const auto same = floe::query_group::make(tripled.data(), 1, d);
  const topk_anchors<exact_scan> sel{4, 16, floe::budget::tokens(20), {}};
  topk_anchors<exact_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  const auto idx = feature_map<positive_random>{}.build(kv, sel, {});
  const auto a = idx.estimate(kv, q, chosen.ranges), b = idx.estimate(kv, same, chosen.ranges);
  REQUIRE(a[0].log_ref + std::log(a[0].mass) == Approx(b[0].log_ref + std::log(b[0].mass)).epsilon(1e-6));
  for (index_t j = 0; j < dv; ++j) REQUIRE(a[0].numerator[j] / a[0].mass == Approx(b[0].numerator[j] / b[0].mass).epsilon(1e-5));
}

TEST_CASE("extreme scores stay finite and the clamped estimate adds nothing", "[feature_map][range]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(23);
  const index_t n = 600, d = 16, dv = 8;
  floe::testing::random_kv<float> data(g, n, d, dv, 0, 0, 1.f);
  const auto kv = data.view();
  auto qd = floe::testing::random_floats(g, 2 * d, 1.f);
  for (auto& x : qd) x *= 3000.f;  // scores of order 1e4
  const auto q = floe::query_group::make(qd.data(), 2, d);
  const topk_anchors<exact_scan> sel{4, 16, floe::budget::tokens(40), {}};
  floe::estimator<topk_anchors<exact_scan>, feature_map<positive_random>> est(sel, {});
  floe::stats s;
  const auto got = floe::testing::decode_output(est, est.build(kv), kv, q, s);
  const auto want = floe::testing::dense_output(kv, q);
  for (double x : got) REQUIRE(std::isfinite(x));
  REQUIRE(floe::testing::worst_head_error(got, want, 2, dv) <= 1e-6);  // the top token carries it all
}

TEST_CASE("feature_map refuses bad input naming the argument", "[feature_map][bad_input]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(24);
  const index_t n = 300, d = 16, dv = 8;
  floe::testing::random_kv<float> data(g, n, d, dv);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const auto arg_of = [](auto&& f) { return floe::testing::argument_of(f); };
  const topk_anchors<exact_scan> sel{4, 16, floe::budget::tokens(20), {}};
  feature_map<positive_random> none_features;
  none_features.map.features = 0;
  REQUIRE(arg_of([&] { (void)none_features.build(kv, sel, {}); }) == "features");
  feature_map<optimized_positive_random> zero_opt;
  zero_opt.map.features = 0;
  REQUIRE(arg_of([&] { (void)zero_opt.build(kv, sel, {}); }) == "features");

  const feature_map<positive_random> fm;
  const auto early = fm.build(floe::kv_view<float>(data.keys.data(), data.values.data(), 250, d, dv), sel, {});
  topk_anchors<exact_scan>::selection chosen;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, chosen, s);
  floe::partial_set<double> parts(1, dv);
  // Tokens [234, 284) left the tail but were never appended to the summary.
  REQUIRE(arg_of([&] { fm.estimate(early, kv, q, chosen, floe::exec::scalar{}, parts, s); }) == "index");
  // NaN keys in the region.
  auto bad = data;
  bad.keys[100 * d + 3] = std::nanf("");
  REQUIRE(arg_of([&] { (void)fm.build(bad.view(), sel, {}); }) == "keys");
}
