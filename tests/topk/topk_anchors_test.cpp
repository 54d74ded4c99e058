// topk_anchors with each scorer: full budget equals dense, the chosen set is the top k
// it claims to be, bounds hold, budgets resolve as documented, bad input is refused.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "floe/residual/feature_map.hpp"
#include "floe/select/scorers/exact_scan.hpp"
#include "floe/select/scorers/page_bounds.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "support/random_kv.hpp"
#include "topk/topk_support.hpp"

namespace {
using floe::index_t;
using floe::select::exact_scan;
using floe::select::page_bounds;
using floe::select::quantized_scan;
using floe::select::topk_anchors;
using floe::testing::dense_reference;
using floe::testing::worst_head_error;

static_assert(floe::Selector<topk_anchors<exact_scan>>);
static_assert(floe::Selector<topk_anchors<quantized_scan>>);
static_assert(floe::Selector<topk_anchors<page_bounds>>);
static_assert(floe::ResidualFor<floe::residual::feature_map<>, topk_anchors<quantized_scan>>);

template <class Scorer, class Residual, floe::KvView KV>
void check_full_budget(const KV& kv, std::mt19937_64& g, index_t heads) {
  const auto qd = floe::testing::random_floats(g, heads * kv.d(), 1.5f);
  const auto q = floe::query_group::make(qd.data(), heads, kv.d());
  floe::estimator<topk_anchors<Scorer>, Residual> est({3, 17, floe::budget::fraction(1.0), {}}, {});
  INFO("estimator " << est.name() << " n " << kv.n());
  floe::stats s;
  const auto got = floe::testing::decode_output(est, est.build(kv), kv, q, s);
  REQUIRE(worst_head_error(got, dense_reference(kv, q), heads, kv.dv()) <= 1e-12);
  REQUIRE(s.tokens_read == kv.n());
  REQUIRE(s.value_bytes == kv.n() * kv.dv() * sizeof(typename KV::element_type));
  REQUIRE(s.key_bytes == kv.n() * kv.d() * sizeof(typename KV::element_type));
}

template <class T>
void full_budget_all(std::uint64_t salt) {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(salt);
  for (auto [n, block] : {std::pair<index_t, index_t>{21, 0}, {700, 0}, {900, 16}}) {
    floe::testing::random_kv<T> data(g, n, 40, 24, 3, block);
    auto run = [&](const auto& kv) {
      check_full_budget<exact_scan, floe::residual::none>(kv, g, 3);
      check_full_budget<quantized_scan, floe::residual::none>(kv, g, 3);
      check_full_budget<page_bounds, floe::residual::none>(kv, g, 3);
      check_full_budget<exact_scan, floe::residual::feature_map<>>(kv, g, 3);
      check_full_budget<quantized_scan, floe::residual::feature_map<>>(kv, g, 1);
      check_full_budget<page_bounds, floe::residual::feature_map<>>(kv, g, 4);
    };
    if (data.paged()) run(data.paged_view());
    else run(data.view());
  }
}
}  // namespace

TEST_CASE("topk_anchors with a full budget equals dense attention", "[topk]") {
  full_budget_all<float>(1);
  full_budget_all<floe::half>(2);
  full_budget_all<floe::bfloat16>(3);
}

TEST_CASE("exact_scan keeps sink, tail and the top k of the middle", "[topk]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(10);
  const index_t n = 2000, d = 32, k = 37;
  floe::testing::random_kv<float> data(g, n, d, 16);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, d, 2.f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const topk_anchors<exact_scan> sel{4, 50, floe::budget::tokens(k), {}};
  topk_anchors<exact_scan>::selection out;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, out, s);
  REQUIRE(out.middle == floe::token_range{4, n - 50});
  REQUIRE(out.count() == 4 + 50 + k);
  REQUIRE(out.keys_counted);
  REQUIRE(s.key_bytes == n * d * sizeof(float));

  std::vector<float> z(n);
  floe::exec::scalar{}.score(kv, q, 0, {0, n}, z.data());
  std::vector<index_t> middle(n - 54);
  std::iota(middle.begin(), middle.end(), index_t{4});
  std::sort(middle.begin(), middle.end(), [&](index_t a, index_t b) { return z[a] > z[b]; });
  std::set<index_t> want(middle.begin(), middle.begin() + k);
  std::set<index_t> got;
  for (const auto& r : out.retrieved)
    for (index_t i = r.begin; i < r.end; ++i) got.insert(i);
  REQUIRE(got == want);
}

