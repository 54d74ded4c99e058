// mog_clusters + gaussian_moments: a full budget equals dense; partial budgets read what
// they say, leave every other token to exactly one residual group, and beat `none`.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

#include "floe/core/concepts.hpp"
#include "mog/mog_support.hpp"

using namespace floe;
using floe::testing::random_kv;

static_assert(Selector<select::mog_clusters>);
static_assert(ResidualFor<residual::gaussian_moments, select::mog_clusters>);
static_assert(ResidualFor<residual::none, select::mog_clusters>);
static_assert(!ResidualFor<residual::gaussian_moments, select::dense>, "gaussian_moments needs Gaussian groups");

namespace {

template <KvElement T>
void full_budget_equals_dense(std::uint64_t salt) {
  INFO("seed " << floe::testing::seed() << " type " << element_name<T>());
  auto g = floe::testing::rng(salt);
  for (auto [n, block, heads] : {std::tuple<index_t, index_t, index_t>{1, 0, 1}, {333, 0, 4}, {2000, 0, 4}, {1500, 16, 2}}) {
    INFO("n " << n << " block " << block << " heads " << heads);
    random_kv<T> kv(g, n, 32, 24, 1, block);
    const auto qd = floe::testing::random_floats(g, heads * 32, 2.f);
    const auto q = query_group::make(qd.data(), heads, 32);
    for (const budget b : {budget::fraction(1.0), budget::tokens(n), budget::top_p(1.0)}) {
      const floe::testing::mog est(floe::testing::mog_selector(b), {});
      stats s;
      auto run = [&](const auto& view) {
        const auto out = floe::testing::decode(est, est.build(view), view, q, s);
        REQUIRE(floe::testing::worst_head_error(out, floe::testing::dense_reference(view, q), heads, 24) <= 1e-6);
      };
      if (kv.paged()) run(kv.paged_view());
      else run(kv.view());
      REQUIRE(s.tokens_read == n);
      REQUIRE(s.summary_bytes == 0);
    }
  }
}

// A clustered float cache of 3000 tokens (d 32, dv 16), a 5 % MoG selector, its index and
// a GQA-4 query; q points into qd, so the case stays where it was built.
struct clustered_case {
  std::mt19937_64 g;
  random_kv<float> kv;
  select::mog_clusters sel = floe::testing::mog_selector(budget::fraction(0.05));
  mog_index idx;
  std::vector<float> qd;
  query_group q;
  explicit clustered_case(std::uint64_t salt)
      : g(floe::testing::rng(salt)), kv(g, 3000, 32, 16),
        idx((floe::testing::make_clustered(kv, g, 20), sel.build(kv.view()))),
        qd(floe::testing::random_floats(g, 4 * 32, 1.f)), q(query_group::make(qd.data(), 4, 32)) {}
  clustered_case(const clustered_case&) = delete;
  clustered_case& operator=(const clustered_case&) = delete;
};

}  // namespace

TEST_CASE("mog: full budget equals dense (float)", "[mog]") { full_budget_equals_dense<float>(711); }
TEST_CASE("mog: full budget equals dense (half)", "[mog]") { full_budget_equals_dense<half>(712); }
TEST_CASE("mog: full budget equals dense (bfloat16)", "[mog]") { full_budget_equals_dense<bfloat16>(713); }

TEST_CASE("mog: a partial budget reads at most its tokens, and every other token is estimated once", "[mog]") {
  INFO("seed " << floe::testing::seed());
  const clustered_case c(714);
  const auto view = c.kv.view();
  const auto& sel = c.sel;
  const auto& idx = c.idx;
  const auto& q = c.q;
  select::mog_clusters::selection out;
  stats s;
  sel.select(idx, view, q, exec::scalar{}, out, s);
  validate_ranges(out.ranges, view.n());
  REQUIRE(out.count() <= 150);
  REQUIRE(out.count() > 0);
  REQUIRE(s.summary_bytes >= idx.clusters() * (2 * 32 * sizeof(half) + 3 * sizeof(float)));

  std::vector<int> cover(view.n(), 0);
  for (const auto& r : out.ranges)
    for (index_t i = r.begin; i < r.end; ++i) ++cover[i];
  for (auto gid : out.residual_groups) {
    const bool cluster = gid < idx.clusters();
    const index_t s0 = cluster ? idx.first_subcluster(gid) : gid - idx.clusters();
    const index_t s1 = cluster ? idx.first_subcluster(gid + 1) : s0 + 1;
    for (index_t sub = s0; sub < s1; ++sub)
      for (auto p : idx.members(sub)) ++cover[p];
  }
  REQUIRE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }));

  // The hints' log-masses are the Gaussian formula (variance term times its fitted factor), for every head.
  const index_t groups = out.residual_groups.size();
  REQUIRE(out.residual_log_mass.size() == 4 * groups);
  for (index_t h = 0; h < 4; ++h)
    for (index_t j = 0; j < groups; j += 7) {
      const auto gid = out.residual_groups[j];
      const double want = floe::testing::fitted_log_mass(idx, gid, q.row(h), 32, q.scale);
      REQUIRE(out.residual_log_mass[h * groups + j] == Approx(want).margin(1e-4 * (1 + std::abs(want))));
    }
}

