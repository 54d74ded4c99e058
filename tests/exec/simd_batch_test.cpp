// floe::exec::simd's batch entry points (dense and gathered decode over sequence x KV
// head x split) against the scalar reference; every output element written; bad input
// rejected before anything is written.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "floe/core/batch.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "simd_test_support.hpp"
#include "support/random_kv.hpp"

using floe::index_t;
using floe::token_range;
namespace ft = floe::testing;

namespace {

constexpr float poison = std::numeric_limits<float>::quiet_NaN();
constexpr float sentinel = -12345.f;  // marks padding between output rows

// A batch of sequences of different lengths with Hkv KV heads each, as contiguous or
// paged views, with query and output rows padded so strides exceed the rows.
template <class T>
struct random_batch {
  floe::gqa_shape shape;
  index_t d, dv, q_stride, out_stride;
  std::vector<ft::random_kv<T>> caches;  // [sequence * Hkv + head]
  std::vector<std::vector<floe::kv_view<T>>> views;
  std::vector<std::vector<floe::paged_kv_view<T>>> paged;
  std::vector<std::vector<float>> queries, outs;

  random_batch(std::mt19937_64& g, std::vector<index_t> lengths, floe::gqa_shape s, index_t d_, index_t dv_,
               index_t block)
      : shape(s), d(d_), dv(dv_), q_stride(d_ + 3), out_stride(dv_ + 2) {
    for (index_t n : lengths) {
      views.emplace_back();
      paged.emplace_back();
      for (index_t h = 0; h < s.kv_heads; ++h) caches.emplace_back(g, n, d, dv, 1, block);
      queries.push_back(ft::random_floats(g, s.q_heads * q_stride));
      outs.emplace_back(s.q_heads * out_stride, poison);
    }
    for (index_t i = 0; i < lengths.size(); ++i)
      for (index_t h = 0; h < s.kv_heads; ++h) {
        views[i].push_back(caches[i * s.kv_heads + h].view());
        paged[i].push_back(caches[i * s.kv_heads + h].paged_view());
      }
    for (auto& o : outs)
      for (index_t r = 0; r < s.q_heads; ++r)
        for (index_t j = dv; j < out_stride; ++j) o[r * out_stride + j] = sentinel;
  }

  template <class KV>
  std::vector<floe::sequence<KV>> sequences(const std::vector<std::vector<KV>>& kv) {
    std::vector<floe::sequence<KV>> out;
    for (index_t i = 0; i < kv.size(); ++i)
      out.push_back({kv[i], queries[i].data(), outs[i].data(), q_stride, out_stride});
    return out;
  }

