// Every bad input gets floe::invalid_argument naming the argument, and nothing is written.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "floe/floe.hpp"
#include "support/random_kv.hpp"

namespace {
template <class F>
std::string thrown_argument(F&& f) {
  try {
    f();
  } catch (const floe::invalid_argument& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(e.argument()) != std::string::npos);
    return e.argument();
  }
  return "<nothing thrown>";
}

constexpr float poison = -12345.f;

struct fixture {
  std::mt19937_64 g = floe::testing::rng(41);
  floe::testing::random_kv<float> data{g, 64, 16, 8};
  std::vector<float> q = floe::testing::random_floats(g, 2 * 16);
  std::vector<float> out = std::vector<float>(2 * 8, poison);
  floe::estimator<floe::select::dense, floe::residual::none> est;

  std::string decode(floe::query_group group, floe::output_group<float> o) {
    auto kv = data.view();
    auto st = est.build(kv);
    floe::stats s;
    return thrown_argument([&] { est.decode(st, kv, group, floe::exec::scalar{}, o, s); });
  }
  floe::query_group group() { return floe::query_group::make(q.data(), 2, 16); }
  floe::output_group<float> output() { return {out.data(), 2, 8, 0}; }
  bool untouched() const {
    return std::all_of(out.begin(), out.end(), [](float x) { return x == poison; });
  }
};
}  // namespace

TEST_CASE("bad input: query dimension differs from the key dimension", "[bad-input]") {
  INFO("seed " << floe::testing::seed());
  fixture f;
  auto q = f.group();
  q.d = 15;
  REQUIRE(f.decode(q, f.output()) == "query.d");
  REQUIRE(f.untouched());
}

TEST_CASE("bad input: output dimension differs from the value dimension", "[bad-input]") {
  fixture f;
  auto o = f.output();
  o.dv = 16;
  REQUIRE(f.decode(f.group(), o) == "output.dv");
  REQUIRE(f.untouched());
}

TEST_CASE("bad input: NaN or Inf in the query", "[bad-input]") {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    fixture f;
    f.q[20] = bad;
    REQUIRE(f.decode(f.group(), f.output()) == "query");
    REQUIRE(f.untouched());
  }
}

TEST_CASE("bad input: a NaN or Inf query element is named wherever it sits", "[bad-input]") {
  // validate_query counts non-finite elements in blocks of 8, then a tail: every position of
  // both, in every head.
  for (floe::index_t d : {13, 16})
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()})
      for (floe::index_t at = 0; at < 3 * d; ++at) {
        std::vector<float> q(3 * d, 1.5f);
        q[at] = bad;
        const auto group = floe::query_group::make(q.data(), 3, d);
        std::string what;
        try {
          floe::validate_query(group, d);
        } catch (const floe::invalid_argument& e) {
          REQUIRE(e.argument() == "query");
          what = e.what();
        }
        INFO("d " << d << ", element " << at);
        const std::string named = "element [" + std::to_string(at / d) + ", " + std::to_string(at % d) + "]";
        REQUIRE(what.find(named) != std::string::npos);
      }
  std::vector<float> finite(2 * 13, std::numeric_limits<float>::max());
  finite[5] = -std::numeric_limits<float>::denorm_min();
  REQUIRE_NOTHROW(floe::validate_query(floe::query_group::make(finite.data(), 2, 13), 13));
}

TEST_CASE("bad input: scale zero, negative or non-finite", "[bad-input]") {
  for (float bad : {0.f, -1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    fixture f;
    auto q = f.group();
    q.scale = bad;
    REQUIRE(f.decode(q, f.output()) == "scale");
    REQUIRE(f.untouched());
  }
}

TEST_CASE("bad input: empty cache, null data, short strides", "[bad-input]") {
  std::vector<float> k(64), v(64);
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(k.data(), v.data(), 0, 8, 8); }) == "n");
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(nullptr, v.data(), 4, 8, 8); }) == "keys");
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(k.data(), nullptr, 4, 8, 8); }) == "values");
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(k.data(), v.data(), 4, 8, 8, 7); }) == "keys.row_stride");
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(k.data(), v.data(), 4, 8, 8, 8, 4); }) == "values.row_stride");
  REQUIRE(thrown_argument([&] { floe::kv_view<float>(k.data(), v.data(), 4, 0, 8); }) == "d");
}

