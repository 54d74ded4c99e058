// The synthetic cache: deterministic per seed, heads independent, and the properties the
// generator promises (docs/evaluation.md): entropy from < 1 nat to > 7 nats and a sink
// mass from ~0 to over half of the mass at N = 32K, massive key channels, recency in
// local heads, needles that retrieval queries find.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "floe/testing/synthetic_kv.hpp"
#include "support/random_kv.hpp"

using namespace floe;
using floe::testing::synthetic_kv_config;

namespace {

// Softmax weights of one query over all keys of a head (float keys, double sums).
std::vector<double> attention(const testing::synthetic_head& h, const synthetic_kv_config& c, index_t j, index_t t) {
  const float* q = h.queries.data() + (j * c.queries + t) * c.d;
  const double s = 1.0 / std::sqrt(static_cast<double>(c.d));
  std::vector<double> w(c.n);
  double top = -1e300;
  for (index_t i = 0; i < c.n; ++i) {
    const float* k = h.keys.data() + i * c.d;
    float dot = 0;
    for (index_t x = 0; x < c.d; ++x) dot += q[x] * k[x];
    w[i] = s * dot;
    top = std::max(top, w[i]);
  }
  double sum = 0;
  for (auto& x : w) sum += (x = std::exp(x - top));
  for (auto& x : w) x /= sum;
  return w;
}

double entropy(const std::vector<double>& p) {
  double h = 0;
  for (double x : p)
    if (x > 0) h -= x * std::log(x);
  return h;
}

}  // namespace

TEST_CASE("synthetic_kv: the same seed gives the same cache, another seed another", "[eval][synthetic]") {
  synthetic_kv_config c;
  c.n = 256;
  c.kv_heads = 2;
  c.d = 32;
  c.dv = 16;
  c.queries = 2;
  const auto a = testing::generate_synthetic_head(c, 1);
  const auto b = testing::generate_synthetic_head(c, 1);
  CHECK(a.keys == b.keys);
  CHECK(a.values == b.values);
  CHECK(a.queries == b.queries);
  c.seed = 2;
  CHECK(testing::generate_synthetic_head(c, 1).keys != a.keys);
  c.seed = 1;
  CHECK(testing::generate_synthetic_head(c, 0).keys != a.keys);

  // The dump holds head h exactly as generate_synthetic_head makes it, in any thread order.
  const auto dump = testing::make_synthetic_kv<float>(c);
  const auto& kv = std::get<io::kv_arrays<float>>(dump.kv);
  CHECK(std::equal(a.keys.begin(), a.keys.end(), kv.keys.begin() + 256 * 32));
  CHECK(std::equal(a.values.begin(), a.values.end(), kv.values.begin() + 256 * 16));
  CHECK(std::equal(a.queries.begin(), a.queries.end(), dump.queries.begin() + 4 * 2 * 32));
  CHECK(dump.q_heads == 8);
  CHECK(dump.scale == Approx(1 / std::sqrt(32.f)));
}

TEST_CASE("synthetic_kv: bad configurations are rejected naming the field", "[eval][synthetic]") {
  synthetic_kv_config c;
  c.n = 10;
  CHECK_THROWS_WITH(testing::generate_synthetic_head(c, 0), Catch::Contains("'n'"));
  c = {};
  c.d = 33;
  CHECK_THROWS_WITH(testing::generate_synthetic_head(c, 0), Catch::Contains("'d'"));
  c = {};
  c.n = 64;
  CHECK_THROWS_WITH(testing::generate_synthetic_head(c, 8), Catch::Contains("'kv_head'"));
  CHECK_THROWS_WITH(testing::make_synthetic_kv(c, "f64"), Catch::Contains("'dtype'"));
}