// variance_scale c multiplies the variance term of the hints: log n + s q.mu + c f_g s^2/2 sum q^2 var
// (f_g: the group's fitted factor).
TEST_CASE("mog: variance_scale tempers the variance term of every estimate, and bad values (and bad optimism) are refused", "[mog]") {
  INFO("seed " << floe::testing::seed());
  clustered_case c(721);
  const auto view = c.kv.view();
  auto& sel = c.sel;
  const auto& idx = c.idx;
  const auto& q = c.q;
  for (double scale : {0.5, 0.0}) {
    sel.variance_scale = scale;
    select::mog_clusters::selection out;
    stats s;
    sel.select(idx, view, q, exec::scalar{}, out, s);
    const index_t groups = out.residual_groups.size();
    REQUIRE(groups > 0);
    for (index_t h = 0; h < 4; ++h)
      for (index_t j = 0; j < groups; j += 5) {
        const double want = floe::testing::fitted_log_mass(idx, out.residual_groups[j], q.row(h), 32, q.scale, scale);
        REQUIRE(out.residual_log_mass[h * groups + j] == Approx(want).margin(1e-4 * (1 + std::abs(want))));
      }
  }
  const auto refused = [&](const char* argument) {
    select::mog_clusters::selection out;
    stats s;
    try {
      sel.select(idx, view, q, exec::scalar{}, out, s);
      FAIL(argument << " accepted");
    } catch (const floe::invalid_argument& e) {
      REQUIRE(e.argument() == argument);
    }
  };
  for (double bad : {-0.5, std::nan("")}) {
    sel.variance_scale = bad;
    refused("variance_scale");
  }
  sel.variance_scale = 1.0;
  for (double bad : {-1.0, std::numeric_limits<double>::infinity()}) {
    sel.optimism = bad;
    refused("optimism");
  }
}

// with_budget's outlier share caps the exact outliers at that share of the budget's tokens
// (and 2 % of n); the index then holds at most that many. A share outside [0, 1] is refused.
TEST_CASE("mog: the outlier share caps the outliers of with_budget, and a bad share is refused", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(720);
  const index_t n = 20000, d = 32;
  random_kv<float> kv(g, n, d, 8);
  floe::testing::make_clustered(kv, g, 12);
  for (index_t i = 0; i < n; i += 50) kv.keys[i * d + 3] += 25.f;  // 400 far keys: more than any cap here
  const budget b = budget::fraction(0.05);  // 1000 tokens
  const auto outliers = [&](double share) {
    const auto sel = select::mog_clusters::with_budget(b, n, share);
    REQUIRE(sel.config.outlier_fraction == Approx(std::min(0.02, share * 1000.0 / n)));
    return sel.build(kv.view()).outliers().size();
  };
  const index_t half = outliers(select::mog_clusters::outlier_share), lean = outliers(select::mog_clusters::lean_outlier_share);
  INFO("outliers at share 0.5: " << half << ", at 0.1: " << lean);
  CHECK(half > 100);
  CHECK(half <= 400);  // the cap: 2 % of n
  CHECK(lean <= 100);  // 0.1 of 1000
  CHECK(lean >= 90);
  CHECK(outliers(0.0) == 0);
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    try {
      (void)select::mog_clusters::with_budget(b, n, bad);
      FAIL("outlier share " << bad << " accepted");
    } catch (const floe::invalid_argument& e) {
      CHECK(e.argument() == "outlier_share");
    }
  }
}

