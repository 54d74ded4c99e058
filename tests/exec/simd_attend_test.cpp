// floe::exec::simd attend/score against the scalar reference: every compiled architecture,
// fp32/fp16/bf16, N, d, GQA groups, row strides, paged blocks and gathered ranges.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "simd_test_support.hpp"
#include "support/random_kv.hpp"

using floe::index_t;
using floe::token_range;
namespace ft = floe::testing;

namespace {

struct attend_case {
  index_t n, d, dv, heads;
  index_t pad = 0;    // extra elements per KV row and query row (strides larger than the row)
  index_t block = 0;  // paged blocks of this many tokens, or contiguous
};

// Attends with the scalar reference and with the SIMD executor on `arch`, over `ranges`
// (all tokens when empty), and returns the worst relative error over the group's heads.
template <class T>
double attend_error(floe::simd_arch arch, const attend_case& c, std::uint64_t salt,
                    std::vector<token_range> ranges = {}, index_t threads = 1) {
  auto g = ft::rng(salt);
  ft::random_kv<T> kv(g, c.n, c.d, c.dv, c.pad, c.block);
  const index_t q_stride = c.d + c.pad;
  const auto queries = ft::random_floats(g, c.heads * q_stride);
  const auto q = floe::query_group::make(queries.data(), c.heads, c.d, q_stride);
  if (ranges.empty()) ranges.push_back({0, c.n});
  floe::thread_pool pool(threads);
  floe::exec::simd_options opt{arch, pool.hook(), threads, 16};  // tiny pieces force split-K
  const floe::exec::simd simd(opt);
  REQUIRE(simd.arch() == arch);
  floe::partial_set<double> want(c.heads, c.dv);
  floe::partial_set<float> got(c.heads, c.dv);
  if (c.block) {
    floe::exec::scalar{}.attend(kv.paged_view(), q, ranges, want);
    simd.attend(kv.paged_view(), q, ranges, got);
  } else {
    floe::exec::scalar{}.attend(kv.view(), q, ranges, want);
    simd.attend(kv.view(), q, ranges, got);
  }
  return ft::max_relative_error(got, want);
}

}  // namespace

TEMPLATE_TEST_CASE("simd attend matches the scalar reference over N and d and GQA groups", "[exec][simd]", float,
                   floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t n = GENERATE(1, 7, 63, 64, 65, 1000);
  const index_t d = GENERATE(64, 80, 128, 256);
  const index_t heads = GENERATE(1, 4, 8);
  INFO("arch " << floe::simd_arch_name(arch) << " n " << n << " d " << d << " g " << heads);
  CHECK(attend_error<TestType>(arch, {n, d, d, heads}, n * 1000 + d * 10 + heads) <= 1e-5);
}

TEMPLATE_TEST_CASE("simd attend handles strides and dv != d and odd g and paged blocks", "[exec][simd]", float,
                   floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t block = GENERATE(0, 16, 256);
  const index_t pad = GENERATE(0, 3);
  const index_t heads = GENERATE(3, 11);  // 11 heads: a block of 8 and one of 3
  const index_t n = 1000;
  INFO("arch " << floe::simd_arch_name(arch) << " block " << block << " pad " << pad << " g " << heads << " n "
               << n);
  CHECK(attend_error<TestType>(arch, {n, 80, 72, heads, pad, block}, block + pad * 7 + heads * 31 + n) <= 1e-5);
  CHECK(attend_error<TestType>(arch, {n, 7, 5, heads, pad, block}, block + pad * 7 + heads * 31 + n + 1) <= 1e-5);
}

TEST_CASE("simd attend reads bf16 in even/odd pairs when d and dv allow it, in order otherwise", "[exec][simd]") {
  INFO("seed " << ft::seed());
  // Paired needs d and dv multiples of 2 vectors (32 elements on avx512, 16 on avx2): these
  // shapes take the paired path on one architecture or both, with query and row strides.
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t pad = GENERATE(0, 5);
  const index_t heads = GENERATE(1, 5, 8);
  INFO("arch " << floe::simd_arch_name(arch) << " pad " << pad << " g " << heads);
  CHECK(attend_error<floe::bfloat16>(arch, {777, 96, 64, heads, pad}, 11 + pad + heads) <= 1e-5);
  CHECK(attend_error<floe::bfloat16>(arch, {777, 64, 48, heads, pad, 16}, 12 + pad + heads) <= 1e-5);
  CHECK(attend_error<floe::bfloat16>(arch, {777, 32, 32, heads, pad}, 13 + pad + heads) <= 1e-5);
}