// Every scan kernel this CPU runs: the portable one always, AVX2 and AVX-512 VNNI where present.
std::vector<floe::scan_kernel> scan_kernels() {
  std::vector<floe::scan_kernel> k{floe::scan_kernel::portable};
  for (auto x : {floe::scan_kernel::avx2, floe::scan_kernel::avx512_vnni})
    if (floe::quantized_tile::available(x)) k.push_back(x);
  return k;
}

TEST_CASE("4-bit score bounds hold for every token, element type and block size", "[topk][quantized]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(11);
  auto check = [&](const auto& data, float key_offset) {
    const auto kv = data.view();
    for (const index_t block : {32, 64, 8, 40}) {  // 40: d = 64 and 70 end inside a block
      INFO("block_dims " << block);
      const auto idx = floe::quantized_keys::build(kv, block);
      REQUIRE(idx.bytes_per_token() == (kv.d() + block - 1) / block * (block / 2 + 4));
      const auto qd = floe::testing::random_floats(g, 3 * kv.d(), 3.f);
      const auto q = floe::query_group::make(qd.data(), 3, kv.d());
      const index_t n = kv.n();
      for (const auto kernel : scan_kernels()) {
        std::vector<float> center(3 * n), radius(3 * n), z(n);
        idx.scan(idx.prepare(q), 0, n, center.data(), radius.data(), n, kernel);
        double worst = 0, slack = 0;
        for (index_t h = 0; h < 3; ++h) {
          floe::exec::scalar{}.score(kv, q, h, {0, n}, z.data());
          for (index_t i = 0; i < n; ++i) {
            worst = std::max(worst, std::fabs(double(z[i]) - center[h * n + i]) / radius[h * n + i]);
            slack += radius[h * n + i] / n / 3;
          }
        }
        INFO("kernel " << static_cast<int>(kernel) << " key offset " << key_offset << " worst |z - center| / radius "
                       << worst << " mean radius " << slack);
        REQUIRE(worst <= 1.0);
        REQUIRE(worst >= 0.05);  // the bounds are not vacuous
      }
    }
  };
  for (float offset : {0.f, 40.f}) {
    floe::testing::random_kv<float> f(g, 1500, 70, 8, 0, 0, 2.f);
    floe::testing::random_kv<floe::half> h(g, 1500, 64, 8, 0, 0, 2.f);
    floe::testing::random_kv<floe::bfloat16> b(g, 1500, 128, 8, 0, 0, 2.f);
    for (auto& x : f.keys) x += offset;
    for (auto& x : h.keys) x = floe::half::from_float(x.to_float() + offset);
    for (auto& x : b.keys) x = floe::bfloat16::from_float(x.to_float() + offset);
    check(f, offset);
    check(h, offset);
    check(b, offset);
  }
}