TEST_CASE("mog: the Gaussian residual beats dropping it (mog_clusters+none) at equal reads", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(715);
  random_kv<float> kv(g, 4000, 32, 16);
  floe::testing::make_clustered(kv, g, 30, 0.7f, 0.5f);
  const auto view = kv.view();
  const auto sel = floe::testing::mog_selector(budget::fraction(0.05));
  const floe::testing::mog with(sel, {});
  const floe::testing::mog_none without(sel, {});
  const auto st = with.build(view);
  const floe::testing::mog_none::state st_none{st.selector_index, {}};
  double err_with = 0, err_without = 0;
  for (int trial = 0; trial < 10; ++trial) {
    const auto qd = floe::testing::random_floats(g, 2 * 32, 1.f);
    const auto q = query_group::make(qd.data(), 2, 32);
    const auto want = floe::testing::dense_reference(view, q);
    stats a, b;
    err_with += floe::testing::worst_head_error(floe::testing::decode(with, st, view, q, a), want, 2, 16);
    err_without += floe::testing::worst_head_error(floe::testing::decode(without, st_none, view, q, b), want, 2, 16);
    REQUIRE(a.tokens_read == b.tokens_read);
    REQUIRE(a.bytes_read() > b.bytes_read());  // the residual reads value means
  }
  REQUIRE(err_with < 0.5 * err_without);
}

TEST_CASE("mog: identical keys are estimated exactly at any budget (up to fp16 summaries)", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(716);
  random_kv<float> kv(g, 800, 16, 8);
  for (index_t i = 1; i < kv.n; ++i) std::copy_n(kv.keys.begin(), 16, kv.keys.begin() + static_cast<std::ptrdiff_t>(i * 16));
  const auto view = kv.view();
  const auto qd = floe::testing::random_floats(g, 3 * 16, 3.f);
  const auto q = query_group::make(qd.data(), 3, 16);
  for (const budget b : {budget::tokens(0), budget::tokens(1), budget::fraction(0.1)}) {
    const floe::testing::mog est(floe::testing::mog_selector(b), {});
    stats s;
    const auto out = floe::testing::decode(est, est.build(view), view, q, s);
    // The value mean is stored in fp16: 2^-12 relative rounding per element.
    REQUIRE(floe::testing::worst_head_error(out, floe::testing::dense_reference(view, q), 3, 8) <= 1e-3);
  }
}

TEST_CASE("mog: a budget below one subcluster reads nothing and estimates everything", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(717);
  random_kv<float> kv(g, 2000, 16, 8);
  floe::testing::make_clustered(kv, g, 10);
  const auto view = kv.view();
  const auto qd = floe::testing::random_floats(g, 2 * 16, 0.5f);
  const auto q = query_group::make(qd.data(), 2, 16);
  mog_config cfg;
  cfg.outlier_fraction = 0;  // no clusters of one token, which would fit
  cfg.sinks = 0;
  {  // one token of budget: at most one token read (a subcluster of one may fit), output finite
    const floe::testing::mog one(floe::testing::mog_selector(budget::tokens(1), cfg), {});
    stats s;
    const auto out = floe::testing::decode(one, one.build(view), view, q, s);
    REQUIRE(s.tokens_read <= 1);
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
  }
  const floe::testing::mog est(floe::testing::mog_selector(budget::tokens(0), cfg), {});
  const auto st = est.build(view);
  stats s;
  const auto out = floe::testing::decode(est, st, view, q, s);
  REQUIRE(s.tokens_read == 0);
  // Reference: the Gaussian estimate of every group the selection left, merged in double.
  select::mog_clusters::selection sel;
  stats ignored;
  est.selector().select(st.selector_index, view, q, exec::scalar{}, sel, ignored);
  REQUIRE(sel.ranges.empty());
  const mog_index& idx = st.selector_index;
  for (index_t h = 0; h < 2; ++h) {
    std::vector<double> lam;
    for (auto gid : sel.residual_groups)
      lam.push_back(floe::testing::fitted_log_mass(idx, gid, q.row(h), 16, q.scale));
    const double top = *std::max_element(lam.begin(), lam.end());
    std::vector<double> num(8, 0.0);
    double den = 0;
    for (index_t j = 0; j < lam.size(); ++j) {
      const double w = std::exp(lam[j] - top);
      den += w;
      for (index_t c = 0; c < 8; ++c) num[c] += w * idx.value_mean(sel.residual_groups[j])[c];
    }
    for (index_t c = 0; c < 8; ++c) REQUIRE(out[h * 8 + c] == Approx(num[c] / den).margin(1e-5));
  }
}