TEST_CASE("simd attend over a long context (N = 100003) stays within 1e-5", "[exec][simd]") {
  INFO("seed " << ft::seed());
  // One long case per architecture, the element type rotating, contiguous or paged.
  for (const auto arch : ft::runnable_archs()) {
    INFO("arch " << floe::simd_arch_name(arch));
    switch (arch) {
      case floe::simd_arch::avx512: CHECK(attend_error<floe::half>(arch, {100003, 128, 128, 2}, 1) <= 1e-5); break;
      case floe::simd_arch::avx2:
        CHECK(attend_error<floe::bfloat16>(arch, {100003, 64, 64, 2, 0, 256}, 2, {}, 2) <= 1e-5);
        break;
      default: CHECK(attend_error<float>(arch, {100003, 64, 64, 1, 0, 16}, 3) <= 1e-5); break;
    }
  }
}

TEMPLATE_TEST_CASE("simd attend over gathered ranges and single tokens", "[exec][simd]", float, floe::half,
                   floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t block = GENERATE(0, 16);
  const index_t threads = GENERATE(1, 3);
  auto g = ft::rng(77);
  std::vector<token_range> ranges;
  for (index_t b = 0; b + 64 <= 4000;) {  // random 64-token ranges, some single tokens between
    b += std::uniform_int_distribution<index_t>(0, 300)(g);
    if (b + 64 > 4000) break;
    ranges.push_back({b, b + 64});
    b += 65;
    if (b < 4000 && g() % 2) ranges.push_back({b, b + 1}), b += 2;
  }
  REQUIRE(ranges.size() > 3);
  INFO("arch " << floe::simd_arch_name(arch) << " block " << block << " threads " << threads);
  CHECK(attend_error<TestType>(arch, {4000, 128, 128, 4, 0, block}, 5 + block, ranges, threads) <= 1e-5);
}

TEMPLATE_TEST_CASE("simd attend over short steps with key rows that end mid-vector or start off a line",
                   "[exec][simd]", float, floe::half, floe::bfloat16) {
  // The kernel asks for the first tile's rows at once and for the next tile's row by row,
  // plus the tail and last line of a row that ends mid-vector or starts off a cache line.
  // Prefetches change no value; this checks the result on the shapes that take each path:
  // one tile, a tile followed by a shorter one, d with a tail (72, 24) or none (64), rows
  // 3 elements apart (off a line).
  INFO("seed " << ft::seed());
  const std::vector<std::vector<token_range>> steps = {
      {{5, 9}},                          // under one tile
      {{10, 74}, {200, 230}},            // a tile, then 30 tokens
      {{0, 64}, {100, 164}, {299, 300}}  // 64, 64, 1
  };
  for (const auto arch : ft::runnable_archs())
    for (const index_t d : {24, 64, 72})
      for (const index_t pad : {0, 3})
        for (const index_t heads : {1, 4})
          for (std::size_t k = 0; k < steps.size(); ++k) {
            INFO("arch " << floe::simd_arch_name(arch) << " d " << d << " pad " << pad << " g " << heads
                         << " step " << k);
            const auto salt = static_cast<std::uint64_t>(d * 1000 + pad * 100 + heads * 10) + k;
            CHECK(attend_error<TestType>(arch, {300, d, d, heads, pad}, salt, steps[k]) <= 1e-5);
          }
}

TEMPLATE_TEST_CASE("simd attend over selections longer than one batch of runs", "[exec][simd]", floe::half,
                   floe::bfloat16) {
  // Batches hold up to 1024 runs or 4096 tokens: thousands of single tokens, and 64-token
  // ranges past 4096 tokens, cross several batch boundaries (and their prefetches).
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const bool singles = GENERATE(true, false);
  const index_t threads = GENERATE(1, 2);
  auto g = ft::rng(91);
  std::vector<token_range> ranges;
  for (index_t b = std::uniform_int_distribution<index_t>(0, 3)(g); b + 64 <= 20000;) {
    const index_t len = singles ? 1 : 64;
    ranges.push_back({b, b + len});
    b += len + std::uniform_int_distribution<index_t>(1, singles ? 4 : 100)(g);
  }
  index_t tokens = 0;
  for (const auto& r : ranges) tokens += r.size();
  REQUIRE(tokens > 4096);
  INFO("arch " << floe::simd_arch_name(arch) << (singles ? " single tokens " : " 64-token ranges ") << ranges.size()
               << " runs, threads " << threads);
  CHECK(attend_error<TestType>(arch, {20000, 128, 128, 4, 0, 0}, 13, ranges, threads) <= 1e-5);
}