TEST_CASE("bad input: block table entries outside the pool, or too few", "[bad-input]") {
  std::vector<floe::half> k(4 * 4 * 8), v(4 * 4 * 8);  // a pool of 4 blocks of 4 tokens
  std::vector<std::int32_t> table{0, 3, 4};
  auto make = [&](std::size_t n) {
    return floe::paged_kv_view<floe::half>(k.data(), v.data(), 4, 4, table, n, 8, 8);
  };
  REQUIRE(thrown_argument([&] { make(12); }) == "block_table");  // entry 2 = 4 is past the pool
  table[2] = -1;
  REQUIRE(thrown_argument([&] { make(12); }) == "block_table");
  REQUIRE(thrown_argument([&] { make(13); }) == "block_table");  // needs 4 entries
  REQUIRE(thrown_argument([&] { make(8); }) == "<nothing thrown>");  // only the first two are used
  REQUIRE(thrown_argument([&] { floe::paged_kv_view<floe::half>(k.data(), v.data(), 4, 0, table, 8, 8, 8); }) ==
          "block_size");
}

TEST_CASE("bad input: budget larger than the cache or out of range", "[bad-input]") {
  REQUIRE(thrown_argument([] { floe::budget::tokens(101).resolve(100); }) == "budget");
  REQUIRE(thrown_argument([] { floe::budget::fraction(1.5).resolve(100); }) == "budget");
  REQUIRE(thrown_argument([] { floe::budget::fraction(-0.1).resolve(100); }) == "budget");
  REQUIRE(thrown_argument([] { floe::budget::top_p(0.0).resolve(100); }) == "budget");
  REQUIRE(thrown_argument([] { floe::budget::top_p(0.9, 10, 5).resolve(100); }) == "budget");
  REQUIRE(floe::budget::tokens(100).resolve(100) == 100);
  REQUIRE(floe::budget::fraction(0.05).resolve(100) == 5);
}

TEST_CASE("bad input: selections past the cache are rejected before any read", "[bad-input]") {
  REQUIRE(thrown_argument([] { floe::validate_ranges({{0, 5}, {4, 9}}, 10); }) == "selection");
  REQUIRE(thrown_argument([] { floe::validate_ranges({{0, 11}}, 10); }) == "selection");
  REQUIRE(thrown_argument([] { floe::validate_ranges({{3, 3}}, 10); }) == "selection");
  REQUIRE(thrown_argument([] { floe::validate_ranges({{0, 5}, {5, 10}}, 10); }) == "<nothing thrown>");
  const std::vector<floe::token_range> ranges{{1, 3}, {5, 9}};
  REQUIRE(floe::checked_token_count(ranges, 9) == 6);
  REQUIRE(thrown_argument([&] { floe::checked_token_count(ranges, 8); }) == "selection");
}

TEST_CASE("bad input: batch with the wrong number of KV heads or states", "[bad-input]") {
  INFO("seed " << floe::testing::seed());
  fixture f;
  const auto kv = f.data.view();
  floe::estimator<floe::select::dense, floe::residual::none> est;
  std::vector<decltype(est)::state> states(2, est.build(kv));
  std::vector<floe::kv_view<float>> heads{kv};
  std::vector<floe::sequence<floe::kv_view<float>>> batch{{heads, f.q.data(), f.out.data()}};
  const float scale = 0.25f;
  REQUIRE(thrown_argument([&] {
            floe::decode_batch(est, std::span<const decltype(est)::state>(states), std::span(std::as_const(batch)),
                               floe::gqa_shape{2, 1}, scale, floe::exec::scalar{});
          }) == "states");
  REQUIRE(thrown_argument([&] {
            floe::decode_batch(est, std::span<const decltype(est)::state>(states), std::span(std::as_const(batch)),
                               floe::gqa_shape{3, 2}, scale, floe::exec::scalar{});
          }) == "q_heads");
  REQUIRE(f.untouched());
}
