#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>

#include "floe/core/softmax_partial.hpp"
#include "support/random_kv.hpp"

using partial = floe::softmax_partial<double>;

namespace {
// The partial of scores z[b, e) with values v (dv per token), computed directly.
partial direct(const std::vector<double>& z, const std::vector<double>& v, std::size_t dv, std::size_t b, std::size_t e) {
  partial p(dv);
  if (b == e) return p;
  p.m = *std::max_element(z.begin() + b, z.begin() + e);
  for (std::size_t i = b; i < e; ++i) {
    const double w = std::exp(z[i] - p.m);
    p.l += w;
    for (std::size_t j = 0; j < dv; ++j) p.a[j] += w * v[i * dv + j];
  }
  return p;
}

void require_same_output(const partial& x, const partial& y, double tol) {
  std::vector<double> ox(x.a.size()), oy(y.a.size());
  x.finalize(ox.data());
  y.finalize(oy.data());
  for (std::size_t j = 0; j < ox.size(); ++j) REQUIRE(ox[j] == Approx(oy[j]).epsilon(tol).margin(tol));
}

struct case_data {
  std::vector<double> z, v;
  std::size_t n, dv;
};

case_data make_case(std::mt19937_64& g, std::size_t n, std::size_t dv, double score_scale) {
  std::normal_distribution<double> normal;
  case_data c{std::vector<double>(n), std::vector<double>(n * dv), n, dv};
  for (auto& x : c.z) x = score_scale * normal(g);
  for (auto& x : c.v) x = normal(g);
  return c;
}
}  // namespace

TEST_CASE("merge of split partials equals the unsplit partial (split-K)", "[partial]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(11);
  for (double scale : {1.0, 30.0, 1e4}) {
    const auto c = make_case(g, 257, 5, scale);
    std::uniform_int_distribution<std::size_t> cut(0, c.n);
    for (int trial = 0; trial < 50; ++trial) {
      std::size_t a = cut(g), b = cut(g);
      if (a > b) std::swap(a, b);
      const partial whole = direct(c.z, c.v, c.dv, 0, c.n);
      partial parts = direct(c.z, c.v, c.dv, 0, a);
      parts.merge(direct(c.z, c.v, c.dv, a, b)).merge(direct(c.z, c.v, c.dv, b, c.n));
      INFO("scale " << scale << " cuts " << a << " " << b);
      REQUIRE(std::isfinite(parts.m));
      REQUIRE(parts.m == whole.m);
      require_same_output(parts, whole, 1e-12);
    }
  }
}

TEST_CASE("merge is commutative and associative", "[partial]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(12);
  for (double scale : {1.0, 1e4}) {
    const auto c = make_case(g, 90, 3, scale);
    const partial p = direct(c.z, c.v, 3, 0, 30), q = direct(c.z, c.v, 3, 30, 60), r = direct(c.z, c.v, 3, 60, 90);
    const partial pq = merged(p, q), qp = merged(q, p);
    REQUIRE(pq.m == qp.m);
    REQUIRE(pq.l == qp.l);  // bitwise: the same two products are added
    REQUIRE(pq.a == qp.a);
    require_same_output(merged(pq, r), merged(p, merged(q, r)), 1e-13);
  }
}

TEST_CASE("extreme scores stay finite and exact", "[partial]") {
  // Scores of +-1e4: e^(1e4) overflows every float type, the log-domain merge does not.
  std::vector<double> z{1e4, -1e4, 1e4 - 1.0, -1e4 + 5.0};
  std::vector<double> v{1.0, 2.0, 3.0, 4.0};
  partial hi = direct(z, v, 1, 0, 1), lo = direct(z, v, 1, 1, 2), hi2 = direct(z, v, 1, 2, 3), lo2 = direct(z, v, 1, 3, 4);
  partial all = merged(merged(lo, hi), merged(lo2, hi2));
  double out;
  all.finalize(&out);
  const double w = std::exp(-1.0);
  REQUIRE(out == Approx((1.0 + 3.0 * w) / (1.0 + w)).epsilon(1e-15));
  partial lows = merged(lo, lo2);
  lows.finalize(&out);
  const double w5 = std::exp(-5.0);  // e^-10000 against e^-9995: relative weights stay exact
  REQUIRE(out == Approx((2.0 * w5 + 4.0) / (w5 + 1.0)).epsilon(1e-15));
}

TEST_CASE("the empty set is the identity of merge", "[partial]") {
  partial empty(2);
  REQUIRE(empty.empty());
  partial p(2);
  p.m = 3.0;
  p.l = 2.0;
  p.a = {4.0, -6.0};
  REQUIRE(merged(p, empty).a == p.a);
  REQUIRE(merged(empty, p).l == p.l);
  partial e2 = merged(empty, empty);
  REQUIRE(e2.empty());
  std::vector<double> out(2, 99.0);
  e2.finalize(out.data());
  REQUIRE(out == std::vector<double>{0.0, 0.0});  // attention over nothing is zero, not NaN
  // A residual of zero mass (log-mass -inf) is empty too; a finite one is (lambda, 1, nu).
  const double nu[2] = {1.0, 2.0};
  REQUIRE(partial::from_log_mass(-INFINITY, nu, 2).empty());
  const partial r = partial::from_log_mass(700.0, nu, 2);
  REQUIRE(r.m == 700.0);
  REQUIRE(r.l == 1.0);
}

TEST_CASE("partial_set merges per head and finalizes every row", "[partial]") {
  floe::partial_set<float> a(2, 3), b(2, 3);
  a.merge(0, 0.f, 1.f, std::vector<float>{1, 2, 3}.data());
  b.merge(0, 0.f, 1.f, std::vector<float>{3, 2, 1}.data());
  b.merge(1, 5.f, 2.f, std::vector<float>{2, 2, 2}.data());
  a.merge(b);
  std::vector<float> out(6, -7.f);
  a.finalize(floe::output_group<float>{out.data(), 2, 3, 0});
  REQUIRE(out == std::vector<float>{2, 2, 2, 1, 1, 1});
}