TEST_CASE("the scan kernels agree to float rounding", "[topk][quantized]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(16);
  if (scan_kernels().size() < 3) WARN("this CPU lacks AVX2 or AVX-512 VNNI: " << scan_kernels().size() << " scan kernel(s) tested");
  // Cut tiles at both ends, whole tiles only, and more tiles than one VNNI run (64).
  for (const auto [d, begin, end] : {std::array<index_t, 3>{32, 5, 700}, {70, 5, 700}, {128, 5, 700},
                                     {128, 0, 1600}, {64, 16, 1599}}) {
    INFO("d " << d << " tokens [" << begin << ", " << end << ")");
    floe::testing::random_kv<floe::half> data(g, 1601, d, 8, 0, 0, 2.f);
    for (const index_t block : {32, 64, 24}) {
      INFO("block_dims " << block);
      const auto idx = floe::quantized_keys::build(data.view(), block);
      const auto qd = floe::testing::random_floats(g, 5 * d, 3.f);
      const auto p = idx.prepare(floe::query_group::make(qd.data(), 5, d));
      const index_t n = end - begin;
      std::vector<std::vector<float>> centers, radii;
      for (const auto kernel : scan_kernels()) {
        centers.emplace_back(5 * n);
        radii.emplace_back(5 * n);
        std::vector<float> maxima(5);
        idx.scan(p, begin, end, centers.back().data(), radii.back().data(), n, kernel, maxima.data());
        for (index_t h = 0; h < 5; ++h)
          REQUIRE(maxima[h] == *std::max_element(centers.back().begin() + h * n, centers.back().begin() + (h + 1) * n));
        std::vector<float> alone(5 * n);  // without radii (choosing by estimate): the same centers, bit for bit
        idx.scan(p, begin, end, alone.data(), nullptr, n, kernel);
        REQUIRE(alone == centers.back());
      }
      for (std::size_t k = 1; k < centers.size(); ++k)
        for (index_t i = 0; i < 5 * n; ++i) {
          REQUIRE(std::fabs(centers[k][i] - centers[0][i]) <= 1e-5f * radii[0][i]);
          REQUIRE(std::fabs(radii[k][i] - radii[0][i]) <= 1e-5f * radii[0][i]);
        }
    }
  }
  floe::testing::random_kv<floe::half> data(g, 100, 64, 8);
  const auto idx = floe::quantized_keys::build(data.view());
  std::vector<float> qd(64, 1.f), c(100), r(100);
  qd[3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(idx.prepare(floe::query_group::make(qd.data(), 1, 64)), Catch::Contains("query"));
  qd[3] = 1.f;
  REQUIRE_THROWS_WITH(idx.scan(idx.prepare(floe::query_group::make(qd.data(), 1, 64)), 0, 101, c.data(), r.data(), 100),
                      Catch::Contains("range"));
  for (const index_t block : {0, 4, 12, 520})
    REQUIRE_THROWS_WITH(floe::quantized_keys::build(data.view(), block), Catch::Contains("block_dims"));
  // A query prepared for 32-element blocks cannot scan an index of 64-element ones.
  const auto wide = floe::quantized_keys::build(data.view(), 64);
  REQUIRE_THROWS_WITH(wide.scan(idx.prepare(floe::query_group::make(qd.data(), 1, 64)), 0, 100, c.data(), r.data(), 100),
                      Catch::Contains("query"));
  REQUIRE_NOTHROW(wide.scan(wide.prepare(floe::query_group::make(qd.data(), 1, 64)), 0, 100, c.data(), r.data(), 100));
}

TEST_CASE("the scan's prefetch distance changes no estimate, and bad distances are refused", "[topk][quantized]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(17);
  floe::testing::random_kv<floe::half> data(g, 3000, 128, 8, 0, 0, 2.f);
  auto idx = floe::quantized_keys::build(data.view(), 64);
  const auto qd = floe::testing::random_floats(g, 4 * 128, 3.f);
  const auto p = idx.prepare(floe::query_group::make(qd.data(), 4, 128));
  // Cut tiles at both ends and runs of more than one VNNI call (64 tiles).
  const index_t begin = 7, end = 2990, n = end - begin;
  const auto kernels = scan_kernels();
  std::vector<std::vector<float>> first_c(kernels.size()), first_r(kernels.size());  // per kernel, at distance 0
  for (const index_t ahead : {0, 1, 16, 200, 4096}) {
    INFO("prefetch_tiles " << ahead);
    idx.set_prefetch_tiles(ahead);
    REQUIRE(idx.prefetch_tiles() == ahead);
    for (std::size_t k = 0; k < kernels.size(); ++k) {
      INFO("kernel " << static_cast<int>(kernels[k]));
      std::vector<float> c(4 * n), r(4 * n), maxima(4, -std::numeric_limits<float>::infinity());
      idx.scan(p, begin, end, c.data(), r.data(), n, kernels[k], maxima.data());
      if (ahead == 0) first_c[k] = c, first_r[k] = r;
      REQUIRE(c == first_c[k]);
      REQUIRE(r == first_r[k]);
      for (index_t h = 0; h < 4; ++h) REQUIRE(maxima[h] == *std::max_element(c.begin() + h * n, c.begin() + (h + 1) * n));
    }
  }
  REQUIRE_THROWS_WITH(idx.set_prefetch_tiles(4097), Catch::Contains("prefetch_tiles"));
  REQUIRE(idx.prefetch_tiles() == 4096);  // a refused setting leaves the last one
  for (const char* bad : {"", "-1", "x", "16 ", "4097", "99999", "1e3"})
    REQUIRE_THROWS_WITH(floe::quantized_tile::parse_prefetch_tiles(bad, "FLOE_SCAN_PREFETCH_TILES"),
                        Catch::Contains("FLOE_SCAN_PREFETCH_TILES"));
  REQUIRE(floe::quantized_tile::parse_prefetch_tiles("0", "x") == 0);
  REQUIRE(floe::quantized_tile::parse_prefetch_tiles("0016", "x") == 16);
  REQUIRE(floe::quantized_tile::parse_prefetch_tiles("4096", "x") == 4096);
  REQUIRE(floe::quantized_tile::default_prefetch_tiles() <= 4096);
}

TEST_CASE("kth_largest and top_k match a full sort, ties and all", "[topk][ranking]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(17);
  for (index_t n : {10, 5000, 20000, 100000, 100003}) {  // 100003: a tail after the last 16 keys
    for (int kind = 0; kind < 4; ++kind) {  // normal, few distinct values, ascending, constant
      std::vector<float> x(n);
      std::normal_distribution<float> normal(0.f, 1.f);
      for (index_t i = 0; i < n; ++i)
        x[i] = kind == 0 ? normal(g) : kind == 1 ? std::floor(4 * normal(g)) : kind == 2 ? float(i) : 3.f;
      std::vector<float> sorted = x;
      std::sort(sorted.begin(), sorted.end(), std::greater<float>{});
      for (index_t k : {index_t{1}, n / 20 + 1, n / 5, n}) {
        INFO("n " << n << " kind " << kind << " k " << k);
        REQUIRE(floe::select::ranking::kth_largest(x.data(), n, k) == sorted[k - 1]);
        const auto top = floe::select::ranking::top_k(x.data(), n, k);
        REQUIRE(top.size() == k);
        REQUIRE(std::is_sorted(top.begin(), top.end()));
        std::vector<index_t> order(n);
        std::iota(order.begin(), order.end(), index_t{0});
        std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return x[a] > x[b]; });
        order.resize(k);
        std::sort(order.begin(), order.end());
        REQUIRE(top == order);
      }
    }
  }
}