TEST_CASE("mog: scores of +-1e4 and masses far outside double range stay finite", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(718);
  random_kv<float> kv(g, 1500, 16, 8, 0, 0, 300.f);  // |s q.k| up to ~1e4
  floe::testing::make_clustered(kv, g, 6, 30.f, 1000.f);
  const auto view = kv.view();
  const auto qd = floe::testing::random_floats(g, 2 * 16, 3.f);
  const auto q = query_group::make(qd.data(), 2, 16);
  for (const budget b : {budget::fraction(0.02), budget::fraction(0.2), budget::top_p(0.9, 10, 300)}) {
    const floe::testing::mog est(floe::testing::mog_selector(b), {});
    stats s;
    const auto out = floe::testing::decode(est, est.build(view), view, q, s);
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
  }
  const floe::testing::mog full(floe::testing::mog_selector(budget::fraction(1.0)), {});
  stats s;
  const auto out = floe::testing::decode(full, full.build(view), view, q, s);
  REQUIRE(floe::testing::worst_head_error(out, floe::testing::dense_reference(view, q), 2, 8) <= 1e-6);
}

TEST_CASE("mog: the GQA selection serves every head's heavy tokens", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(719);
  random_kv<float> kv(g, 3000, 32, 8);
  floe::testing::make_clustered(kv, g, 20);
  const auto view = kv.view();
  // Head h's query points at the keys of token target[h]'s topic; topics differ by head.
  const index_t target[2] = {111, 2222};
  std::vector<float> qd(2 * 32);
  for (index_t h = 0; h < 2; ++h)
    for (index_t t = 0; t < 32; ++t) qd[h * 32 + t] = 3.f * kv.keys[target[h] * 32 + t];
  const auto q = query_group::make(qd.data(), 2, 32);
  const auto sel = floe::testing::mog_selector(budget::fraction(0.12));  // room for both heads' topics
  select::mog_clusters::selection out;
  stats s;
  sel.select(sel.build(view), view, q, exec::scalar{}, out, s);
  for (index_t h = 0; h < 2; ++h) {
    std::vector<float> z(view.n());
    exec::scalar{}.score(view, q, h, {0, view.n()}, z.data());
    const float top = *std::max_element(z.begin(), z.end());
    double all = 0, exact = 0;
    for (float x : z) all += std::exp(double(x) - top);
    for (const auto& r : out.ranges)
      for (index_t i = r.begin; i < r.end; ++i) exact += std::exp(double(z[i]) - top);
    INFO("head " << h << " exact share " << exact / all);
    REQUIRE(exact > 0.5 * all);
  }
}

TEST_CASE("mog: ranking by mass per token reads a small dense cluster before a big one", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(724);
  // Two clusters: A of 900 keys scoring 3, B of 100 keys (every tenth token) scoring 4.5.
  // A holds twice B's mass; B's tokens weigh 4.5x more each.
  random_kv<float> kv(g, 1000, 16, 8);
  std::normal_distribution<float> noise(0.f, 0.02f);
  auto in_b = [](index_t i) { return i % 10 == 3; };
  for (index_t i = 0; i < kv.n; ++i)
    for (index_t t = 0; t < 16; ++t)
      kv.keys[i * 16 + t] = noise(g) + (t == 0 ? (in_b(i) ? 1.5f : 1.f) : t == 1 && in_b(i) ? 0.5f : 0.f);
  const auto view = kv.view();
  std::vector<float> qd(16, 0.f);
  qd[0] = 12.f;  // x the default scale 1/4: scores 3 and 4.5
  const auto q = query_group::make(qd.data(), 1, 16);
  mog_config cfg;
  cfg.clusters = 2;
  cfg.outlier_fraction = 0;
  cfg.sinks = 0;
  auto b_tokens_read = [&](bool per_token) {
    auto sel = floe::testing::mog_selector(budget::tokens(150), cfg);
    sel.rank_per_token = per_token;
    select::mog_clusters::selection out;
    stats s;
    sel.select(sel.build(view), view, q, exec::scalar{}, out, s);
    REQUIRE(out.count() <= 150);
    index_t read = 0;
    for (const auto& r : out.ranges)
      for (index_t i = r.begin; i < r.end; ++i) read += in_b(i);
    return read;
  };
  REQUIRE(b_tokens_read(true) == 100);  // B refined first (100 < 2 x 150) and its subclusters all fit
  REQUIRE(b_tokens_read(false) == 0);   // the default: A refined first, holding 2 x the budget: only its subclusters compete
}

