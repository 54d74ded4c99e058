// The concepts accept every shipped policy and reject broken ones (see also the
// compile-fail tests registered in CMakeLists.txt).
#include <catch2/catch.hpp>

#include "floe/floe.hpp"

namespace {
struct selector_without_select {
  static constexpr const char* name = "x";
  struct index {
    std::uint64_t bytes() const { return 0; }
  };
  using selection = floe::selection;
  template <class KV>
  index build(const KV&) const { return {}; }
};
struct selector_with_bad_selection : floe::select::dense {
  struct selection {};  // not derived from floe::selection
};
struct executor_without_paged {
  using accumulator = double;
  static constexpr const char* name = "x";
  void score(const floe::kv_view<float>&, const floe::query_group&, floe::index_t, floe::token_range, float*) const;
  void attend(const floe::kv_view<float>&, const floe::query_group&, std::span<const floe::token_range>,
              floe::partial_set<double>&) const;
};
}  // namespace

static_assert(floe::Executor<floe::exec::scalar>);
static_assert(!floe::Executor<executor_without_paged>, "an executor must accept paged caches");
static_assert(floe::Selector<floe::select::dense>);
static_assert(floe::Selector<floe::select::streaming>);
static_assert(!floe::Selector<selector_without_select>);
static_assert(!floe::Selector<selector_with_bad_selection>);
static_assert(floe::ResidualFor<floe::residual::none, floe::select::dense>);
static_assert(floe::ResidualFor<floe::residual::none, floe::select::streaming>);
static_assert(!floe::ResidualFor<floe::residual::none, selector_without_select>);
static_assert(floe::KvView<floe::kv_view<floe::bfloat16>>);
static_assert(floe::KvView<floe::paged_kv_view<float>>);

TEST_CASE("estimator names compose selector and residual", "[concepts]") {
  REQUIRE(floe::estimator<floe::select::streaming, floe::residual::none>::name() == "streaming+none");
}