TEST_CASE("simd attend splits over threads 1-4 and merges into what the partial holds", "[exec][simd]") {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t threads = GENERATE(1, 2, 3, 4);
  auto g = ft::rng(11);
  ft::random_kv<floe::half> kv(g, 3000, 64, 64, 0, 16);
  const auto queries = ft::random_floats(g, 4 * 64);
  const auto q = floe::query_group::make(queries.data(), 4, 64);
  floe::thread_pool pool(threads);
  const floe::exec::simd simd({arch, pool.hook(), threads, 100});
  // Two calls into one partial equal one call over both ranges.
  const std::vector<token_range> first{{0, 1000}}, second{{1000, 1700}, {2000, 3000}},
      both{{0, 1700}, {2000, 3000}};
  floe::partial_set<float> got(4, 64);
  simd.attend(kv.paged_view(), q, first, got);
  simd.attend(kv.paged_view(), q, second, got);
  floe::partial_set<double> want(4, 64);
  floe::exec::scalar{}.attend(kv.paged_view(), q, both, want);
  INFO("arch " << floe::simd_arch_name(arch) << " threads " << threads);
  CHECK(ft::max_relative_error(got, want) <= 1e-5);
}

namespace {
// Scores of head h over r that differ from the reference by more than 1e-5 s |q| |k|.
template <class T>
index_t scores_off_bound(const ft::random_kv<T>& kv, const floe::query_group& q, index_t h, token_range r,
                         const float* got, const std::vector<float>& want) {
  double q_norm = 0.0;
  for (index_t t = 0; t < q.d; ++t) q_norm += double(q.row(h)[t]) * q.row(h)[t];
  index_t bad = 0;
  for (index_t i = 0; i < r.size(); ++i) {
    const T* k = kv.paged() ? kv.paged_view().key_row(r.begin + i) : kv.view().key_row(r.begin + i);
    double k_norm = 0.0;
    for (index_t t = 0; t < q.d; ++t) k_norm += double(floe::to_float(k[t])) * floe::to_float(k[t]);
    const double bound = 1e-5 * q.scale * std::sqrt(q_norm * k_norm);
    if (!(std::abs(static_cast<double>(got[i]) - want[i]) <= bound)) ++bad;
  }
  return bad;
}
}  // namespace

TEMPLATE_TEST_CASE("simd score matches the scalar reference", "[exec][simd]", float, floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t d = GENERATE(7, 64, 80, 256);
  const index_t block = GENERATE(0, 16);
  auto g = ft::rng(d + block);
  ft::random_kv<TestType> kv(g, 700, d, 16, 2, block);
  const auto queries = ft::random_floats(g, 3 * d);
  const auto q = floe::query_group::make(queries.data(), 3, d);
  const floe::exec::simd simd({arch});
  const token_range r{5, 690};
  std::vector<float> want(r.size()), got(r.size() + 1, std::numeric_limits<float>::quiet_NaN());
  INFO("arch " << floe::simd_arch_name(arch) << " d " << d << " block " << block);
  for (index_t h = 0; h < 3; ++h) {
    if (block) {
      floe::exec::scalar{}.score(kv.paged_view(), q, h, r, want.data());
      simd.score(kv.paged_view(), q, h, r, got.data());
    } else {
      floe::exec::scalar{}.score(kv.view(), q, h, r, want.data());
      simd.score(kv.view(), q, h, r, got.data());
    }
    CHECK(scores_off_bound(kv, q, h, r, got.data(), want) == 0);
    CHECK(std::isnan(got[r.size()]));  // nothing written past the range
  }
}

