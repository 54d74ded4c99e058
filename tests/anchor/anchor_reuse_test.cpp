// select::anchor_reuse and its plan (Kascade): the anchors' dynamic programme against brute
// force, anchor layers equal to oracle_topk, reuse layers attending their mapped anchor
// head's set, the calibration recovering a known layer/head structure, and bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/anchor_calibration.hpp"
#include "floe/select/anchor_reuse.hpp"
#include "floe/select/oracle_topk.hpp"
#include "support/random_kv.hpp"
#include "support/reference.hpp"

using namespace floe;
using select::anchor_plan;

namespace {

// The best total over every anchor set of the given size that contains layer 0.
double brute_force_best(const std::vector<double>& sim, index_t layers, index_t count) {
  double best = -1e300;
  for (unsigned mask = 1; mask < (1u << layers); mask += 2) {  // layer 0 always in
    if (static_cast<index_t>(__builtin_popcount(mask)) != count) continue;
    double total = 0;
    for (index_t l = 0, a = 0; l < layers; ++l) {
      if (mask >> l & 1u) a = l;
      total += sim[a * layers + l];
    }
    best = std::max(best, total);
  }
  return best;
}

double total_of(const std::vector<double>& sim, index_t layers, const std::vector<index_t>& anchors) {
  const auto plan = anchor_plan::from_anchors(layers, 1, anchors);
  double total = 0;
  for (index_t l = 0; l < layers; ++l) total += sim[plan.anchor_of[l] * layers + l];
  return total;
}

}  // namespace

TEST_CASE("choose_anchors: the dynamic programme finds the best anchor set (brute force)", "[anchor]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(31);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 40; ++trial) {
    const index_t layers = 1 + trial % 9;
    std::vector<double> sim(layers * layers);
    for (auto& s : sim) s = u(g);
    for (index_t count = 1; count <= layers; ++count) {
      INFO("layers " << layers << " count " << count);
      const auto anchors = select::choose_anchors(sim, layers, count);
      REQUIRE(anchors.size() == count);
      CHECK(anchors.front() == 0);
      CHECK(std::is_sorted(anchors.begin(), anchors.end()));
      CHECK(total_of(sim, layers, anchors) == Approx(brute_force_best(sim, layers, count)).epsilon(1e-12));
    }
  }
  CHECK_THROWS_WITH(select::choose_anchors(std::vector<double>(9, 0.0), 3, 0), Catch::Contains("count"));
  CHECK_THROWS_WITH(select::choose_anchors(std::vector<double>(9, 0.0), 3, 4), Catch::Contains("count"));
  CHECK_THROWS_WITH(select::choose_anchors(std::vector<double>(8, 0.0), 3, 1), Catch::Contains("similarity"));
  std::vector<double> nan(9, 0.0);
  nan[4] = std::nan("");
  CHECK_THROWS_WITH(select::choose_anchors(nan, 3, 2), Catch::Contains("similarity"));
}

TEST_CASE("anchor_plan: from_anchors and validate refuse inconsistent plans by name", "[anchor]") {
  const auto p = anchor_plan::from_anchors(5, 2, {0, 3});
  CHECK(p.anchor_of == std::vector<index_t>{0, 0, 0, 3, 3});
  CHECK(p.anchors() == std::vector<index_t>{0, 3});
  CHECK_NOTHROW(p.validate());
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 2, {1, 3}), Catch::Contains("anchors"));
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 2, {0, 3, 3}), Catch::Contains("anchors"));
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 2, {0, 5}), Catch::Contains("anchors"));
  CHECK_THROWS_WITH(anchor_plan::from_anchors(0, 2, {0}), Catch::Contains("plan"));
  auto bad = p;
  bad.anchor_of[2] = 4;  // a later layer
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("plan") && Catch::Contains("runs after"));
  bad = p;
  bad.anchor_of[4] = 1;  // not an anchor
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("not an anchor"));
  bad = p;
  bad.head_of[2 * 2 + 1] = 2;  // no such head
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("reads head 2"));
  bad = p;
  bad.head_of[3 * 2 + 0] = 1;  // an anchor reading another head's set
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("own set"));
  bad = p;
  bad.head_of.pop_back();
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("head_of"));
  CHECK_THROWS_WITH(select::anchor_store(bad), Catch::Contains("head_of"));
}