TEST_CASE("mog: top-p stops once the estimated mass is covered, within floor and cap", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(720);
  random_kv<float> kv(g, 3000, 32, 8);
  floe::testing::make_clustered(kv, g, 20);
  const auto view = kv.view();
  const auto qd = floe::testing::random_floats(g, 32, 1.f);
  const auto q = query_group::make(qd.data(), 1, 32);
  auto count = [&](budget b) {
    const auto sel = floe::testing::mog_selector(b);
    select::mog_clusters::selection out;
    stats s;
    sel.select(sel.build(view), view, q, exec::scalar{}, out, s);
    return out.count();
  };
  const index_t loose = count(budget::top_p(0.3, 0, 1500)), tight = count(budget::top_p(0.95, 0, 1500));
  REQUIRE(loose <= tight);
  REQUIRE(tight <= 1500);
  REQUIRE(count(budget::top_p(0.3, 600, 1500)) >= 550);  // whole subclusters: the floor is met up to one of them
  REQUIRE(count(budget::top_p(0.99, 0, 100)) <= 100);
}

TEST_CASE("mog: the cross-covariance corrects values that depend on the key", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(721);
  // One Gaussian cluster with v = A k + noise: the tilted value mean is nu + s C q.
  random_kv<float> kv(g, 3000, 8, 4);
  const auto a = floe::testing::random_floats(g, 4 * 8, 1.f);
  for (index_t i = 0; i < kv.n; ++i)
    for (index_t j = 0; j < 4; ++j) {
      float v = 0.1f * kv.values[i * 4 + j];
      for (index_t t = 0; t < 8; ++t) v += a[j * 8 + t] * kv.keys[i * 8 + t];
      kv.values[i * 4 + j] = v;
    }
  const auto view = kv.view();
  mog_config cfg;
  cfg.clusters = 1;
  cfg.subclusters = 1;
  cfg.outlier_fraction = 0;
  cfg.cross_covariance = true;
  const auto sel = floe::testing::mog_selector(budget::tokens(0), cfg);
  const floe::testing::mog plain(sel, {}), corrected(sel, {true});
  const auto st = corrected.build(view);
  double e_plain = 0, e_corr = 0;
  for (int trial = 0; trial < 8; ++trial) {
    const auto qd = floe::testing::random_floats(g, 8, 1.f);
    const auto q = query_group::make(qd.data(), 1, 8);
    const auto want = floe::testing::dense_reference(view, q);
    stats s;
    e_plain += floe::testing::relative_l2(floe::testing::decode(plain, st, view, q, s).data(), want.data(), 4);
    e_corr += floe::testing::relative_l2(floe::testing::decode(corrected, st, view, q, s).data(), want.data(), 4);
  }
  REQUIRE(e_corr < 0.3 * e_plain);

  // Cov(v, k) = A Cov(k) has rank 4 here: rank-4 factors correct as well as the whole matrix
  // and read 4 (8 + 4) floats instead of 4 x 8; rank 1 still corrects part of it.
  for (index_t rank : {4, 1}) {
    mog_config low = cfg;
    low.cross_covariance_rank = rank;
    const auto low_sel = floe::testing::mog_selector(budget::tokens(0), low);
    const floe::testing::mog low_rank(low_sel, {true}), plain_low(low_sel, {});
    const auto low_st = low_rank.build(view);
    auto g2 = floe::testing::rng(721);
    double e_low = 0, e_low_plain = 0;
    std::uint64_t bytes_low = 0, bytes_plain = 0;
    for (int trial = 0; trial < 8; ++trial) {
      const auto qd = floe::testing::random_floats(g2, 8, 1.f);
      const auto q = query_group::make(qd.data(), 1, 8);
      const auto want = floe::testing::dense_reference(view, q);
      stats s, sp;
      e_low += floe::testing::relative_l2(floe::testing::decode(low_rank, low_st, view, q, s).data(), want.data(), 4);
      e_low_plain += floe::testing::relative_l2(floe::testing::decode(plain_low, low_st, view, q, sp).data(), want.data(), 4);
      bytes_low += s.summary_bytes;
      bytes_plain += sp.summary_bytes;
    }
    INFO("rank " << rank << " error " << e_low << " without " << e_low_plain);
    REQUIRE(e_low < (rank == 4 ? 0.3 : 0.9) * e_low_plain);
    REQUIRE(bytes_low - bytes_plain == 8 * rank * (8 + 4) * sizeof(float));  // one unrefined cluster per step
  }

  mog_config without = cfg;
  without.cross_covariance = false;
  const floe::testing::mog wants_cov(floe::testing::mog_selector(budget::tokens(0), without), {true});
  REQUIRE_THROWS_AS(wants_cov.build(view), floe::invalid_argument);
}