TEMPLATE_TEST_CASE("simd score_group matches the scalar reference for every head, nothing written past ld",
                   "[exec][simd]", float, floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t d = GENERATE(7, 64, 128);
  const index_t block = GENERATE(0, 16);
  const index_t heads = GENERATE(1, 4, 9);
  auto g = ft::rng(d + block + 100 * heads);
  ft::random_kv<TestType> kv(g, 1200, d, 16, 2, block);
  const auto queries = ft::random_floats(g, heads * d);
  const auto q = floe::query_group::make(queries.data(), heads, d);
  const floe::exec::simd simd({arch});
  const token_range r{3, 1191};
  const index_t ld = r.size() + 5;
  std::vector<float> want(r.size()), got(heads * ld, std::numeric_limits<float>::quiet_NaN());
  INFO("arch " << floe::simd_arch_name(arch) << " d " << d << " block " << block << " heads " << heads);
  if (block) simd.score_group(kv.paged_view(), q, r, got.data(), ld);
  else simd.score_group(kv.view(), q, r, got.data(), ld);
  for (index_t h = 0; h < heads; ++h) {
    if (block) floe::exec::scalar{}.score(kv.paged_view(), q, h, r, want.data());
    else floe::exec::scalar{}.score(kv.view(), q, h, r, want.data());
    CHECK(scores_off_bound(kv, q, h, r, got.data() + h * ld, want) == 0);
    for (index_t i = r.size(); i < ld; ++i) CHECK(std::isnan(got[h * ld + i]));  // the row's padding untouched
  }
  std::vector<float> z(10);
  CHECK_THROWS_WITH(simd.score_group(kv.view(), q, {0, 20}, z.data(), 10), Catch::Contains("ld"));
  CHECK_THROWS_WITH(simd.score_group(kv.view(), q, {0, 1201}, z.data(), 2000), Catch::Contains("range"));
}

namespace {
// A KvView with nothing but rows: the executor must fall back to reading row by row.
template <class T>
struct rows_only_view {
  using element_type = T;
  floe::kv_view<T> inner;
  index_t n() const { return inner.n(); }
  index_t d() const { return inner.d(); }
  index_t dv() const { return inner.dv(); }
  index_t key_stride() const { return inner.key_stride(); }
  index_t value_stride() const { return inner.value_stride(); }
  const T* key_row(index_t i) const { return inner.key_row(i); }
  const T* value_row(index_t i) const { return inner.value_row(i); }
};
static_assert(floe::KvView<rows_only_view<floe::half>>);
}  // namespace

TEST_CASE("simd attend and score read any KvView even one without for_each_run", "[exec][simd]") {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  auto g = ft::rng(31);
  ft::random_kv<floe::half> kv(g, 500, 64, 64, 5);
  const rows_only_view<floe::half> view{kv.view()};
  const auto queries = ft::random_floats(g, 4 * 64);
  const auto q = floe::query_group::make(queries.data(), 4, 64);
  const floe::exec::simd simd({arch});
  const std::vector<token_range> ranges{{0, 100}, {130, 131}, {200, 500}};
  floe::partial_set<double> want(4, 64);
  floe::partial_set<float> got(4, 64);
  floe::exec::scalar{}.attend(view, q, ranges, want);
  simd.attend(view, q, ranges, got);
  INFO("arch " << floe::simd_arch_name(arch));
  CHECK(ft::max_relative_error(got, want) <= 1e-5);
  std::vector<float> z_want(500), z_got(500);
  floe::exec::scalar{}.score(view, q, 3, {0, 500}, z_want.data());
  simd.score(view, q, 3, {0, 500}, z_got.data());
  double worst = 0;
  for (index_t i = 0; i < 500; ++i) worst = std::max(worst, std::abs(double(z_got[i]) - z_want[i]));
  CHECK(worst <= 1e-4);  // scores of magnitude ~1-3 in fp32
}

TEST_CASE("simd attend over a sorted index list equals attend over its ranges", "[exec][simd]") {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  auto g = ft::rng(41);
  ft::random_kv<floe::bfloat16> kv(g, 900, 128, 128, 0, 16);
  const auto queries = ft::random_floats(g, 8 * 128);
  const auto q = floe::query_group::make(queries.data(), 8, 128);
  std::vector<index_t> tokens;
  for (index_t i = 0; i < 900; ++i)
    if (g() % 3 == 0) tokens.push_back(i);  // singles and runs of consecutive indices
  std::vector<token_range> ranges;
  for (index_t t : tokens) ranges.push_back({t, t + 1});
  const floe::exec::simd simd({arch});
  floe::partial_set<double> want(8, 128);
  floe::partial_set<float> got(8, 128);
  floe::exec::scalar{}.attend(kv.paged_view(), q, ranges, want);
  simd.attend(kv.paged_view(), q, std::span<const index_t>(tokens), got);
  INFO("arch " << floe::simd_arch_name(arch) << " tokens " << tokens.size());
  CHECK(ft::max_relative_error(got, want) <= 1e-5);
  auto argument_of = [&](std::vector<index_t> bad) -> std::string {
    try {
      simd.attend(kv.paged_view(), q, std::span<const index_t>(bad), got);
    } catch (const floe::invalid_argument& e) {
      return e.argument();
    }
    return "(no error)";
  };
  CHECK(argument_of({3, 3}) == "tokens");
  CHECK(argument_of({5, 4}) == "tokens");
  CHECK(argument_of({0, 900}) == "tokens");
}