TEST_CASE("kth_largest_radix matches a full sort over wide, narrow and tied keys", "[topk][ranking]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(29);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  const float inf = std::numeric_limits<float>::infinity();
  auto ulps_above = [](float x, int steps) {
    while (steps-- > 0) x = std::nextafter(x, 0.f);
    return x;
  };
  for (index_t n : {1, 2, 127, 128, 129, 1000, 10328, 70000}) {
    for (int kind = 0; kind < 6; ++kind) {  // normal, wide exponents, one ulp apart, signed zeros and infinities,
                                            // a dense cluster with a far tail, two values
      std::vector<float> x(n);
      for (index_t i = 0; i < n; ++i) {
        const float u = unit(g);
        x[i] = kind == 0   ? normal(g)
               : kind == 1 ? std::ldexp(normal(g), static_cast<int>(unit(g) * 200) - 100)
               : kind == 2 ? ulps_above(-7.f, static_cast<int>(i % 5))
               : kind == 3 ? (u < 0.3f ? 0.f : u < 0.6f ? -0.f : u < 0.7f ? -inf : u < 0.8f ? inf : normal(g))
               : kind == 4 ? (u < 0.99f ? -3.f + 1e-6f * normal(g) : 50.f * normal(g))
                           : (u < 0.5f ? 1.f : 2.f);
      }
      const std::vector<float> before = x;
      std::vector<float> sorted = x;
      std::sort(sorted.begin(), sorted.end(), std::greater<float>{});
      for (index_t k : {index_t{1}, index_t{2}, n / 3 + 1, n / 2, n - 1, n}) {
        if (k < 1 || k > n) continue;
        INFO("n " << n << " kind " << kind << " k " << k);
        REQUIRE(floe::select::ranking::kth_largest_radix(x.data(), n, k) == sorted[k - 1]);
      }
      REQUIRE(std::memcmp(x.data(), before.data(), n * sizeof(float)) == 0);  // the keys are the caller's
      REQUIRE(floe::select::ranking::kth_largest_radix(x.data(), n, n + 1) == -inf);
      REQUIRE(floe::select::ranking::kth_largest_radix(x.data(), n, 0) == -inf);
    }
  }
}

