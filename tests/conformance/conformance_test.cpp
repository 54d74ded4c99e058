// Shared checks every selector, residual and executor passes: with a full budget an
// estimator equals dense attention; stats count every token once; bad input is rejected
// before any output is written; at a partial budget every executor (each SIMD
// architecture the CPU runs) gives what the scalar reference gives.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "conformance/conformance_checks.hpp"
#include "conformance/conformance_registry.hpp"
#include "exec/simd_test_support.hpp"
#include "support/random_kv.hpp"

namespace {
using floe::conformance::check_against_reference;
using floe::conformance::check_full_budget;

template <floe::KvElement T>
void run_partial(std::uint64_t salt) {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(salt);
  floe::thread_pool pool(2);
  for (const floe::simd_arch arch : floe::testing::runnable_archs()) {
    INFO("arch " << floe::simd_arch_name(arch));
    const floe::exec::simd serial({arch}), split({arch, pool.hook(), 2, 256});  // split-K over 2 threads
    for (auto [n, block] : {std::pair<std::size_t, std::size_t>{300, 0}, {3000, 0}, {2000, 16}}) {
      floe::testing::random_kv<T> data(g, n, 64, 48, 2, block, 2.f);
      INFO("n " << n << " block " << block);
      std::apply(
          [&](const auto&... make) {
            auto one = [&](const auto& mk, const auto& exec) {
              if (data.paged()) check_against_reference(mk, exec, data.paged_view(), g);
              else check_against_reference(mk, exec, data.view(), g);
            };
            ((one(make, serial), one(make, split)), ...);
          },
          floe::conformance::partial_budget_estimators());
    }
  }
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
TEST_CASE("conformance: partial budgets on exec::simd as on the scalar reference (float)", "[conformance]") { run_partial<float>(61); }
TEST_CASE("conformance: partial budgets on exec::simd as on the scalar reference (half)", "[conformance]") { run_partial<floe::half>(62); }
TEST_CASE("conformance: partial budgets on exec::simd as on the scalar reference (bfloat16)", "[conformance]") { run_partial<floe::bfloat16>(63); }