TEST_CASE("mog: a cache reordered by clustered_order gives contiguous subclusters and the same output", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(722);
  random_kv<float> kv(g, 2500, 16, 8);
  floe::testing::make_clustered(kv, g, 15);
  const auto view = kv.view();
  const floe::testing::mog est(floe::testing::mog_selector(budget::fraction(0.05)), {});
  const auto st = est.build(view);
  const auto& order = st.selector_index.clustered_order();
  random_kv<float> moved = kv;
  for (index_t p = 0; p < kv.n; ++p) {
    std::copy_n(kv.keys.begin() + static_cast<std::ptrdiff_t>(order[p] * 16), 16, moved.keys.begin() + static_cast<std::ptrdiff_t>(p * 16));
    std::copy_n(kv.values.begin() + static_cast<std::ptrdiff_t>(order[p] * 8), 8, moved.values.begin() + static_cast<std::ptrdiff_t>(p * 8));
  }
  auto adopted = st;
  adopted.selector_index.adopt_clustered_order();
  const auto qd = floe::testing::random_floats(g, 2 * 16, 1.f);
  const auto q = query_group::make(qd.data(), 2, 16);
  stats s1, s2;
  const auto a = floe::testing::decode(est, st, view, q, s1);
  const auto b = floe::testing::decode(est, adopted, moved.view(), q, s2);
  for (index_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == Approx(b[i]).margin(1e-5));
  REQUIRE(s1.tokens_read == s2.tokens_read);
  select::mog_clusters::selection out;
  stats s;
  est.selector().select(adopted.selector_index, moved.view(), q, exec::scalar{}, out, s);
  REQUIRE(out.ranges.size() * 2 <= out.count());  // runs of whole subclusters, not single tokens

  // At every budget the adopted index's whole runs cover exactly the per-token index's
  // tokens moved by the order, and leave the same groups to the residual.
  for (const double f : {0.02, 0.05, 0.2, 0.5}) {
    INFO("budget fraction " << f);
    const auto sel = floe::testing::mog_selector(budget::fraction(f));
    const auto idx = sel.build(view);
    auto moved_idx = idx;
    moved_idx.adopt_clustered_order();
    select::mog_clusters::selection per_token, runs;
    sel.select(idx, view, q, exec::scalar{}, per_token, s);
    sel.select(moved_idx, moved.view(), q, exec::scalar{}, runs, s);
    validate_ranges(runs.ranges, kv.n);
    std::vector<index_t> want, got;
    for (const auto& r : per_token.ranges)
      for (index_t i = r.begin; i < r.end; ++i) want.push_back(i);
    std::vector<index_t> position(kv.n);
    for (index_t p = 0; p < kv.n; ++p) position[order[p]] = p;
    for (auto& i : want) i = position[i];
    std::sort(want.begin(), want.end());
    for (const auto& r : runs.ranges)
      for (index_t i = r.begin; i < r.end; ++i) got.push_back(i);
    REQUIRE(got == want);
    REQUIRE(runs.residual_groups == per_token.residual_groups);
  }
}