TEST_CASE("keep_reaching's AVX-512 and portable loops keep the same keys", "[topk][ranking]") {
#ifdef FLOE_RANKING_X86
  if (!floe::select::ranking::detail::keep_reaching_avx512_available()) {
    WARN("this CPU has no AVX-512: only the portable loop runs");
    return;
  }
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(23);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (index_t n : {0, 1, 15, 16, 17, 31, 1000, 100003}) {
    std::vector<float> x(n);
    for (float& v : x) v = std::floor(8 * normal(g)) / 8;  // ties with the bar
    for (float bar : {-std::numeric_limits<float>::infinity(), -1.f, 0.f, 0.125f, 1.5f, 3.f,
                      std::numeric_limits<float>::infinity()}) {
      INFO("n " << n << " bar " << bar);
      std::vector<index_t> at_p(n + 16, 7), at_v(n + 16, 7);
      std::vector<float> kept_p(n + 16, -9.f), kept_v(n + 16, -9.f);
      const index_t m = floe::select::ranking::detail::keep_reaching_portable(x.data(), n, bar, at_p.data(), kept_p.data());
      REQUIRE(floe::select::ranking::detail::keep_reaching_avx512(x.data(), n, bar, at_v.data(), kept_v.data()) == m);
      REQUIRE(std::vector<index_t>(at_v.begin(), at_v.begin() + m) == std::vector<index_t>(at_p.begin(), at_p.begin() + m));
      REQUIRE(std::vector<float>(kept_v.begin(), kept_v.begin() + m) == std::vector<float>(kept_p.begin(), kept_p.begin() + m));
      for (index_t j = 0; j < m; ++j) REQUIRE(x[at_v[j]] >= bar);
      REQUIRE(m == static_cast<index_t>(std::count_if(x.begin(), x.end(), [&](float v) { return v >= bar; })));
    }
  }
#else
  WARN("not an x86-64 build: only the portable loop runs");
#endif
}

TEST_CASE("quantized_scan candidates contain the true top k when sized by the bounds", "[topk][quantized]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(12);
  for (index_t heads : {1, 3}) {
    for (index_t k : {1, 10, 200}) {
      const index_t n = 3000, d = 64;
      floe::testing::random_kv<floe::half> data(g, n, d, 8);
      const auto kv = data.view();
      const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
      const auto q = floe::query_group::make(qd.data(), heads, d);
      const quantized_scan scorer{0.0};  // re-rank everything the bounds admit
      const auto idx = scorer.build(kv);
      const floe::token_range middle{4, n - 64};
      floe::stats s;
      const auto cs = scorer.candidates(idx, q, middle, k, floe::budget::tokens(k), s);
      // The true shared score, with the offsets the scan used.
      std::vector<float> z(heads * middle.size()), shared(middle.size());
      for (index_t h = 0; h < heads; ++h) floe::exec::scalar{}.score(kv, q, h, middle, z.data() + h * middle.size());
      floe::select::ranking::shared_scores(z.data(), heads, middle.size(), middle.size(), cs.offsets, shared.data());
      const auto truth = floe::select::ranking::top_k(shared.data(), middle.size(), k);
      const std::set<index_t> cand(cs.tokens.begin(), cs.tokens.end());
      INFO("heads " << heads << " k " << k << " candidates " << cand.size());
      for (index_t i : truth) REQUIRE(cand.count(middle.begin + i) == 1);
      REQUIRE(cand.size() < middle.size());  // and the bounds did prune
      REQUIRE(s.summary_bytes == middle.size() * idx.bytes_per_token());

      // Choosing with the same scorer returns exactly the true top k.
      floe::selection out;
      floe::stats s2;
      REQUIRE(scorer.choose(idx, kv, q, floe::exec::scalar{}, middle, k, floe::budget::tokens(k), out, s2));
      std::set<index_t> got;
      for (const auto& r : out.ranges)
        for (index_t i = r.begin; i < r.end; ++i) got.insert(i - middle.begin);
      REQUIRE(got == std::set<index_t>(truth.begin(), truth.end()));
      REQUIRE(s2.key_bytes == cand.size() * d * sizeof(floe::half));
    }
  }
}