TEMPLATE_TEST_CASE("anchor_reuse: anchors attend oracle_topk's set, reuse layers their mapped head's set", "[anchor]",
                   float, half, bfloat16) {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(32);
  const index_t layers = 4, heads = 2, n = 257, d = 32, dv = 16, group = 3, k = 23;
  auto plan = anchor_plan::from_anchors(layers, heads, {0, 2});
  plan.head_of[1 * heads + 0] = 1;  // layer 1 head 0 reads anchor 0's head 1
  plan.head_of[1 * heads + 1] = 1;
  plan.head_of[3 * heads + 0] = 1;
  plan.head_of[3 * heads + 1] = 0;
  const select::anchor_reuse proto{k, std::make_shared<select::anchor_store>(plan)};
  std::vector<floe::testing::random_kv<TestType>> caches;
  std::vector<std::vector<float>> queries;
  for (index_t s = 0; s < layers * heads; ++s) {
    caches.emplace_back(g, n, d, dv, s % 2 ? 5 : 0, s % 3 == 1 ? 16 : 0, 2.f);
    queries.push_back(floe::testing::random_floats(g, group * d, 1.5f));
  }
  for (int step = 0; step < 3; ++step) {  // the store is refilled every step
    std::vector<std::vector<token_range>> chosen(layers * heads);
    for (index_t l = 0; l < layers; ++l)
      for (index_t h = 0; h < heads; ++h) {
        INFO("step " << step << " layer " << l << " head " << h);
        const index_t s = l * heads + h;
        const auto q = query_group::make(queries[s].data(), group, d);
        const auto sel_of = [&](const auto& kv) {
          const auto me = proto.at(l, h);
          selection sel;
          stats st;
          me.select(me.build(kv), kv, q, exec::scalar{}, sel, st);
          if (plan.is_anchor(l)) {
            selection want;
            stats ost;
            const select::oracle_topk oracle{k};
            oracle.select({}, kv, q, exec::scalar{}, want, ost);
            CHECK(sel.ranges == want.ranges);
            CHECK(sel.keys_counted);
            CHECK(st.key_bytes == ost.key_bytes);
          } else {
            CHECK(sel.ranges == chosen[plan.anchor_of[l] * heads + plan.source_head(l, h)]);
            CHECK_FALSE(sel.keys_counted);
            CHECK(st.bytes_read() == 0);  // reuse scores nothing
          }
          CHECK(sel.count() == k);
          return sel.ranges;
        };
        chosen[s] = caches[s].paged() ? sel_of(caches[s].paged_view()) : sel_of(caches[s].view());
      }
    for (auto& qs : queries) qs = floe::testing::random_floats(g, group * d, 1.5f);
  }
}

