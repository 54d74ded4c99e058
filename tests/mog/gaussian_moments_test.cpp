// The Gaussian mass estimate on data that is Gaussian by construction: n exp(s q.mu +
// s^2/2 sum q_t^2 var_t) is the expectation of sum_i exp(s q.k_i), so the ratio of the true
// sum to it averages to 1 within the standard error sqrt((exp(v) - 1) / n), v = s^2 q' Sigma q.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "mog/mog_support.hpp"

using namespace floe;

namespace {

struct gaussian_keys {
  index_t n, d;
  std::vector<float> mean, var, keys;
  gaussian_keys(std::mt19937_64& g, index_t n_, index_t d_) : n(n_), d(d_), mean(d_), var(d_), keys(n_ * d_) {
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> sd(0.3f, 1.0f);
    for (index_t t = 0; t < d; ++t) {
      mean[t] = normal(g);
      const float s = sd(g);
      var[t] = s * s;
    }
    for (index_t i = 0; i < n; ++i)
      for (index_t t = 0; t < d; ++t) keys[i * d + t] = mean[t] + std::sqrt(var[t]) * normal(g);
  }
  double log_sum_exp(const float* q, double scale) const {
    std::vector<double> z(n);
    double top = -INFINITY;
    for (index_t i = 0; i < n; ++i) {
      double dot = 0;
      for (index_t t = 0; t < d; ++t) dot += static_cast<double>(q[t]) * keys[i * d + t];
      top = std::max(top, z[i] = scale * dot);
    }
    double sum = 0;
    for (double x : z) sum += std::exp(x - top);
    return top + std::log(sum);
  }
  double score_variance(const float* q, double scale) const {
    double v = 0;
    for (index_t t = 0; t < d; ++t) v += static_cast<double>(q[t]) * q[t] * var[t];
    return scale * scale * v;
  }
};

}  // namespace

TEST_CASE("gaussian_moments: the mass estimate is unbiased on Gaussian keys", "[mog][statistical]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(731);
  const index_t n = 5000, d = 16, trials = 40;
  const double scale = 1.0 / std::sqrt(double(d));
  double sum_ratio = 0, sum_var = 0;
  for (index_t trial = 0; trial < trials; ++trial) {
    const gaussian_keys k(g, n, d);
    const auto q = floe::testing::random_floats(g, d, 0.8f);
    const double v = k.score_variance(q.data(), scale);
    const double se = std::sqrt(std::expm1(v) / static_cast<double>(n));
    const double predicted = gaussian_log_mass(std::log(double(n)), k.mean.data(), k.var.data(), q.data(), d, scale);
    const double ratio = std::exp(k.log_sum_exp(q.data(), scale) - predicted);
    INFO("trial " << trial << " v " << v << " ratio " << ratio << " se " << se);
    REQUIRE(std::abs(ratio - 1) < 6 * se);  // each trial: within 6 standard errors
    sum_ratio += ratio;
    sum_var += se * se;
  }
  // The mean over trials: within 4 standard errors of 1 (the estimate has no bias).
  REQUIRE(std::abs(sum_ratio / trials - 1) < 4 * std::sqrt(sum_var) / trials);
}

TEST_CASE("gaussian_moments: fitted moments estimate a Gaussian group's mass and tilted value", "[mog][statistical]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(732);
  const index_t n = 6000, d = 16, dv = 4;
  const gaussian_keys k(g, n, d);
  // Values linear in the key plus noise: under the tilt exp(s q.k) their mean is nu + s C q.
  std::vector<float> values(n * dv);
  const auto a = floe::testing::random_floats(g, dv * d, 0.5f);
  std::normal_distribution<float> noise(0.f, 0.3f);
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < dv; ++j) {
      double v = noise(g);
      for (index_t t = 0; t < d; ++t) v += a[j * d + t] * (k.keys[i * d + t] - k.mean[t]);
      values[i * dv + j] = static_cast<float>(1.0 + v);
    }
  const kv_view<float> kv(k.keys.data(), values.data(), n, d, dv);
  mog_config one;
  one.clusters = 1;
  one.subclusters = 1;
  one.outlier_fraction = 0;
  one.cross_covariance = true;
  const auto sel = floe::testing::mog_selector(budget::tokens(0), one);
  const floe::testing::mog est(sel, {true});
  const auto st = est.build(kv);
  for (int trial = 0; trial < 10; ++trial) {
    const auto qd = floe::testing::random_floats(g, d, 0.8f);
    const auto q = query_group::make(qd.data(), 1, d);
    const double v = k.score_variance(qd.data(), q.scale);
    const double se = std::sqrt(std::expm1(v) / static_cast<double>(n));
    select::mog_clusters::selection out;
    stats s;
    sel.select(st.selector_index, kv, q, exec::scalar{}, out, s);
    REQUIRE(out.residual_groups.size() == 1);
    const double ratio = std::exp(k.log_sum_exp(qd.data(), q.scale) - out.residual_log_mass[0]);
    INFO("trial " << trial << " v " << v << " ratio " << ratio << " se " << se);
    REQUIRE(std::abs(ratio - 1) < 6 * se + 1e-3);
    // The output is the tilted value mean; with the cross-covariance it matches dense.
    const auto want = floe::testing::dense_reference(kv, q);
    const auto got = floe::testing::decode(est, st, kv, q, s);
    REQUIRE(floe::testing::relative_l2(got.data(), want.data(), dv) < 0.05);
  }
}
