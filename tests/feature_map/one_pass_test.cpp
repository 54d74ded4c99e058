// The feature-map residual reads the exact part itself, chunk by chunk, interleaved with
// its subtraction of the exact tokens' own terms: the result must equal the plain order
// (attend everything, then estimate), and the register-blocked weighted row sum it uses
// must equal the same sum in double.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/index/weighted_rows.hpp"
#include "floe/residual/feature_map.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "support/random_kv.hpp"

namespace {
using floe::index_t;
using selector = floe::select::topk_anchors<floe::select::exact_scan>;
using residual = floe::residual::feature_map<>;
using estimator = floe::estimator<selector, residual>;

static_assert(floe::exec::simd::small_calls_cheap && floe::exec::scalar::small_calls_cheap);

// The plain order: the whole exact part through exec.attend, then the residual's estimate.
template <class Exec, floe::KvView KV>
std::vector<float> attend_then_estimate(const estimator& est, const estimator::state& st, const KV& kv,
                                        const floe::query_group& q, const Exec& exec, floe::stats& io) {
  selector::selection sel;
  est.selector().select(st.selector_index, kv, q, exec, sel, io);
  floe::partial_set<typename Exec::accumulator> parts(q.heads, kv.dv());
  exec.attend(kv, q, std::span<const floe::token_range>(sel.ranges), parts);
  est.residual().estimate(st.residual_index, kv, q, sel, exec, parts, io);
  std::vector<float> out(q.heads * kv.dv());
  parts.finalize(floe::output_group<float>{out.data(), q.heads, kv.dv(), 0});
  return out;
}

template <class Exec>
void check_one_pass(const Exec& exec, bool cached, double fraction) {
  auto g = floe::testing::rng(91 + (cached ? 1 : 0));
  const index_t n = 6000, d = 64, dv = 48, heads = 4;
  floe::testing::random_kv<floe::half> data(g, n, d, dv, 0, 0, 0.6f);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, heads * d, 0.6f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  residual fm;
  fm.map.features = 64;
  fm.cache_token_features = cached;
  const estimator est(selector{4, 32, floe::budget::fraction(fraction), {}}, fm);
  const auto st = est.build(kv);
  floe::stats one_io, two_io;
  std::vector<float> one(heads * dv, std::nanf(""));
  est.decode(st, kv, q, exec, floe::output_group<float>{one.data(), heads, dv, 0}, one_io);
  const std::vector<float> two = attend_then_estimate(est, st, kv, q, exec, two_io);
  for (index_t h = 0; h < heads; ++h) {
    float scale = 0.f;
    for (index_t j = 0; j < dv; ++j) scale = std::max(scale, std::fabs(two[h * dv + j]));
    for (index_t j = 0; j < dv; ++j) {
      INFO("head " << h << ", column " << j << ": one pass " << one[h * dv + j] << ", two passes " << two[h * dv + j]);
      REQUIRE(std::fabs(one[h * dv + j] - two[h * dv + j]) <= 1e-5f * scale);
    }
  }
  REQUIRE(one_io.summary_bytes == two_io.summary_bytes);
}
}  // namespace

TEST_CASE("the feature map's one pass over the exact rows equals attending them first", "[feature_map][one_pass]") {
  INFO("seed " << floe::testing::seed());
  // 0.3 of 6000: ~1800 exact tokens in the middle, four chunks of at most 512; 1: the
  // exact set covers the region (no estimate); 0: nothing exact in the middle.
  for (const bool cached : {false, true})
    for (const double fraction : {0.3, 1.0, 0.0}) {
      INFO((cached ? "cached" : "projected") << " features, budget fraction " << fraction);
      check_one_pass(floe::exec::simd{}, cached, fraction);
      check_one_pass(floe::exec::scalar{}, cached, fraction);
    }
}

TEST_CASE("add_weighted_rows equals the weighted row sums in double", "[feature_map][one_pass]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(93);
  for (const index_t heads : {1, 2, 3, 4, 5, 8, 9})
    for (const index_t width : {1, 17, 64, 80, 128, 200})
      for (const index_t count : {0, 1, 7, 513}) {
        INFO(heads << " heads, width " << width << ", " << count << " rows");
        const index_t stride = floe::detail::weighted_stride(width), u_stride = count + 3;
        REQUIRE(stride >= width);
        REQUIRE(stride % floe::detail::weighted_block_floats == 0);
        const auto u = floe::testing::random_floats(g, heads * u_stride);
        auto rows = floe::testing::random_floats(g, std::max<index_t>(1, count) * stride);
        for (index_t r = 0; r < count; ++r) std::fill(rows.begin() + r * stride + width, rows.begin() + (r + 1) * stride, 0.f);
        const index_t out_stride = stride + floe::detail::weighted_block_floats;
        auto out = floe::testing::random_floats(g, heads * out_stride);  // added to, not overwritten
        const auto before = out;
        floe::detail::add_weighted_rows(u.data(), u_stride, heads, rows.data(), count, stride, out.data(), out_stride);
        for (index_t h = 0; h < heads; ++h)
          for (index_t j = 0; j < out_stride; ++j) {
            double sum = before[h * out_stride + j], size = std::fabs(sum);
            for (index_t r = 0; r < count && j < stride; ++r) {
              sum += double(u[h * u_stride + r]) * rows[r * stride + j];
              size += std::fabs(double(u[h * u_stride + r]) * rows[r * stride + j]);
            }
            REQUIRE(std::fabs(out[h * out_stride + j] - sum) <= 1e-6 * size + 1e-30);
          }
      }
}
