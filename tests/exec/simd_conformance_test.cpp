// Cross-executor conformance: floe's estimators give the same outputs and the same stats
// through floe::exec::simd as through the scalar reference.
#include <catch2/catch.hpp>

#include "floe/core/batch.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/streaming.hpp"
#include "simd_test_support.hpp"
#include "support/random_kv.hpp"

using floe::index_t;
namespace ft = floe::testing;

static_assert(floe::Executor<floe::exec::simd>);

namespace {

// Decodes one GQA group with `est` through both executors; returns the worst relative
// error and checks that the stats agree.
template <class Est, class KV>
double conformance_error(const Est& est, const KV& kv, const floe::query_group& q, const floe::exec::simd& simd) {
  const auto state = est.build(kv);
  std::vector<float> want(q.heads * kv.dv()), got(q.heads * kv.dv(), std::numeric_limits<float>::quiet_NaN());
  floe::stats want_stats, got_stats;
  est.decode(state, kv, q, floe::exec::scalar{}, floe::output_group<float>{want.data(), q.heads, kv.dv()}, want_stats);
  est.decode(state, kv, q, simd, floe::output_group<float>{got.data(), q.heads, kv.dv()}, got_stats);
  CHECK(got_stats.tokens_read == want_stats.tokens_read);
  CHECK(got_stats.bytes_read() == want_stats.bytes_read());
  return ft::max_relative_error(got.data(), kv.dv(), want.data(), kv.dv(), q.heads, kv.dv());
}

}  // namespace

TEMPLATE_TEST_CASE("estimators decode through exec::simd as through exec::scalar", "[exec][simd][conformance]", float,
                   floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t n = GENERATE(1, 100, 5000);
  const index_t block = GENERATE(0, 16);
  auto g = ft::rng(n + block);
  ft::random_kv<TestType> cache(g, n, 128, 128, 0, block ? block : 0);
  const auto queries = ft::random_floats(g, 4 * 128);
  const auto q = floe::query_group::make(queries.data(), 4, 128);
  floe::thread_pool pool(2);
  const floe::exec::simd simd({arch, pool.hook(), 2, 512});
  const floe::estimator<floe::select::dense, floe::residual::none> dense;
  const floe::estimator<floe::select::streaming, floe::residual::none> streaming({4, 300}, {});
  INFO("arch " << floe::simd_arch_name(arch) << " n " << n << " block " << block);
  if (block) {
    CHECK(conformance_error(dense, cache.paged_view(), q, simd) <= 1e-5);
    CHECK(conformance_error(streaming, cache.paged_view(), q, simd) <= 1e-5);
  } else {
    CHECK(conformance_error(dense, cache.view(), q, simd) <= 1e-5);
    CHECK(conformance_error(streaming, cache.view(), q, simd) <= 1e-5);
  }
}

TEST_CASE("decode_batch runs exec::simd on a thread pool like exec::scalar", "[exec][simd][conformance]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(21);
  const floe::gqa_shape shape{8, 2};
  std::vector<ft::random_kv<floe::half>> caches;
  for (index_t n : {3000, 3000, 40, 40}) caches.emplace_back(g, n, 64, 64);
  std::vector<floe::kv_view<floe::half>> views;
  for (auto& c : caches) views.push_back(c.view());
  const auto queries = ft::random_floats(g, 2 * 8 * 64);
  std::vector<float> want(2 * 8 * 64), got(2 * 8 * 64, std::numeric_limits<float>::quiet_NaN());
  using seq = floe::sequence<floe::kv_view<floe::half>>;
  const std::vector<seq> want_batch{{{views.data(), 2}, queries.data(), want.data()},
                                    {{views.data() + 2, 2}, queries.data() + 8 * 64, want.data() + 8 * 64}};
  const std::vector<seq> got_batch{{{views.data(), 2}, queries.data(), got.data()},
                                   {{views.data() + 2, 2}, queries.data() + 8 * 64, got.data() + 8 * 64}};
  const floe::estimator<floe::select::streaming, floe::residual::none> est({4, 1000}, {});
  std::vector<decltype(est)::state> states;
  for (auto& v : views) states.push_back(est.build(v));
  floe::thread_pool pool(3);
  const floe::exec::simd simd(pool);  // nested inside decode_batch's pool: runs serially
  const auto want_stats = floe::decode_batch(est, std::span<const decltype(est)::state>(states),
                                             std::span<const seq>(want_batch), shape, 0.125f, floe::exec::scalar{},
                                             pool.hook());
  const auto got_stats = floe::decode_batch(est, std::span<const decltype(est)::state>(states),
                                            std::span<const seq>(got_batch), shape, 0.125f, simd, pool.hook());
  CHECK(got_stats.bytes_read() == want_stats.bytes_read());
  CHECK(ft::max_relative_error(got.data(), 64, want.data(), 64, 16, 64) <= 1e-5);
}
