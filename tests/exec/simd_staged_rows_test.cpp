// Short runs of rows are copied together before the kernel reads them
// (simd_options::stage_short_runs, floe/exec/simd/staged_rows.hpp). The copy must change no
// value: staged and unstaged results agree bit for bit, and the staged one matches the scalar reference.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"
#include "simd_test_support.hpp"
#include "support/random_kv.hpp"

using floe::index_t;
using floe::token_range;
namespace ft = floe::testing;

TEMPLATE_TEST_CASE("simd attend gives the same bits with short runs staged or read in place", "[exec][simd]", float,
                   floe::half, floe::bfloat16) {
  INFO("seed " << ft::seed());
  const auto arch = GENERATE(from_range(ft::runnable_archs()));
  const index_t d = GENERATE(24, 72, 128);
  const index_t dv = d == 72 ? 40 : d;  // dv != d, and a tail past the last vector
  const index_t pad = GENERATE(0, 3);   // rows 3 elements apart: off a line
  const index_t block = GENERATE(0, 16);
  const index_t threads = GENERATE(1, 2);
  const index_t heads = 4, n = 8000;
  auto g = ft::rng(static_cast<std::uint64_t>(d * 100 + pad * 10 + block));
  ft::random_kv<TestType> kv(g, n, d, dv, pad, block);
  // Runs of 1-3 tokens with gaps: several chunks of the staging buffer and batches of runs.
  std::vector<token_range> ranges;
  for (index_t b = std::uniform_int_distribution<index_t>(0, 5)(g); b + 3 <= n;) {
    const index_t len = std::uniform_int_distribution<index_t>(1, 3)(g);
    ranges.push_back({b, b + len});
    b += len + std::uniform_int_distribution<index_t>(1, 12)(g);
  }
  const auto queries = ft::random_floats(g, heads * (d + pad));
  const auto q = floe::query_group::make(queries.data(), heads, d, d + pad);
  INFO("arch " << floe::simd_arch_name(arch) << " d " << d << " dv " << dv << " pad " << pad << " block " << block
               << " threads " << threads << " runs " << ranges.size());
  floe::thread_pool pool(threads);
  floe::exec::simd_options staged_opt{arch, pool.hook(), threads, 256};  // 2 threads: split-K pieces
  floe::exec::simd_options in_place_opt = staged_opt;
  in_place_opt.stage_short_runs = false;
  const floe::exec::simd staged(staged_opt), in_place(in_place_opt);
  floe::partial_set<float> a(heads, dv), b(heads, dv);
  floe::partial_set<double> want(heads, dv);
  if (block) {
    staged.attend(kv.paged_view(), q, ranges, a);
    in_place.attend(kv.paged_view(), q, ranges, b);
    floe::exec::scalar{}.attend(kv.paged_view(), q, ranges, want);
  } else {
    staged.attend(kv.view(), q, ranges, a);
    in_place.attend(kv.view(), q, ranges, b);
    floe::exec::scalar{}.attend(kv.view(), q, ranges, want);
  }
  CHECK(ft::max_relative_error(a, want) <= 1e-5);
  for (index_t h = 0; h < heads; ++h) {
    CHECK(std::memcmp(&a.m(h), &b.m(h), sizeof(float)) == 0);
    CHECK(std::memcmp(&a.l(h), &b.l(h), sizeof(float)) == 0);
    CHECK(std::memcmp(a.a(h), b.a(h), dv * sizeof(float)) == 0);
  }
}