TEST_CASE("anchor_reuse: a full budget is dense in every layer and a reuse layer's output attends its anchor's set",
          "[anchor]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(33);
  const index_t n = 300, d = 64, dv = 64, group = 4;
  floe::testing::random_kv<half> anchor_kv(g, n, d, dv), reuse_kv(g, n, d, dv);
  const auto qa = floe::testing::random_floats(g, group * d), qr = floe::testing::random_floats(g, group * d);
  const auto q0 = query_group::make(qa.data(), group, d), q1 = query_group::make(qr.data(), group, d);
  const auto plan = anchor_plan::from_anchors(2, 1, {0});
  for (index_t k : {n, index_t{40}}) {
    INFO("k " << k);
    const select::anchor_reuse proto{k, std::make_shared<select::anchor_store>(plan)};
    const estimator<select::anchor_reuse, residual::none> e0(proto.at(0, 0), {}), e1(proto.at(1, 0), {});
    std::vector<double> out0(group * dv), out1(group * dv);
    stats s0, s1;
    e0.decode(e0.build(anchor_kv.view()), anchor_kv.view(), q0, exec::scalar{},
              output_group<double>{out0.data(), group, dv}, s0);
    e1.decode(e1.build(reuse_kv.view()), reuse_kv.view(), q1, exec::scalar{},
              output_group<double>{out1.data(), group, dv}, s1);
    if (k == n) {
      CHECK(floe::testing::worst_head_error(out0, floe::testing::dense_reference(anchor_kv.view(), q0), group, dv) <
            1e-12);
      CHECK(floe::testing::worst_head_error(out1, floe::testing::dense_reference(reuse_kv.view(), q1), group, dv) <
            1e-12);
      continue;
    }
    // Layer 1's output is dense attention over the 40 tokens layer 0 chose, in layer 1's cache.
    selection chosen;
    stats unused;
    select::oracle_topk{k}.select({}, anchor_kv.view(), q0, exec::scalar{}, chosen, unused);
    std::vector<half> keys, values;
    for (const auto& r : chosen.ranges)
      for (index_t i = r.begin; i < r.end; ++i) {
        keys.insert(keys.end(), reuse_kv.keys.begin() + i * d, reuse_kv.keys.begin() + (i + 1) * d);
        values.insert(values.end(), reuse_kv.values.begin() + i * dv, reuse_kv.values.begin() + (i + 1) * dv);
      }
    const kv_view<half> subset{keys.data(), values.data(), k, d, dv};
    CHECK(floe::testing::worst_head_error(out1, floe::testing::dense_reference(subset, q1), group, dv) < 1e-12);
    CHECK(s1.tokens_read == k);
    CHECK(s1.key_bytes == k * d * 2);  // only the reused set's keys
    CHECK(s0.key_bytes == n * d * 2);  // the anchor scans every key
  }
}

TEST_CASE("anchor_reuse: a reuse layer before its anchor has chosen at this n is refused and bad slots by name",
          "[anchor]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(34);
  const index_t n = 100, d = 16, dv = 16;
  floe::testing::random_kv<float> kv(g, n, d, dv);
  const auto qv = floe::testing::random_floats(g, 2 * d);
  const auto q = query_group::make(qv.data(), 2, d);
  const select::anchor_reuse proto{10, std::make_shared<select::anchor_store>(anchor_plan::from_anchors(3, 1, {0}))};
  const estimator<select::anchor_reuse, residual::none> anchor(proto.at(0, 0), {}), reuse(proto.at(2, 0), {});
  std::vector<float> out(2 * dv, -7.f);
  stats st;
  const output_group<float> og{out.data(), 2, dv};
  CHECK_THROWS_WITH(reuse.decode(reuse.build(kv.view()), kv.view(), q, exec::scalar{}, og, st),
                    Catch::Contains("store") && Catch::Contains("has not chosen yet"));
  for (float x : out) CHECK(x == -7.f);  // nothing written
  anchor.decode(anchor.build(kv.view()), kv.view(), q, exec::scalar{}, og, st);
  CHECK_NOTHROW(reuse.decode(reuse.build(kv.view()), kv.view(), q, exec::scalar{}, og, st));
  const kv_view<float> grown{kv.keys.data(), kv.values.data(), n - 1, d, dv};  // another step's cache
  CHECK_THROWS_WITH(reuse.decode(reuse.build(grown), grown, q, exec::scalar{}, og, st),
                    Catch::Contains("store") && Catch::Contains("last chose at n = 100 (n = 99 now)"));
  CHECK_THROWS_WITH(proto.at(3, 0), Catch::Contains("layer"));
  CHECK_THROWS_WITH(proto.at(0, 1), Catch::Contains("layer"));
  CHECK_THROWS_WITH((select::anchor_reuse{10, nullptr, 0, 0}.build(kv.view())), Catch::Contains("store"));
}

