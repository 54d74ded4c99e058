// Run-time dispatch of floe::exec::simd: explicit architectures, the FLOE_SIMD_ARCH
// override, and rejected choices.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "floe/exec/simd.hpp"
#include "simd_test_support.hpp"
#include "support/random_kv.hpp"

namespace ft = floe::testing;

namespace {

// Sets FLOE_SIMD_ARCH for the scope of one check, restoring what was there.
class scoped_arch_env {
 public:
  explicit scoped_arch_env(const char* value) {
    if (const char* old = std::getenv("FLOE_SIMD_ARCH")) old_ = old, had_ = true;
    if (value) setenv("FLOE_SIMD_ARCH", value, 1);
    else unsetenv("FLOE_SIMD_ARCH");
  }
  ~scoped_arch_env() {
    if (had_) setenv("FLOE_SIMD_ARCH", old_.c_str(), 1);
    else unsetenv("FLOE_SIMD_ARCH");
  }

 private:
  std::string old_;
  bool had_ = false;
};

std::string argument_of_construction(floe::exec::simd_options opt) {
  try {
    const floe::exec::simd simd(std::move(opt));
  } catch (const floe::invalid_argument& e) {
    return e.argument();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("every compiled architecture this CPU runs can be chosen explicitly", "[exec][simd][dispatch]") {
  INFO("seed " << ft::seed());
  const auto archs = ft::runnable_archs();
  REQUIRE(archs.front() == floe::simd_arch::scalar);  // scalar is always compiled and runnable
  for (auto a : {floe::simd_arch::avx2, floe::simd_arch::avx512}) {
    if (!floe::simd_compiled(a)) WARN(floe::simd_arch_name(a) << " kernels not compiled into floe::simd");
    else if (!floe::cpu_supports(a)) WARN("this CPU cannot run " << floe::simd_arch_name(a));
  }
  for (auto a : archs) CHECK(floe::exec::simd({a}).arch() == a);
  CHECK(floe::best_simd_arch() == archs.back());
  // An architecture that is not compiled in or not supported is refused, naming "arch".
  for (auto a : {floe::simd_arch::avx2, floe::simd_arch::avx512})
    if (std::find(archs.begin(), archs.end(), a) == archs.end()) CHECK(argument_of_construction({a}) == "arch");
}

TEST_CASE("FLOE_SIMD_ARCH forces the architecture of automatic executors", "[exec][simd][dispatch]") {
  INFO("seed " << ft::seed());
  for (auto a : ft::runnable_archs()) {
    const scoped_arch_env env(std::string(floe::simd_arch_name(a)).c_str());
    CHECK(floe::exec::simd().arch() == a);
    CHECK(floe::exec::simd({floe::simd_arch::scalar}).arch() == floe::simd_arch::scalar);  // explicit wins
  }
  {
    const scoped_arch_env env("automatic");
    CHECK(floe::exec::simd().arch() == floe::best_simd_arch());
  }
  {
    const scoped_arch_env env(nullptr);
    CHECK(floe::exec::simd().arch() == floe::best_simd_arch());
  }
  {
    const scoped_arch_env env("sse9");
    CHECK(argument_of_construction({}) == "FLOE_SIMD_ARCH");
  }
}

TEST_CASE("architecture names round-trip and unknown names are rejected", "[exec][simd][dispatch]") {
  INFO("seed " << ft::seed());
  for (auto a : {floe::simd_arch::automatic, floe::simd_arch::scalar, floe::simd_arch::avx2, floe::simd_arch::avx512})
    CHECK(floe::parse_simd_arch(floe::simd_arch_name(a)) == a);
  CHECK_THROWS_AS(floe::parse_simd_arch("AVX512"), floe::invalid_argument);
  CHECK_THROWS_AS(floe::parse_simd_arch(""), floe::invalid_argument);
}

TEST_CASE("simd options are validated", "[exec][simd][dispatch][errors]") {
  INFO("seed " << ft::seed());
  CHECK(argument_of_construction({floe::simd_arch::scalar, {}, 1, 16}) == "parallel_for");
  CHECK(argument_of_construction({floe::simd_arch::scalar, floe::serial_for, 0, 16}) == "concurrency");
  CHECK(argument_of_construction({floe::simd_arch::scalar, floe::serial_for, 1, 0}) == "min_split_tokens");
}

TEST_CASE("simd attend and score reject bad arguments", "[exec][simd][errors]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(2);
  ft::random_kv<floe::half> kv(g, 100, 64, 32);
  auto queries = ft::random_floats(g, 2 * 64);
  const auto q = floe::query_group::make(queries.data(), 2, 64);
  const floe::exec::simd simd;
  auto argument_of = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const floe::invalid_argument& e) {
      return e.argument();
    }
    return "(no error)";
  };
  const std::vector<floe::token_range> all{{0, 100}}, past{{0, 101}}, reversed{{10, 5}}, overlapping{{0, 10}, {5, 20}};
  floe::partial_set<float> p(2, 32), wrong_heads(3, 32), wrong_dv(2, 64);
  CHECK(argument_of([&] { simd.attend(kv.view(), q, past, p); }) == "selection");
  CHECK(argument_of([&] { simd.attend(kv.view(), q, reversed, p); }) == "selection");
  CHECK(argument_of([&] { simd.attend(kv.view(), q, overlapping, p); }) == "selection");
  CHECK(argument_of([&] { simd.attend(kv.view(), q, all, wrong_heads); }) == "partial.heads");
  CHECK(argument_of([&] { simd.attend(kv.view(), q, all, wrong_dv); }) == "partial.dv");
  auto q_wrong_d = q;
  q_wrong_d.d = 32;
  CHECK(argument_of([&] { simd.attend(kv.view(), q_wrong_d, all, p); }) == "query.d");
  CHECK(p.empty(0));
  CHECK(p.empty(1));
  queries[70] = std::nanf("");
  CHECK(argument_of([&] { simd.attend(kv.view(), q, all, p); }) == "query");
  queries[70] = 0.f;
  std::vector<float> z(200);
  CHECK(argument_of([&] { simd.score(kv.view(), q, 2, {0, 10}, z.data()); }) == "head");
  CHECK(argument_of([&] { simd.score(kv.view(), q, 0, {90, 101}, z.data()); }) == "range");
  CHECK(argument_of([&] { simd.score(kv.view(), q, 0, {0, 10}, nullptr); }) == "z");
  queries[70] = std::nanf("");  // the query is checked first, as attend checks it
  CHECK(argument_of([&] { simd.score(kv.view(), q, 2, {0, 10}, z.data()); }) == "query");
  CHECK(argument_of([&] { simd.score_group(kv.view(), q, {0, 20}, z.data(), 10); }) == "query");
  queries[70] = 0.f;
}
