// floe::any_estimator and the method registry: the erased estimator decodes exactly as the
// concrete one, resolves budgets per KV head, guards its states; every registered method
// at a full budget is dense attention.
#include <catch2/catch.hpp>

#include <thread>
#include <type_traits>
#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "method_registry.hpp"
#include "support/random_kv.hpp"
#include "support/reference.hpp"

using namespace floe;
using exec_t = floe::exec::scalar;

TEMPLATE_TEST_CASE("registry: every registered method at budget 1.0 is dense attention", "[eval][registry]", float,
                   half, bfloat16) {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(21);
  const index_t n = 777, d = 64, dv = 32, heads = 4;
  for (bool paged : {false, true}) {
    floe::testing::random_kv<TestType> data(g, n, d, dv, paged ? 5 : 0, paged ? 64 : 0);
    const auto queries = floe::testing::random_floats(g, heads * d);
    const query_group q = query_group::make(queries.data(), heads, d);
    const auto check = [&](const auto& kv) {
      const auto ref = floe::testing::dense_reference(kv, q);
      for (const auto& m : eval::registered_methods<exec_t>()) {
        INFO("method " << m.name << " paged " << paged);
        const auto est = m.make(budget::fraction(1.0));
        std::vector<float> out(heads * dv, -7.f);
        stats st;
        est.decode(est.build(kv), kv, q, exec_t{}, output_group<float>{out.data(), heads, dv}, st);
        for (index_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(ref[i]).epsilon(1e-6).margin(1e-7));
        CHECK(st.tokens_read == n);
        CHECK(st.tokens_total == n);
      }
    };
    if (paged) check(data.paged_view());
    else check(data.view());
  }
}

TEST_CASE("any_estimator: decodes exactly as the concrete estimator", "[eval][registry]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(22);
  const index_t n = 1000, d = 32, dv = 16, heads = 2;
  floe::testing::random_kv<half> data(g, n, d, dv);
  const auto queries = floe::testing::random_floats(g, heads * d);
  const query_group q = query_group::make(queries.data(), heads, d);
  const auto kv = data.view();

  const auto methods = eval::registered_methods<exec_t>();
  const auto& entry = eval::find_method(methods, "oracle_topk");
  const auto erased = entry.make(budget::fraction(0.05));
  CHECK(erased.name() == "oracle_topk");
  std::vector<float> a(heads * dv), b(heads * dv);
  stats sa, sb;
  erased.decode(erased.build(kv), kv, q, exec_t{}, output_group<float>{a.data(), heads, dv}, sa);
  const estimator<select::oracle_topk, residual::none> concrete({50}, {});
  concrete.decode(concrete.build(kv), kv, q, exec_t{}, output_group<float>{b.data(), heads, dv}, sb);
  CHECK(a == b);
  CHECK(sa.bytes_read() == sb.bytes_read());
  CHECK(sa.tokens_read == 50);
}

TEST_CASE("any_estimator: fractional budgets resolve against each KV head's length", "[eval][registry]") {
  auto g = floe::testing::rng(23);
  const auto methods = eval::registered_methods<exec_t>();
  const auto est = eval::find_method(methods, "streaming").make(budget::fraction(0.1));
  const auto queries = floe::testing::random_floats(g, 8);
  const query_group q = query_group::make(queries.data(), 1, 8);
  for (index_t n : {100, 1000, 4097}) {
    floe::testing::random_kv<float> data(g, n, 8, 8);
    std::vector<float> out(8);
    stats st;
    est.decode(est.build(data.view()), data.view(), q, exec_t{}, output_group<float>{out.data(), 1, 8}, st);
    CHECK(st.tokens_read == (n + 9) / 10);
  }
}