TEST_CASE("synthetic_kv: at N = 32K entropy spans < 1 to > 7 nats and sink mass ~0 to over half", "[eval][synthetic]") {
  for (std::uint64_t seed : {1u, 2u}) {
    INFO("generator seed " << seed);
    synthetic_kv_config c;  // N = 32768, d = 128; 4 KV heads x GQA 4 cover all five roles
    c.seed = seed;
    c.kv_heads = 4;
    c.queries = 3;
    std::vector<double> entropies, sinks;
    for (index_t h = 0; h < c.kv_heads; ++h) {
      const auto head = testing::generate_synthetic_head(c, h);
      for (index_t j = 0; j < c.group; ++j)
        for (index_t t = 0; t < c.queries; ++t) {
          const auto p = attention(head, c, j, t);
          entropies.push_back(entropy(p));
          sinks.push_back(p[0]);
        }
    }
    std::sort(entropies.begin(), entropies.end());
    std::sort(sinks.begin(), sinks.end());
    INFO("entropy min " << entropies.front() << " median " << entropies[entropies.size() / 2] << " max "
                        << entropies.back() << "; sink median " << sinks[sinks.size() / 2] << " max " << sinks.back());
    const auto share = [&](auto pred) {
      return static_cast<double>(std::count_if(entropies.begin(), entropies.end(), pred)) / entropies.size();
    };
    CHECK(entropies.front() < 1.0);
    CHECK(entropies.back() > 7.0);
    CHECK(entropies.back() < std::log(32768.0));
    CHECK(share([](double e) { return e < 1; }) >= 0.05);
    CHECK(share([](double e) { return e < 1; }) <= 0.35);
    CHECK(share([](double e) { return e > 7; }) >= 0.08);
    CHECK(share([](double e) { return e >= 3 && e <= 7; }) >= 0.2);  // not only the extremes
    const double strong_sinks =
        static_cast<double>(std::count_if(sinks.begin(), sinks.end(), [](double m) { return m > 0.1; })) / sinks.size();
    INFO("share of query-heads with sink mass > 0.1: " << strong_sinks);
    CHECK(sinks.front() < 0.01);  // some heads ignore the sink
    CHECK(sinks.back() > 0.5);    // some give it most of their mass
    CHECK(strong_sinks >= 0.1);
    CHECK(sinks[sinks.size() / 2] < 0.5);
  }
}

TEST_CASE("synthetic_kv: massive channels, recency, needles", "[eval][synthetic]") {
  synthetic_kv_config c;
  c.n = 8192;
  c.kv_heads = 2;
  c.group = 5;  // one query head of every role per KV head
  c.queries = 6;
  const testing::synthetic_bands bands(c.d);
  const auto head = testing::generate_synthetic_head(c, 0);

  // Massive channels: the RMS of the two massive RoPE pairs dwarfs the median pair's.
  std::vector<double> pair_rms(c.d / 2);
  for (index_t i = 0; i < c.n; ++i)
    for (index_t j = 0; j < c.d / 2; ++j) {
      const double x = head.keys[i * c.d + j], y = head.keys[i * c.d + j + c.d / 2];
      pair_rms[j] += (x * x + y * y) / static_cast<double>(c.n);
    }
  std::vector<double> sorted = pair_rms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  CHECK(pair_rms[bands.massive_a] > 50 * median);
  CHECK(pair_rms[bands.massive_b] > 50 * median);
  CHECK(sorted[sorted.size() - 3] < 10 * median);  // and only those two

  // Recency: the local head (role 1) weighs the last 1% of tokens far above a block as long in the middle.
  REQUIRE(testing::role_of(1) == testing::head_role::local);
  for (index_t t = 0; t < c.queries; ++t) {
    const auto p = attention(head, c, 1, t);
    double recent = 0, middle = 0;
    for (index_t i = c.n - c.n / 100; i < c.n; ++i) recent += p[i];
    for (index_t i = c.n / 2; i < c.n / 2 + c.n / 100; ++i) middle += p[i];
    CHECK(recent > 20 * middle);
  }

  // Needles: a sharp retrieval query (role 0) peaks on a needle, or on the sink when it looks up none.
  REQUIRE(testing::role_of(0) == testing::head_role::retrieval);
  index_t on_needle = 0;
  for (index_t t = 0; t < c.queries; ++t) {
    const auto p = attention(head, c, 0, t);
    if (entropy(p) > 1) continue;
    const auto peak = static_cast<index_t>(std::max_element(p.begin(), p.end()) - p.begin());
    const bool needle =
        std::find(head.needle_positions.begin(), head.needle_positions.end(), peak) != head.needle_positions.end();
    CHECK((needle || peak == 0));
    on_needle += needle;
  }
  CHECK(on_needle > 0);
}