TEST_CASE("simd attend reads a paged view's whole blocks in pool order, in table order when repeated or spread",
          "[exec][simd]") {
  // Attention does not depend on the order of its rows, so the executor reads a shuffled
  // table's whole blocks by increasing pool index (and splits over threads in that order).
  // Every token must still come exactly once, and a table that names a block twice (or
  // spreads blocks far apart) keeps its order.
  INFO("seed " << ft::seed());
  auto g = ft::rng(211);
  const index_t block = 16, n = 1000, d = 64, blocks = (n + block - 1) / block;  // the last block partial
  const auto layout = GENERATE(as<std::string>{}, "shuffled", "repeated", "spread", "ordered");
  const index_t pool = layout == "spread" ? 200 * blocks : blocks + 5;
  std::vector<std::int32_t> table(blocks);
  std::vector<std::int32_t> ids(pool);
  for (index_t b = 0; b < pool; ++b) ids[b] = static_cast<std::int32_t>(b);
  std::shuffle(ids.begin(), ids.end(), g);
  for (index_t b = 0; b < blocks; ++b) table[b] = ids[b];
  if (layout == "repeated") table[7] = table[40];  // both whole blocks inside the ranges
  if (layout == "ordered") std::sort(table.begin(), table.end());
  const auto keys = ft::random_elements<floe::half>(g, pool * block * d);
  const auto values = ft::random_elements<floe::half>(g, pool * block * d);
  const floe::paged_kv_view<floe::half> kv(keys.data(), values.data(), pool, block, table, n, d, d);
  const std::vector<token_range> ranges = {{3, 40}, {64, 400}, {500, 999}};
  INFO("layout " << layout);

  std::vector<token_range> pieces;
  floe::simd_detail::for_blocks_in_pool_order(kv, std::span<const token_range>(ranges),
                                              [&](token_range r) { pieces.push_back(r); });
  std::vector<index_t> want_tokens, got_tokens;
  std::vector<const floe::half*> whole_blocks;
  for (const auto& r : ranges)
    for (index_t i = r.begin; i < r.end; ++i) want_tokens.push_back(i);
  for (const auto& r : pieces) {
    REQUIRE(r.begin / block == (r.end - 1) / block);  // a piece lies in one block
    for (index_t i = r.begin; i < r.end; ++i) got_tokens.push_back(i);
    if (r.size() == block) whole_blocks.push_back(kv.key_row(r.begin));
  }
  std::sort(got_tokens.begin(), got_tokens.end());
  CHECK(got_tokens == want_tokens);  // every token once
  std::vector<const floe::half*> table_order;
  for (const auto& r : ranges)
    for (index_t b = (r.begin + block - 1) / block; (b + 1) * block <= r.end; ++b) table_order.push_back(kv.key_row(b * block));
  if (layout == "shuffled") {
    CHECK(std::is_sorted(whole_blocks.begin(), whole_blocks.end()));
    CHECK(whole_blocks != table_order);
  } else {  // repeated and spread keep the table's order, and an ordered table is pool order
    if (layout == "ordered") CHECK(std::is_sorted(whole_blocks.begin(), whole_blocks.end()));
    CHECK(whole_blocks == table_order);
  }
  // Split-K cuts the pool-ordered pieces: each part reads a stretch of the pool.
  const auto parts = floe::simd_detail::split_ranges(floe::simd_detail::ranges_in_pool_order(kv, std::span<const token_range>(ranges)),
                                                    static_cast<index_t>(want_tokens.size()), 3);
  index_t split_tokens = 0;
  for (const auto& part : parts)
    for (const auto& r : part) split_tokens += r.size();
  CHECK(split_tokens == static_cast<index_t>(want_tokens.size()));

  const auto queries = ft::random_floats(g, 4 * d);
  const auto q = floe::query_group::make(queries.data(), 4, d);
  for (const auto arch : ft::runnable_archs()) {
    INFO("arch " << floe::simd_arch_name(arch));
    floe::partial_set<double> want(4, d);
    floe::partial_set<float> got(4, d);
    floe::exec::scalar{}.attend(kv, q, ranges, want);
    floe::thread_pool pool(3);
    floe::exec::simd(floe::exec::simd_options{arch, pool.hook(), 3, 16}).attend(kv, q, ranges, got);
    CHECK(ft::max_relative_error(got, want) <= 1e-5);
  }
}
