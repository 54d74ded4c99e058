// select::oracle_topk: the exact top-k by attention weight summed over the GQA group,
// honest about scanning every key, and dense at a full budget.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <numeric>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/oracle_topk.hpp"
#include "floe/select/streaming.hpp"
#include "support/random_kv.hpp"

using namespace floe;

namespace {

// Brute force: softmax weights per head in double, summed over the group.
template <KvView KV>
std::vector<double> group_weight(const KV& kv, const query_group& q) {
  std::vector<double> total(kv.n(), 0.0);
  for (index_t h = 0; h < q.heads; ++h) {
    std::vector<double> z(kv.n());
    for (index_t i = 0; i < kv.n(); ++i) {
      double dot = 0;
      for (index_t t = 0; t < kv.d(); ++t) dot += static_cast<double>(q.row(h)[t]) * to_float(kv.key_row(i)[t]);
      z[i] = q.scale * dot;
    }
    const double top = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double& x : z) sum += (x = std::exp(x - top));
    for (index_t i = 0; i < kv.n(); ++i) total[i] += z[i] / sum;
  }
  return total;
}

std::vector<index_t> tokens_of(const selection& s) {
  std::vector<index_t> out;
  for (const auto& r : s.ranges)
    for (index_t i = r.begin; i < r.end; ++i) out.push_back(i);
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("oracle_topk: selects the k tokens of largest group weight and counts every key", "[eval][oracle]",
                   float, half, bfloat16) {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(11);
  for (index_t heads : {1, 3})
    for (bool paged : {false, true}) {
      const index_t n = 301, d = 24, dv = 8;
      floe::testing::random_kv<TestType> data(g, n, d, dv, paged ? 3 : 0, paged ? 16 : 0, 2.f);
      const auto queries = floe::testing::random_floats(g, heads * d, 1.5f);
      const query_group q = query_group::make(queries.data(), heads, d);
      const auto run = [&](const auto& kv) {
        const auto weight = group_weight(kv, q);
        for (index_t k : {index_t{0}, index_t{1}, index_t{17}, n - 1}) {
          INFO("heads " << heads << " paged " << paged << " k " << k);
          const select::oracle_topk oracle{k};
          selection sel;
          stats st;
          oracle.select(oracle.build(kv), kv, q, exec::scalar{}, sel, st);
          const auto chosen = tokens_of(sel);
          REQUIRE(chosen.size() == k);
          CHECK(std::is_sorted(chosen.begin(), chosen.end()));
          CHECK(sel.keys_counted);
          CHECK(st.key_bytes == n * d * sizeof(TestType));
          // Every chosen token weighs at least as much as every token left out (up to float rounding).
          std::vector<bool> in(n, false);
          for (index_t i : chosen) in[i] = true;
          double least_in = 1e300, most_out = 0;
          for (index_t i = 0; i < n; ++i) {
            if (in[i]) least_in = std::min(least_in, weight[i]);
            else most_out = std::max(most_out, weight[i]);
          }
          if (k > 0) CHECK(least_in >= most_out * (1 - 1e-5));
        }
        // A budget covering the cache attends everything and scans nothing extra.
        selection sel;
        stats st;
        select::oracle_topk{n}.select({}, kv, q, exec::scalar{}, sel, st);
        CHECK(sel.count() == n);
        CHECK_FALSE(sel.keys_counted);
        CHECK(st.key_bytes == 0);
      };
      if (paged) run(data.paged_view());
      else run(data.view());
    }
}

TEMPLATE_TEST_CASE("oracle_topk: a NaN or Inf key is refused by token, never ranked", "[eval][oracle]", float, half) {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(13);
  const index_t n = 300, d = 16, dv = 8, heads = 2;
  auto queries = floe::testing::random_floats(g, heads * d);
  for (index_t h = 0; h < heads; ++h) queries[h * d + 5] = 1.f;  // +Inf in element 5 scores +Inf
  const query_group q = query_group::make(queries.data(), heads, d);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    INFO("bad " << bad);
    floe::testing::random_kv<TestType> data(g, n, d, dv);
    data.keys[137 * data.key_stride + 5] = from_float<TestType>(bad);
    const auto kv = data.view();
    const select::oracle_topk oracle{20};
    auto refused = [&](const auto& exec) {
      INFO("executor " << exec.name);
      selection sel;
      stats st;
      try {
        oracle.select(oracle.build(kv), kv, q, exec, sel, st);
        FAIL("nothing thrown");
      } catch (const invalid_argument& e) {
        CHECK(e.argument() == std::string("kv"));
        CHECK(std::string(e.what()).find("key 137 element 5 is NaN or Inf") != std::string::npos);
      }
      CHECK(sel.count() == 0);
    };
    refused(exec::scalar{});
    refused(exec::simd{});
  }
}

TEST_CASE("oracle_topk: at k = n it is dense, and below it its stats count all keys and k values", "[eval][oracle]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(12);
  const index_t n = 500, d = 32, dv = 16, heads = 4;
  floe::testing::random_kv<half> data(g, n, d, dv);
  const auto queries = floe::testing::random_floats(g, heads * d);
  const query_group q = query_group::make(queries.data(), heads, d);
  const auto kv = data.view();

  std::vector<double> dense_out(heads * dv), oracle_out(heads * dv);
  const estimator<select::dense, residual::none> dense;
  stats ds;
  dense.decode(dense.build(kv), kv, q, exec::scalar{}, output_group<double>{dense_out.data(), heads, dv}, ds);
  const estimator<select::oracle_topk, residual::none> full({n}, {});
  stats fs;
  full.decode(full.build(kv), kv, q, exec::scalar{}, output_group<double>{oracle_out.data(), heads, dv}, fs);
  for (index_t i = 0; i < dense_out.size(); ++i) CHECK(oracle_out[i] == Approx(dense_out[i]).epsilon(1e-12).margin(1e-15));
  CHECK(fs.bytes_read() == ds.bytes_read());

  const index_t k = 50;
  const estimator<select::oracle_topk, residual::none> top({k}, {});
  stats ts;
  top.decode(top.build(kv), kv, q, exec::scalar{}, output_group<double>{oracle_out.data(), heads, dv}, ts);
  CHECK(ts.tokens_read == k);
  CHECK(ts.key_bytes == n * d * 2);
  CHECK(ts.value_bytes == k * dv * 2);

  // With one query head it keeps at least the weight of any other k tokens, e.g. streaming's.
  const query_group one = query_group::make(queries.data(), 1, d);
  const auto w = group_weight(kv, one);
  const auto mass = [&](const selection& s) {
    double m = 0;
    for (index_t i : tokens_of(s)) m += w[i];
    return m;
  };
  selection o, s;
  stats ignored;
  select::oracle_topk{k}.select({}, kv, one, exec::scalar{}, o, ignored);
  select::streaming::with_budget(k).select({}, kv, one, exec::scalar{}, s, ignored);
  CHECK(mass(o) >= mass(s));
}
