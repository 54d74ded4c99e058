// Shared checks every selector, residual and executor passes: with a full budget an
// estimator equals dense attention; stats count every token once; bad input is rejected
// before any output is written.
#include <catch2/catch.hpp>
#include <cmath>

#include "conformance/conformance_registry.hpp"
#include "support/random_kv.hpp"

namespace {
// The reference: dense attention on the scalar executor, double accumulation and output.
template <floe::KvView KV>
std::vector<double> dense_reference(const KV& kv, const floe::query_group& q) {
  floe::estimator<floe::select::dense, floe::residual::none> dense;
  std::vector<double> out(q.heads * kv.dv());
  floe::stats s;
  dense.decode(dense.build(kv), kv, q, floe::exec::scalar{}, floe::output_group<double>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

double relative_l2(const float* got, const double* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

template <class Make, class Exec, floe::KvView KV>
void check_full_budget(const Make& make, const Exec& exec, const KV& kv, std::mt19937_64& g) {
  const std::size_t heads = 4;
  const auto qd = floe::testing::random_floats(g, heads * kv.d(), 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, kv.d());
  const auto est = make(kv.n());
  INFO("estimator " << est.name() << " on " << Exec::name);
  const auto state = est.build(kv);
  std::vector<float> out(heads * kv.dv(), std::nanf(""));
  floe::stats s;
  est.decode(state, kv, q, exec, floe::output_group<float>{out.data(), heads, kv.dv(), 0}, s);
  const auto want = dense_reference(kv, q);
  for (std::size_t h = 0; h < heads; ++h)
    REQUIRE(relative_l2(out.data() + h * kv.dv(), want.data() + h * kv.dv(), kv.dv()) <= 1e-6);
  REQUIRE(s.tokens_read == kv.n());
  REQUIRE(s.tokens_total == kv.n());
  REQUIRE(s.value_bytes == kv.n() * kv.dv() * sizeof(typename KV::element_type));
  REQUIRE(s.key_bytes >= kv.n() * kv.d() * sizeof(typename KV::element_type));

  // Bad input: a NaN query is refused and the output keeps its poison.
  auto bad = qd;
  bad[1] = std::nanf("");
  std::vector<float> untouched(heads * kv.dv(), -3.f);
  REQUIRE_THROWS_AS(est.decode(state, kv, floe::query_group::make(bad.data(), heads, kv.d()), exec,
                               floe::output_group<float>{untouched.data(), heads, kv.dv(), 0}, s),
                    floe::invalid_argument);
  REQUIRE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return x == -3.f; }));
}

template <floe::KvElement T>
void run_all(std::uint64_t salt) {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(salt);
  for (auto [n, block] : {std::pair<std::size_t, std::size_t>{1, 0}, {257, 0}, {3000, 0}, {1000, 16}}) {
    floe::testing::random_kv<T> data(g, n, 64, 48, 2, block);
    INFO("n " << n << " block " << block);
    std::apply(
        [&](const auto&... make) {
          std::apply(
              [&](const auto&... exec) {
                auto one = [&](const auto& mk) {
                  ((data.paged() ? check_full_budget(mk, exec, data.paged_view(), g)
                                 : check_full_budget(mk, exec, data.view(), g)),
                   ...);
                };
                (one(make), ...);
              },
              floe::conformance::executors());
        },
        floe::conformance::full_budget_estimators());
  }
}
}  // namespace

TEST_CASE("conformance: full budget equals dense (float)", "[conformance]") { run_all<float>(51); }
TEST_CASE("conformance: full budget equals dense (half)", "[conformance]") { run_all<floe::half>(52); }
TEST_CASE("conformance: full budget equals dense (bfloat16)", "[conformance]") { run_all<floe::bfloat16>(53); }