TEST_CASE("quantized_scan with rerank_factor 1 keeps the k best estimates and reads no keys", "[topk][quantized]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(18);
  const index_t n = 3000, d = 64, heads = 3, k = 150;
  floe::testing::random_kv<floe::half> data(g, n, d, 8);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, heads * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  const quantized_scan scorer{1.0};
  const auto idx = scorer.build(kv);
  const floe::token_range middle{4, n - 64};
  topk_anchors<quantized_scan>::selection out;
  floe::stats s;
  REQUIRE_FALSE(scorer.choose(idx, kv, q, floe::exec::scalar{}, middle, k, floe::budget::tokens(k), out, s));
  REQUIRE(s.key_bytes == 0);
  REQUIRE(out.estimates.size() == heads * middle.size());
  std::vector<float> e(heads * middle.size()), r(e.size()), shared(middle.size());
  idx.scan(idx.prepare(q), middle.begin, middle.end, e.data(), r.data(), middle.size());
  REQUIRE(std::equal(e.begin(), e.end(), out.estimates.begin(), out.estimates.end()));
  floe::select::ranking::shared_scores(e.data(), heads, middle.size(), middle.size(),
                                       floe::select::ranking::head_maxima(e.data(), heads, middle.size(), middle.size()),
                                       shared.data());
  std::set<index_t> want;
  for (index_t i : floe::select::ranking::top_k(shared.data(), middle.size(), k)) want.insert(middle.begin + i);
  std::set<index_t> got;
  for (const auto& range : out.ranges)
    for (index_t i = range.begin; i < range.end; ++i) got.insert(i);
  REQUIRE(got == want);
}

TEST_CASE("page bounds hold and whole pages are read", "[topk][page_bounds]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(13);
  const index_t n = 1000, d = 48;
  floe::testing::random_kv<floe::bfloat16> data(g, n, d, 8, 0, 0, 3.f);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, 2 * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), 2, d);
  const auto idx = floe::page_bounds_index::build(kv, 16);
  std::vector<float> z(n);
  for (index_t h = 0; h < 2; ++h) {
    floe::exec::scalar{}.score(kv, q, h, {0, n}, z.data());
    for (index_t i = 0; i < n; ++i) REQUIRE(z[i] <= idx.upper_bound(q, h, i / 16));
  }
  const topk_anchors<page_bounds> sel{5, 30, floe::budget::tokens(100), {16}};
  topk_anchors<page_bounds>::selection out;
  floe::stats s;
  sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, out, s);
  index_t retrieved = 0;
  for (const auto& r : out.retrieved) {
    retrieved += r.size();
    // every retrieved run is made of pages, clipped only at the middle's ends
    REQUIRE((r.begin % 16 == 0 || r.begin == out.middle.begin));
    REQUIRE((r.end % 16 == 0 || r.end == out.middle.end));
  }
  REQUIRE(retrieved >= 100);
  REQUIRE(retrieved < 100 + 16);
  REQUIRE(!out.keys_counted);
  REQUIRE(s.summary_bytes == ((n - 30 - 1) / 16 + 1 - 5 / 16) * idx.bytes_per_page());
}

