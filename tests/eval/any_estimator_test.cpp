// floe::any_estimator and the method registry: the erased estimator decodes exactly as the
// concrete one, resolves budgets per KV head, guards its states; every registered method
// at a full budget is dense attention.
#include <catch2/catch.hpp>

#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "method_registry.hpp"
#include "support/random_kv.hpp"

using namespace floe;
using exec_t = floe::exec::scalar;

namespace {

template <KvView KV>
std::vector<double> dense_reference(const KV& kv, const query_group& q) {
  std::vector<double> out(q.heads * kv.dv());
  const estimator<select::dense, residual::none> dense;
  stats ignored;
  dense.decode(dense.build(kv), kv, q, exec_t{}, output_group<double>{out.data(), q.heads, kv.dv()}, ignored);
  return out;
}

}  // namespace

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
      const auto ref = dense_reference(kv, q);
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