TEST_CASE("anchor_calibration: recovers layers that repeat an earlier layer with heads permuted", "[anchor]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(35);
  // Layer 1 = layer 0 with heads swapped, layer 3 = layer 2, layer 4 = layer 2 heads
  // swapped; layers 0 and 2 unrelated. Two anchors: {0, 2}, and the heads mapped back.
  const index_t layers = 5, heads = 2, n = 400;
  select::anchor_calibration cal(layers, heads, 0.05);
  std::gamma_distribution<float> heavy(0.3f, 1.f);
  for (int step = 0; step < 6; ++step) {
    std::vector<std::vector<float>> w(layers * heads, std::vector<float>(n));
    for (index_t l : {0, 2})
      for (index_t h = 0; h < heads; ++h)
        for (auto& x : w[l * heads + h]) x = heavy(g);
    w[1 * heads + 0] = w[0 * heads + 1];
    w[1 * heads + 1] = w[0 * heads + 0];
    w[3 * heads + 0] = w[2 * heads + 0];
    w[3 * heads + 1] = w[2 * heads + 1];
    w[4 * heads + 0] = w[2 * heads + 1];
    w[4 * heads + 1] = w[2 * heads + 0];
    for (index_t s = 0; s < layers * heads; ++s) {
      for (auto& x : w[s]) x *= 3.f;  // any scale
      cal.observe(s / heads, s % heads, w[s]);
    }
    cal.end_step();
  }
  CHECK(cal.steps() == 6);
  const auto plan = cal.plan(2);
  CHECK(plan.anchors() == std::vector<index_t>{0, 2});
  CHECK(plan.head_of == std::vector<index_t>{0, 1, 1, 0, 0, 1, 0, 1, 1, 0});
  CHECK(cal.similarity(0, 1, 1, 0) == Approx(cal.similarity(0, 1, 0, 1)).epsilon(1e-9));
  CHECK(cal.similarity(0, 0, 1, 0) < 0.5 * cal.similarity(0, 1, 1, 0));
  // Without head mapping, layer 1 (swapped) is a poor reuse of layer 0; the heads stay.
  const auto same = cal.plan(2, false);
  for (index_t l = 0; l < layers; ++l)
    for (index_t h = 0; h < heads; ++h) CHECK(same.source_head(l, h) == h);
  const auto sim = cal.layer_similarity(true), flat = cal.layer_similarity(false);
  CHECK(sim[0 * layers + 1] > flat[0 * layers + 1] * 1.5);
  CHECK(sim[2 * layers + 3] == Approx(flat[2 * layers + 3]));

  std::vector<float> short_w(n - 1, 1.f), ok(n, 1.f);
  cal.observe(0, 0, ok);
  CHECK_THROWS_WITH(cal.end_step(), Catch::Contains("observe"));  // the other slots are missing
  CHECK_THROWS_WITH(cal.observe(5, 0, ok), Catch::Contains("layer"));
  ok[3] = std::nan("");
  CHECK_THROWS_WITH(cal.observe(0, 0, ok), Catch::Contains("weight"));
  CHECK_THROWS_WITH(cal.observe(0, 0, std::vector<float>(n, 0.f)), Catch::Contains("weight"));
  CHECK_THROWS_WITH(select::anchor_calibration(3, 1, 0.0), Catch::Contains("fraction"));
}