TEST_CASE("top-p budgets reach the estimated mass within floor and cap", "[topk][budget]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(14);
  const index_t n = 3000, d = 32;
  floe::testing::random_kv<float> data(g, n, d, 8);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, d, 4.f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  std::vector<float> z(n);
  floe::exec::scalar{}.score(kv, q, 0, {0, n}, z.data());
  auto retrieved_of = [&](const auto& sel) {
    typename std::decay_t<decltype(sel)>::selection out;
    floe::stats s;
    sel.select(sel.build(kv), kv, q, floe::exec::scalar{}, out, s);
    return out;
  };
  // exact_scan with p = 0.5: the retrieved tokens hold at least half of the middle's weight,
  // and one token fewer would not.
  const auto out = retrieved_of(topk_anchors<exact_scan>{4, 64, floe::budget::top_p(0.5), {}});
  const float top = *std::max_element(z.begin() + 4, z.end() - 64);
  double total = 0, got = 0, smallest = 1e300;
  for (index_t i = 4; i < n - 64; ++i) total += std::exp(double(z[i]) - top);
  for (const auto& r : out.retrieved)
    for (index_t i = r.begin; i < r.end; ++i) {
      got += std::exp(double(z[i]) - top);
      smallest = std::min(smallest, std::exp(double(z[i]) - top));
    }
  REQUIRE(got >= 0.5 * total * (1 - 1e-9));
  REQUIRE(got - smallest < 0.5 * total);
  // floor and cap bind.
  const auto floored = retrieved_of(topk_anchors<quantized_scan>{4, 64, floe::budget::top_p(1e-9, 300, 400), {}});
  REQUIRE(floored.count() == 4 + 64 + 300);
  const auto capped = retrieved_of(topk_anchors<exact_scan>{4, 64, floe::budget::top_p(0.999999, 0, 20), {}});
  REQUIRE(capped.count() == 4 + 64 + 20);
  const auto paged = retrieved_of(topk_anchors<page_bounds>{4, 64, floe::budget::top_p(0.999999, 0, 64), {16}});
  REQUIRE(paged.count() <= 4 + 64 + 64 + 15);
}

TEST_CASE("the scorers' indexes append as they rebuild", "[topk][append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(15);
  const index_t n = 1300, d = 40;
  floe::testing::random_kv<floe::half> data(g, n, d, 8);
  const floe::kv_view<floe::half> early(data.keys.data(), data.values.data(), 1000, d, 8);
  const auto kv = data.view();
  const auto qd = floe::testing::random_floats(g, 2 * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), 2, d);

  auto grown = floe::quantized_keys::build(early);
  for (index_t m = 1001; m <= n; m += 7) grown.append(floe::kv_view<floe::half>(data.keys.data(), data.values.data(), std::min(m, n), d, 8));
  grown.append(kv);
  const auto whole = floe::quantized_keys::build(kv);
  REQUIRE(grown.tokens() == n);
  std::vector<float> c1(2 * n), r1(2 * n), c2(2 * n), r2(2 * n);
  grown.scan(grown.prepare(q), 0, n, c1.data(), r1.data(), n);
  whole.scan(whole.prepare(q), 0, n, c2.data(), r2.data(), n);
  REQUIRE(c1 == c2);
  REQUIRE(r1 == r2);

  auto pages = floe::page_bounds_index::build(early, 16);
  pages.append(floe::kv_view<floe::half>(data.keys.data(), data.values.data(), 1005, d, 8));
  pages.append(kv);
  const auto pages_whole = floe::page_bounds_index::build(kv, 16);
  REQUIRE(pages.pages() == pages_whole.pages());
  for (index_t p = 0; p < pages.pages(); ++p)
    for (index_t h = 0; h < 2; ++h) REQUIRE(pages.upper_bound(q, h, p) == pages_whole.upper_bound(q, h, p));

  // A stale selector index: tokens it does not cover are attended with the tail.
  const topk_anchors<quantized_scan> sel{4, 16, floe::budget::fraction(0.1), {}};
  topk_anchors<quantized_scan>::selection out;
  floe::stats s;
  sel.select(sel.build(early), kv, q, floe::exec::scalar{}, out, s);
  REQUIRE(out.middle == floe::token_range{4, 1000});
  REQUIRE(out.ranges.back().begin <= 1000);  // the retrieved token 999 may join the tail
  REQUIRE(out.ranges.back().end == n);
}