  // Every output element is finite and the padding between rows untouched.
  bool fully_written() const {
    for (const auto& o : outs)
      for (index_t r = 0; r < shape.q_heads; ++r)
        for (index_t j = 0; j < out_stride; ++j) {
          const float x = o[r * out_stride + j];
          if (j < dv ? !std::isfinite(x) : x != sentinel) return false;
        }
    return true;
  }
  bool untouched() const {
    for (const auto& o : outs)
      for (index_t r = 0; r < shape.q_heads; ++r)
        for (index_t j = 0; j < dv; ++j)
          if (!std::isnan(o[r * out_stride + j])) return false;
    return true;
  }
};

// The scalar reference for group (sequence s, KV head h) over `ranges`: rows [g, dv].
template <class KV>
std::vector<float> reference_rows(const KV& kv, const float* queries, index_t q_stride, index_t g, index_t h,
                                  float scale, const std::vector<token_range>& ranges) {
  floe::query_group q{queries + h * g * q_stride, g, kv.d(), q_stride, scale};
  floe::partial_set<double> p(g, kv.dv());
  floe::exec::scalar{}.attend(kv, q, ranges, p);
  std::vector<float> rows(g * kv.dv());
  p.finalize(floe::output_group<float>{rows.data(), g, kv.dv(), 0});
  return rows;
}

template <class T, class KV>
double batch_error(random_batch<T>& b, const std::vector<std::vector<KV>>& kv,
                   const std::vector<std::vector<token_range>>& exact, float scale) {
  const index_t g = b.shape.group();
  double worst = 0.0;
  for (index_t s = 0; s < kv.size(); ++s)
    for (index_t h = 0; h < b.shape.kv_heads; ++h) {
      const auto& ranges = exact[s * b.shape.kv_heads + h];
      const auto want = reference_rows(kv[s][h], b.queries[s].data(), b.q_stride, g, h, scale, ranges);
      worst = std::max(worst, ft::max_relative_error(b.outs[s].data() + h * g * b.out_stride, b.out_stride,
                                                     want.data(), b.dv, g, b.dv));
    }
  return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("simd dense batch decode matches the scalar reference over threads 1-4", "[exec][simd][batch]",
                   float, floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  // (threads, shape, paged): g = 1, 4, 8 and thread counts 1-4, each layout.
  const auto [threads, shape, paged] = GENERATE(table<index_t, floe::gqa_shape, bool>(
      {{1, {2, 2}, false}, {2, {8, 2}, true}, {3, {24, 3}, false}, {4, {8, 2}, false}, {4, {24, 3}, true},
       {2, {2, 2}, true}}));
  auto g = ft::rng(threads * 10 + shape.q_heads + paged);
  random_batch<TestType> b(g, {1, 65, 1500}, shape, 64, 80, 16);
  floe::thread_pool pool(threads);
  const floe::exec::simd simd({arch, pool.hook(), threads, 256});  // pieces of >= 256 tokens
  const float scale = 0.125f;
  INFO("arch " << floe::simd_arch_name(arch) << " threads " << threads << " Hq " << shape.q_heads << " Hkv "
               << shape.kv_heads << " paged " << paged);
  std::vector<std::vector<token_range>> all;
  for (index_t n : {1, 65, 1500})
    for (index_t h = 0; h < shape.kv_heads; ++h) all.push_back({{0, n}});
  if (paged) {
    const auto seqs = b.sequences(b.paged);
    simd.decode(std::span<const floe::sequence<floe::paged_kv_view<TestType>>>(seqs), shape, scale);
    REQUIRE(b.fully_written());
    CHECK(batch_error(b, b.paged, all, scale) <= 1e-5);
  } else {
    const auto seqs = b.sequences(b.views);
    simd.decode(std::span<const floe::sequence<floe::kv_view<TestType>>>(seqs), shape, scale);
    REQUIRE(b.fully_written());
    CHECK(batch_error(b, b.views, all, scale) <= 1e-5);
  }
}

TEST_CASE("simd gathered batch decode matches the scalar reference and no ranges give zeros", "[exec][simd][batch]") {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t threads = GENERATE(1, 4);
  auto g = ft::rng(3 + threads);
  const floe::gqa_shape shape{8, 2};
  random_batch<floe::half> b(g, {5000, 900}, shape, 128, 128, 256);
  const std::vector<std::vector<token_range>> exact{
      {{0, 4}, {64, 128}, {1000, 1064}, {4990, 5000}}, {{7, 8}, {4000, 4999}}, {}, {{0, 900}}};
  floe::thread_pool pool(threads);
  const floe::exec::simd simd({arch, pool.hook(), threads, 64});
  const auto seqs = b.sequences(b.paged);
  simd.decode_gathered(std::span<const floe::sequence<floe::paged_kv_view<floe::half>>>(seqs), shape, 0.1f, exact);
  REQUIRE(b.fully_written());
  INFO("arch " << floe::simd_arch_name(arch) << " threads " << threads);
  CHECK(batch_error(b, b.paged, exact, 0.1f) <= 1e-5);
  for (index_t r = 0; r < 4; ++r)  // group 2 = sequence 1, KV head 0: its 4 query heads attend to nothing
    for (index_t j = 0; j < 128; ++j) CHECK(b.outs[1][r * b.out_stride + j] == 0.f);
}

TEST_CASE("simd batch decode agrees with floe::decode_batch over the scalar executor", "[exec][simd][batch]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(9);
  const floe::gqa_shape shape{12, 3};
  random_batch<floe::bfloat16> b(g, {2000, 17}, shape, 128, 128, 16);
  auto ref = b;  // same inputs, its own outputs
  floe::thread_pool pool(2);
  const floe::exec::simd simd(pool);
  const auto seqs = b.sequences(b.views);
  simd.decode(std::span<const floe::sequence<floe::kv_view<floe::bfloat16>>>(seqs), shape, 0.09f);
  // decode_batch over views that point into ref's own caches.
  std::vector<std::vector<floe::kv_view<floe::bfloat16>>> ref_views(2);
  for (index_t s = 0; s < 2; ++s)
    for (index_t h = 0; h < 3; ++h) ref_views[s].push_back(ref.caches[s * 3 + h].view());
  const auto ref_seqs = ref.sequences(ref_views);
  const floe::estimator<floe::select::dense, floe::residual::none> dense;
  std::vector<decltype(dense)::state> states(6);
  for (index_t i = 0; i < 6; ++i) states[i] = dense.build(ref_views[i / 3][i % 3]);
  floe::decode_batch(dense, std::span<const decltype(dense)::state>(states),
                     std::span<const floe::sequence<floe::kv_view<floe::bfloat16>>>(ref_seqs), shape, 0.09f,
                     floe::exec::scalar{}, pool.hook());
  REQUIRE(b.fully_written());
  for (index_t s = 0; s < 2; ++s)
    CHECK(ft::max_relative_error(b.outs[s].data(), b.out_stride, ref.outs[s].data(), ref.out_stride, 12, 128) <=
          1e-5);
}

TEST_CASE("simd batch decode rejects bad input before writing any output", "[exec][simd][batch][errors]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(4);
  const floe::gqa_shape shape{4, 2};
  random_batch<float> b(g, {100, 50}, shape, 64, 64, 16);
  const floe::exec::simd simd;
  auto seqs = b.sequences(b.views);
  using seq_span = std::span<const floe::sequence<floe::kv_view<float>>>;
  auto argument_of = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const floe::invalid_argument& e) {
      return e.argument();
    }
    return "(no error)";
  };
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), {4, 3}, 0.1f); }) == "q_heads");
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), {4, 4}, 0.1f); }) == "sequence.kv_heads");
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), shape, 0.f); }) == "scale");
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), shape, std::nanf("")); }) == "scale");
  b.queries[1][2] = std::numeric_limits<float>::infinity();
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), shape, 0.1f); }) == "query");
  b.queries[1][2] = 0.f;
  seqs[0].queries = nullptr;
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), shape, 0.1f); }) == "sequence.queries");
  seqs = b.sequences(b.views);
  seqs[1].out_stride = 10;
  CHECK(argument_of([&] { simd.decode(seq_span(seqs), shape, 0.1f); }) == "output.stride");
  seqs = b.sequences(b.views);
  std::vector<std::vector<token_range>> exact{{{0, 10}}, {{5, 4}}, {}, {}};
  CHECK(argument_of([&] { simd.decode_gathered(seq_span(seqs), shape, 0.1f, exact); }) == "selection");
  exact = {{{0, 10}}, {{0, 101}}, {}, {}};
  CHECK(argument_of([&] { simd.decode_gathered(seq_span(seqs), shape, 0.1f, exact); }) == "selection");
  exact = {{{0, 10}, {5, 20}}, {}, {}, {}};
  CHECK(argument_of([&] { simd.decode_gathered(seq_span(seqs), shape, 0.1f, exact); }) == "selection");
  exact.pop_back();
  CHECK(argument_of([&] { simd.decode_gathered(seq_span(seqs), shape, 0.1f, exact); }) == "exact");
  CHECK(b.untouched());
}
