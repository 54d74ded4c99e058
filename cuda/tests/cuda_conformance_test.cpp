// The conformance suite on floe::exec::cuda: every estimator at a full budget equals
// dense on the scalar reference, and at partial budgets gives what the scalar reference
// gives. The caches sit in pinned host memory, which both the device kernels and the
// host-side selectors and summaries read.
#include <catch2/catch.hpp>

#include "conformance/conformance_checks.hpp"
#include "conformance/conformance_registry.hpp"
#include "cuda_test_support.hpp"
#include "floe/exec/cuda.hpp"

namespace {

template <floe::KvElement T, class Factories, class Check>
void each_case(std::uint64_t salt, std::initializer_list<std::pair<std::size_t, std::size_t>> shapes, float key_sigma,
               const Factories& factories, Check&& check) {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(salt);
  const floe::exec::cuda ex;
  for (auto [n, block] : shapes) {
    const floe::testing::random_kv<T> host(g, n, 64, 48, 2, block, key_sigma);
    const floe::testing::cuda_kv<T> data(host, floe::testing::cuda_array<T>::pinned_host);
    INFO("n " << n << " block " << block);
    std::apply(
        [&](const auto&... make) {
          auto one = [&](const auto& mk) {
            if (block) check(mk, ex, data.paged_view(), g);
            else check(mk, ex, data.view(), g);
          };
          (one(make), ...);
        },
        factories);
  }
}

template <floe::KvElement T>
void full(std::uint64_t salt) {
  each_case<T>(salt, {{1, 0}, {257, 0}, {3000, 0}, {1000, 16}}, 1.f, floe::conformance::full_budget_estimators(),
               [](const auto& mk, const auto& ex, const auto& kv, auto& g) { floe::conformance::check_full_budget(mk, ex, kv, g); });
}
template <floe::KvElement T>
void partial(std::uint64_t salt) {
  each_case<T>(salt, {{300, 0}, {3000, 0}, {2000, 16}}, 2.f, floe::conformance::partial_budget_estimators(),
               [](const auto& mk, const auto& ex, const auto& kv, auto& g) { floe::conformance::check_against_reference(mk, ex, kv, g); });
}

}  // namespace

TEST_CASE("cuda conformance: full budget equals dense (float)", "[cuda][conformance]") { full<float>(51); }
TEST_CASE("cuda conformance: full budget equals dense (half)", "[cuda][conformance]") { full<floe::half>(52); }
TEST_CASE("cuda conformance: full budget equals dense (bfloat16)", "[cuda][conformance]") { full<floe::bfloat16>(53); }
TEST_CASE("cuda conformance: partial budgets as on the scalar reference (float)", "[cuda][conformance]") { partial<float>(61); }
TEST_CASE("cuda conformance: partial budgets as on the scalar reference (half)", "[cuda][conformance]") { partial<floe::half>(62); }
TEST_CASE("cuda conformance: partial budgets as on the scalar reference (bfloat16)", "[cuda][conformance]") { partial<floe::bfloat16>(63); }