TEST_CASE("topk_anchors refuses bad input naming the argument", "[topk][bad_input]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(16);
  const index_t n = 200, d = 16;
  floe::testing::random_kv<float> data(g, n, d, 8);
  const auto kv = data.view();
  auto qd = floe::testing::random_floats(g, d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 1, d);
  const auto arg_of = [](auto&& f) { return floe::testing::argument_of(f); };
  // S + W >= n: at build and at select.
  const topk_anchors<exact_scan> wide{100, 100, floe::budget::fraction(0.1), {}};
  REQUIRE(arg_of([&] { (void)wide.build(kv); }) == "window");
  const topk_anchors<exact_scan> fine{4, 16, floe::budget::tokens(181), {}};
  const auto idx = fine.build(kv);
  topk_anchors<exact_scan>::selection out;
  floe::stats s;
  REQUIRE(arg_of([&] { wide.select(idx, kv, q, floe::exec::scalar{}, out, s); }) == "window");
  // A budget larger than the middle region (180 tokens).
  REQUIRE(arg_of([&] { fine.select(idx, kv, q, floe::exec::scalar{}, out, s); }) == "budget");
  const topk_anchors<quantized_scan> over{4, 16, floe::budget::fraction(1.5), {}};
  REQUIRE(arg_of([&] { over.select(over.build(kv), kv, q, floe::exec::scalar{}, out, s); }) == "budget");
  // A NaN query, to the selector directly and through the estimator.
  qd[3] = std::nanf("");
  const topk_anchors<quantized_scan> ok{4, 16, floe::budget::tokens(20), {}};
  REQUIRE(arg_of([&] { ok.select(ok.build(kv), kv, q, floe::exec::scalar{}, out, s); }) == "query");
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::feature_map<>> est(ok, {});
  std::vector<double> o(8, -7.0);
  REQUIRE(arg_of([&] {
            est.decode(est.build(kv), kv, q, floe::exec::scalar{}, floe::output_group<double>{o.data(), 1, 8, 0}, s);
          }) == "query");
  REQUIRE(std::all_of(o.begin(), o.end(), [](double x) { return x == -7.0; }));
}

TEST_CASE("estimator::append keeps topk_anchors and feature_map decoding as the cache grows", "[topk][append]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(17);
  const index_t n0 = 600, n1 = 680, d = 32, dv = 16;
  floe::testing::random_kv<floe::half> data(g, n1, d, dv);
  auto view = [&](index_t n) { return floe::kv_view<floe::half>(data.keys.data(), data.values.data(), n, d, dv); };
  const auto qd = floe::testing::random_floats(g, 2 * d, 1.f);
  const auto q = floe::query_group::make(qd.data(), 2, d);
  const auto sel = topk_anchors<quantized_scan>::with_budget(60);
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::none> only(sel, {});
  floe::estimator<topk_anchors<quantized_scan>, floe::residual::feature_map<>> completed(sel, {});
  auto s1 = only.build(view(n0));
  auto s2 = completed.build(view(n0));
  const auto stale = completed.build(view(n0));
  floe::stats io;
  for (index_t n = n0 + 1; n <= n1; ++n) {  // one decoded token per step
    only.append(s1, view(n));
    completed.append(s2, view(n));
    const auto out = floe::testing::decode_output(completed, s2, view(n), q, io);
    for (double x : out) REQUIRE(std::isfinite(x));
  }
  // Selection only: the grown state decodes exactly as a fresh one.
  REQUIRE(floe::testing::decode_output(only, s1, view(n1), q, io) ==
          floe::testing::decode_output(only, only.build(view(n1)), view(n1), q, io));
  // Without append, tokens that left the window are in neither the exact set nor the summary.
  try {
    (void)floe::testing::decode_output(completed, stale, view(n1), q, io);
    FAIL("no error");
  } catch (const floe::invalid_argument& e) {
    REQUIRE(e.argument() == "index");
  }
}