TEST_CASE("anchor_plan: dense layers attend everything and anchor nothing and the programme skips them", "[anchor]") {
  INFO("seed " << floe::testing::seed());
  const auto p = anchor_plan::from_anchors(5, 1, {1, 3}, {0});
  CHECK(p.anchor_of == std::vector<index_t>{0, 1, 1, 3, 3});
  CHECK(p.anchors() == std::vector<index_t>{1, 3});
  CHECK(p.is_dense(0));
  CHECK_NOTHROW(p.validate());
  const auto mid = anchor_plan::from_anchors(5, 1, {0, 3}, {2});  // a dense layer inside a segment
  CHECK(mid.anchor_of == std::vector<index_t>{0, 0, 2, 3, 3});
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 1, {0, 3}, {0}), Catch::Contains("anchors"));
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 1, {1, 2}, {0, 2}), Catch::Contains("dense"));
  CHECK_THROWS_WITH(anchor_plan::from_anchors(5, 1, {0}, {7}), Catch::Contains("dense_layers"));
  auto bad = p;
  bad.anchor_of[1] = 0;  // reusing a dense layer
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("dense"));

  // A dense layer attends all n tokens without scoring, and reuse still reads its anchor.
  auto g = floe::testing::rng(36);
  const index_t n = 90, d = 16, dv = 8;
  floe::testing::random_kv<float> kv(g, n, d, dv);
  const auto qv = floe::testing::random_floats(g, 2 * d);
  const auto q = query_group::make(qv.data(), 2, d);
  const select::anchor_reuse proto{9, std::make_shared<select::anchor_store>(p)};
  for (index_t l = 0; l < 5; ++l) {
    const auto me = proto.at(l, 0);
    selection sel;
    stats st;
    me.select({}, kv.view(), q, exec::scalar{}, sel, st);
    CHECK(sel.count() == (l == 0 ? n : 9));
    CHECK(st.key_bytes == (l == 1 || l == 3 ? n * d * 4 : 0));
  }

  // Calibration with layer 0 dense: layer 1 repeats nothing, layers 2-4 repeat layer 1.
  select::anchor_calibration cal(5, 1, 0.1);
  std::gamma_distribution<float> heavy(0.3f, 1.f);
  for (int step = 0; step < 4; ++step) {
    std::vector<float> w0(200), w1(200);
    for (auto& x : w0) x = heavy(g);
    for (auto& x : w1) x = heavy(g);
    cal.observe(0, 0, w0);
    for (index_t l = 1; l < 5; ++l) cal.observe(l, 0, w1);
    cal.end_step();
  }
  const auto plan = cal.plan(1, true, {0});
  CHECK(plan.anchors() == std::vector<index_t>{1});
  CHECK(plan.anchor_of == std::vector<index_t>{0, 1, 1, 1, 1});
  CHECK_THROWS_WITH(cal.plan(5, true, {0}), Catch::Contains("count"));  // only 4 layers are not dense
}

TEST_CASE("add_top_k: the k heaviest, ties to the lower index, against a full sort", "[anchor]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(37);
  std::uniform_int_distribution<int> level(0, 6);
  std::exponential_distribution<float> spread(1.f);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t n = 1 + static_cast<index_t>(g() % 3000);
    std::vector<float> w(n);
    for (auto& x : w) {
      const int kind = level(g);  // many exact ties, zeros, and values sharing a radix bucket
      x = kind == 0 ? 0.f : kind == 1 ? 0.25f : kind == 2 ? 0.25f + 1e-7f * (g() % 4) : spread(g);
    }
    w[g() % n] = -0.f;  // equal to +0.f though its bits are the largest: a radix key must not see the sign
    std::vector<index_t> order(n);
    std::iota(order.begin(), order.end(), index_t{0});
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return w[a] > w[b]; });
    for (index_t k : {index_t{1}, n / 3, n - 1}) {
      if (k == 0 || k >= n) continue;
      INFO("n " << n << " k " << k);
      std::vector<index_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      selection sel;
      select::add_top_k(w, k, sel);
      std::vector<index_t> got;
      for (const auto& r : sel.ranges)
        for (index_t i = r.begin; i < r.end; ++i) got.push_back(i);
      CHECK(got == want);
    }
  }
}