TEST_CASE("mog: appended tokens are attended exactly while they wait in the tail", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(723);
  random_kv<float> kv(g, 2200, 16, 8);
  mog_config cfg;
  cfg.tail_capacity = 256;
  const floe::testing::mog est(floe::testing::mog_selector(budget::fraction(0.2), cfg), {});
  const kv_view<float> built(kv.keys.data(), kv.values.data(), 2000, 16, 8);
  auto st = est.build(built);
  st.selector_index.append(kv.view());  // 200 waiting < 256: tail
  const auto qd = floe::testing::random_floats(g, 16, 1.f);
  select::mog_clusters::selection out;
  stats s;
  est.selector().select(st.selector_index, kv.view(), query_group::make(qd.data(), 1, 16), exec::scalar{}, out, s);
  REQUIRE(out.ranges.back().begin <= 2000);
  REQUIRE(out.ranges.back().end == 2200);
}

TEST_CASE("mog: an index that does not match the view is rejected", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(724);
  random_kv<float> kv(g, 500, 16, 8), other(g, 500, 32, 8);
  const floe::testing::mog est(floe::testing::mog_selector(budget::fraction(0.1)), {});
  const auto st = est.build(kv.view());
  const auto qd = floe::testing::random_floats(g, 32, 1.f);
  std::vector<float> out(8);
  stats s;
  try {
    est.decode(st, other.view(), query_group::make(qd.data(), 1, 32), exec::scalar{}, output_group<float>{out.data(), 1, 8, 0}, s);
    FAIL("mismatched index accepted");
  } catch (const floe::invalid_argument& e) {
    REQUIRE(e.argument() == "index");
  }
  const kv_view<float> shorter(kv.keys.data(), kv.values.data(), 400, 16, 8);
  try {
    est.decode(st, shorter, query_group::make(qd.data(), 1, 16), exec::scalar{}, output_group<float>{out.data(), 1, 8, 0}, s);
    FAIL("a view shorter than the index accepted");
  } catch (const floe::invalid_argument& e) {
    REQUIRE(e.argument() == "kv");
  }
}

TEST_CASE("mog: a query-sample metric clusters keys by how queries score them", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(725);
  // Keys: a class signal in dims [0, 4) under loud noise in dims [4, 32); queries look at
  // the signal only, so Euclidean clusters mix the classes and the query metric does not.
  const index_t n = 4000, d = 32, dv = 8, classes = 16;
  random_kv<float> kv(g, n, d, dv, 0, 0, 3.f);
  const auto centre = floe::testing::random_floats(g, classes * 4, 2.f);
  const auto value = floe::testing::random_floats(g, classes * dv, 1.f);
  std::uniform_int_distribution<index_t> pick(0, classes - 1);
  for (index_t i = 0; i < n; ++i) {
    const index_t c = pick(g);
    for (index_t t = 0; t < 4; ++t) kv.keys[i * d + t] = centre[c * 4 + t] + 0.1f * kv.keys[i * d + t];
    for (index_t j = 0; j < dv; ++j) kv.values[i * dv + j] = value[c * dv + j] + 0.1f * kv.values[i * dv + j];
  }
  auto signal_query = [&](index_t count) {
    auto q = floe::testing::random_floats(g, count * d, 1.5f);
    for (index_t r = 0; r < count; ++r)
      for (index_t t = 4; t < d; ++t) q[r * d + t] = 0.f;
    return q;
  };
  mog_config plain;
  plain.outlier_fraction = 0;
  mog_config metric = plain;
  metric.query_sample = signal_query(64);
  metric.query_metric = true;
  const floe::testing::mog euclid(floe::testing::mog_selector(budget::fraction(0.02), plain), {});
  const floe::testing::mog probed(floe::testing::mog_selector(budget::fraction(0.02), metric), {});
  const auto se = euclid.build(kv.view()), sp = probed.build(kv.view());
  double e_euclid = 0, e_probed = 0;
  for (int trial = 0; trial < 10; ++trial) {
    const auto qd = signal_query(1);
    const auto q = query_group::make(qd.data(), 1, d);
    const auto want = floe::testing::dense_reference(kv.view(), q);
    stats s;
    e_euclid += floe::testing::relative_l2(floe::testing::decode(euclid, se, kv.view(), q, s).data(), want.data(), dv);
    e_probed += floe::testing::relative_l2(floe::testing::decode(probed, sp, kv.view(), q, s).data(), want.data(), dv);
  }
  REQUIRE(e_probed < 0.5 * e_euclid);

  metric.query_sample.resize(33);  // not a multiple of d
  REQUIRE_THROWS_AS(mog_index::build(kv.view(), metric), floe::invalid_argument);
}
