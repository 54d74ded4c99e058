// estimator::append and any_estimator::append reach every index that has append(), and
// a copied any_estimator state keeps its own index.
#include <catch2/catch.hpp>

#include "floe/floe.hpp"
#include "support/random_kv.hpp"

namespace {
// A selector whose index remembers the cache length it has seen.
struct counting_selector : floe::select::dense {
  struct index {
    floe::index_t seen = 0;
    std::uint64_t bytes() const { return seen; }
    template <class KV>
    void append(const KV& kv) { seen = kv.n(); }
  };
  template <floe::KvView KV>
  index build(const KV& kv) const { return {kv.n()}; }
  template <floe::KvView KV, class Exec>
  void select(const index& idx, const KV& kv, const floe::query_group& q, const Exec& e, selection& out,
              floe::stats& s) const {
    floe::require(idx.seen == kv.n(), "state", "index saw ", idx.seen, " tokens, cache has ", kv.n());
    floe::select::dense::select(floe::no_index{}, kv, q, e, out, s);
  }
};
using counting = floe::estimator<counting_selector, floe::residual::none>;
}  // namespace

TEST_CASE("estimator::append updates indices that have append()", "[append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(61);
  floe::testing::random_kv<float> data(g, 100, 16, 16);
  const floe::kv_view<float> first(data.keys.data(), data.values.data(), 60, 16, 16);
  const auto all = data.view();
  const auto q = floe::testing::random_floats(g, 16);
  std::vector<float> out(16);
  floe::stats s;
  counting est;
  auto st = est.build(first);
  REQUIRE_THROWS_AS(est.decode(st, all, floe::query_group::make(q.data(), 1, 16), floe::exec::scalar{},
                               floe::output_group<float>{out.data(), 1, 16, 0}, s),
                    floe::invalid_argument);
  est.append(st, all);
  REQUIRE(st.selector_index.seen == 100);
  est.decode(st, all, floe::query_group::make(q.data(), 1, 16), floe::exec::scalar{},
             floe::output_group<float>{out.data(), 1, 16, 0}, s);
  REQUIRE(s.tokens_read == 100);

  // Policies without append() compile and do nothing.
  floe::estimator<floe::select::streaming, floe::residual::none> plain({4, 8}, {});
  auto pst = plain.build(first);
  plain.append(pst, all);
}

TEST_CASE("any_estimator::append forwards, and copies of a state stay independent", "[append]") {
  auto g = floe::testing::rng(62);
  floe::testing::random_kv<float> data(g, 100, 16, 16);
  const floe::kv_view<float> first(data.keys.data(), data.values.data(), 60, 16, 16);
  const auto all = data.view();
  const auto any = floe::any_estimator<floe::exec::scalar>::from("counting", [](floe::index_t) { return counting{}; });
  auto st = any.build(first);
  const auto before = st;  // shares the index until one of them appends
  any.append(st, all);
  REQUIRE(st.bytes() == 100);
  REQUIRE(before.bytes() == 60);
  const auto q = floe::testing::random_floats(g, 16);
  std::vector<float> out(16);
  floe::stats s;
  any.decode(st, all, floe::query_group::make(q.data(), 1, 16), floe::exec::scalar{},
             floe::output_group<float>{out.data(), 1, 16, 0}, s);
  REQUIRE_THROWS_AS(any.decode(before, all, floe::query_group::make(q.data(), 1, 16), floe::exec::scalar{},
                               floe::output_group<float>{out.data(), 1, 16, 0}, s),
                    floe::invalid_argument);
}