TEST_CASE("any_estimator: a state decodes only with the estimator (or copy) that built it", "[eval][registry]") {
  auto g = floe::testing::rng(24);
  floe::testing::random_kv<float> data(g, 64, 8, 4);
  const auto kv = data.view();
  const auto queries = floe::testing::random_floats(g, 8);
  const query_group q = query_group::make(queries.data(), 1, 8);
  std::vector<float> out(4);
  const output_group<float> o{out.data(), 1, 4};
  stats st;
  const auto methods = eval::registered_methods<exec_t>();
  const auto dense = eval::find_method(methods, "dense").make(budget::fraction(1));
  const auto other = eval::find_method(methods, "dense").make(budget::fraction(1));
  const auto state = dense.build(kv);
  const auto copy = dense;
  CHECK_NOTHROW(copy.decode(state, kv, q, exec_t{}, o, st));
  CHECK_THROWS_WITH(other.decode(state, kv, q, exec_t{}, o, st), Catch::Contains("'state'"));
  CHECK_THROWS_WITH(dense.decode(any_estimator<exec_t>::state{}, kv, q, exec_t{}, o, st), Catch::Contains("'state'"));
  const any_estimator<exec_t> empty;
  CHECK_FALSE(empty);
  CHECK_THROWS_WITH(empty.build(kv), Catch::Contains("'estimator'"));
  // Bad input still reaches the estimator's own checks.
  const output_group<float> wrong{out.data(), 1, 3};
  CHECK_THROWS_WITH(dense.decode(state, kv, q, exec_t{}, wrong, st), Catch::Contains("'output.dv'"));
}

TEST_CASE("registry: an unknown method name is an error listing the registered ones", "[eval][registry]") {
  const auto methods = eval::registered_methods<exec_t>();
  try {
    eval::find_method(methods, "sparse_magic", "--attn");
    FAIL("no error");
  } catch (const floe::invalid_argument& e) {
    CHECK(e.argument() == "--attn");
    CHECK_THAT(e.what(), Catch::Contains("dense, streaming, oracle_topk"));
  }
  for (const auto& m : methods) CHECK_FALSE(m.description.empty());
}

namespace {
// Decodes q over the first n tokens of `data` with `st`; the output rows and the stats.
template <class Data>
std::pair<std::vector<float>, stats> decode_prefix(const any_estimator<exec_t>& est, const any_estimator<exec_t>::state& st,
                                                   const Data& data, index_t n, const query_group& q) {
  const kv_view<half> kv(data.keys.data(), data.values.data(), n, data.d, data.dv);
  std::vector<float> out(q.heads * data.dv, -7.f);
  stats s;
  est.decode(st, kv, q, exec_t{}, output_group<float>{out.data(), q.heads, data.dv}, s);
  return {out, s};
}
}  // namespace

// Speculative decoding appends draft tokens and cuts the cache back when they are
// rejected; the tokens then written in their place must be what the state sees once they
// leave the tail window. The drafts' keys point along the query, so an index that kept
// them would pick them.
TEST_CASE("registry: every method follows a cache cut back by rejected speculative tokens", "[eval][registry][append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(25);
  const index_t built = 600, drafted = 632, kept = 622, last = 700, d = 32, dv = 16, heads = 2;
  const auto queries = floe::testing::random_floats(g, heads * d);
  const query_group q = query_group::make(queries.data(), heads, d);
  const floe::testing::random_kv<half> accepted(g, last, d, dv);  // the cache's final content
  auto data = accepted;
  // Overwrites keys [from, to) of `data` with 4 q_0: scores far above every other key's.
  auto write_aligned = [&](index_t from, index_t to) {
    for (index_t i = from; i < to; ++i)
      for (index_t t = 0; t < d; ++t) data.keys[i * d + t] = half::from_float(4.f * queries[t]);
  };
  auto view = [&](index_t n) { return kv_view<half>(data.keys.data(), data.values.data(), n, d, dv); };
  for (const auto& m : eval::registered_methods<exec_t>()) {
    INFO("method " << m.name);
    const auto est = m.make(budget::tokens(48));  // tail windows of 11-12 tokens, more than the 10 rejected (a cut inside a page and a tile)
    data = accepted;
    write_aligned(kept, drafted);
    auto followed = est.build(view(built));
    est.append(followed, view(drafted));  // drafts appended
    est.append(followed, view(kept));     // rejected: cut back
    data = accepted;
    est.append(followed, view(last));     // accepted tokens in their place, then more
    auto direct = est.build(view(built));  // the same steps, as if the drafts had been accepted
    est.append(direct, view(drafted));
    est.append(direct, view(last));
    const auto [a, sa] = decode_prefix(est, followed, data, last, q);
    const auto [b, sb] = decode_prefix(est, direct, data, last, q);
    CHECK(a == b);
    CHECK(sa.bytes_read() == sb.bytes_read());
    CHECK(followed.bytes() == direct.bytes());

    // Cut back below what a summary holds: refused naming the view; indexes that cover
    // every token (and methods without one) follow it as a fresh build would.
    const index_t deep = 300, regrown = 400;
    try {
      est.append(followed, view(deep));
    } catch (const floe::invalid_argument& e) {
      CHECK(e.argument() == "kv");
      continue;
    }
    write_aligned(deep, deep + 8);
    est.append(followed, view(regrown));
    auto fresh = est.build(view(deep));
    est.append(fresh, view(regrown));
    const auto [c, sc] = decode_prefix(est, followed, data, regrown, q);
    const auto [f, sf] = decode_prefix(est, fresh, data, regrown, q);
    CHECK(c == f);
    CHECK(sc.bytes_read() == sf.bytes_read());
  }
}

// An engine decodes its (layer, KV head) pairs from its own threads, with one estimator
// object. Decoding must then read shared states only: several threads decoding every
// head at once (in different orders) give, bit for bit, what one thread gives.
TEST_CASE("registry: every method decodes from several threads at once as from one", "[eval][registry][threads]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(26);
  const index_t n = 1500, d = 32, dv = 16, g_heads = 2, kv_heads = 5, threads = 4;
  std::vector<floe::testing::random_kv<half>> caches;
  for (index_t h = 0; h < kv_heads; ++h) caches.emplace_back(g, n - 37 * h, d, dv);
  const auto queries = floe::testing::random_floats(g, kv_heads * g_heads * d, 2.f);
  auto q = [&](index_t h) { return query_group::make(queries.data() + h * g_heads * d, g_heads, d); };
  auto run_all = [&](const auto& exec) {
    using E = std::remove_cvref_t<decltype(exec)>;
    for (const auto& m : eval::registered_methods<E>()) {
      INFO("method " << m.name << " on " << E::name);
      const auto est = m.make(budget::fraction(0.08));
      std::vector<decltype(est.build(caches[0].view()))> states;
      for (const auto& c : caches) states.push_back(est.build(c.view()));
      std::vector<float> serial(kv_heads * g_heads * dv);
      for (index_t h = 0; h < kv_heads; ++h) {
        stats st;
        est.decode(states[h], caches[h].view(), q(h), exec, output_group<float>{serial.data() + h * g_heads * dv, g_heads, dv}, st);
      }
      std::vector<std::vector<float>> parallel(threads, std::vector<float>(serial.size(), -7.f));
      std::vector<std::thread> pool;
      for (index_t t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          for (index_t round = 0; round < 3; ++round)
            for (index_t i = 0; i < kv_heads; ++i) {
              const index_t h = (i * (t + 1) + t + round) % kv_heads;  // every head, in another order per thread
              stats st;
              est.decode(states[h], caches[h].view(), q(h), exec,
                         output_group<float>{parallel[t].data() + h * g_heads * dv, g_heads, dv}, st);
            }
        });
      for (auto& th : pool) th.join();
      for (index_t t = 0; t < threads; ++t) REQUIRE(parallel[t] == serial);
    }
  };
  run_all(exec_t{});
  run_all(floe::exec::simd{});
  floe::thread_pool shared(2);  // one pool for every caller (it takes one caller's job at a time), split-K on
  run_all(floe::exec::simd({floe::simd_arch::automatic, shared.hook(), 2, 256}));
}
