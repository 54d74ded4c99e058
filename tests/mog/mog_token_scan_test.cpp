// mog_config::token_scan: 4-bit keys (or 2-bit standardised codes, scan_code::residual_2bit)
// of the clustered tokens, so that the members of refined clusters are ranked one by one.
// Every token is read or estimated once, unread members carry their scanned mass, a heavy
// token inside a cluster is read, and clusters formed by append fall back to subclusters.
// Keys the 4-bit rows cannot hold are refused. A scan split over an executor's threads
// chooses what one thread does.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "floe/exec/thread_pool.hpp"
#include "mog/mog_support.hpp"

using namespace floe;
using floe::testing::random_kv;

namespace {

using scan_code = mog_config::scan_code;

select::mog_clusters scanning(budget b, mog_config cfg = {}, scan_code code = scan_code::keys_4bit) {
  return floe::testing::mog_selector(b, cfg).with_token_scan(code);
}

const char* name_of(scan_code code) { return code == scan_code::keys_4bit ? "4-bit keys" : "2-bit codes"; }

// Bytes of the scan's index per clustered token, and per cluster.
std::pair<index_t, index_t> scan_bytes(const mog_index& idx) {
  if (idx.member_codes().tokens() > 0) return {idx.member_codes().bytes_per_token(), idx.member_codes().bytes_per_cluster()};
  return {idx.member_keys().bytes_per_token(), 0};
}

// 3000 float tokens (d = 32, dv = 16) around 20 topic centres.
random_kv<float> clustered_tokens(std::mt19937_64& g) {
  random_kv<float> kv(g, 3000, 32, 16);
  floe::testing::make_clustered(kv, g, 20);
  return kv;
}

// Every clustered token is read exactly or in exactly one residual group, which for a
// subcluster holds only its unread members; returns how often each token is counted.
std::vector<int> coverage(const mog_index& idx, const select::mog_clusters::selection& out, index_t n) {
  std::vector<int> cover(n, 0), read(n, 0);
  for (const auto& r : out.ranges)
    for (index_t i = r.begin; i < r.end; ++i) ++cover[i], read[i] = 1;
  for (auto gid : out.residual_groups) {
    const bool cluster = gid < idx.clusters();
    const index_t s0 = cluster ? idx.first_subcluster(gid) : gid - idx.clusters();
    const index_t s1 = cluster ? idx.first_subcluster(gid + 1) : s0 + 1;
    for (index_t sub = s0; sub < s1; ++sub)
      for (auto p : idx.members(sub))
        if (cluster || !read[p]) ++cover[p];
        else REQUIRE(!cluster);  // a read member of a residual subcluster is left to the exact part
  }
  return cover;
}

// Subcluster sub's members that `read` does not mark, with their 4-bit score estimates, per
// head: [heads] of (position, estimate).
std::vector<std::vector<std::pair<std::uint32_t, double>>> unread_estimates(const mog_index& idx, const query_group& q,
                                                                            const std::vector<char>& read, index_t sub) {
  const auto members = idx.members(sub);
  const index_t first = idx.first_member(sub), size = members.size();
  std::vector<float> estimate(q.heads * size);
  if (idx.member_codes().tokens() > 0) {
    index_t c = 0;
    while (idx.first_subcluster(c + 1) <= sub) ++c;
    idx.member_codes().scan(q, c, first, first + size, estimate.data(), size);
  } else {
    idx.member_keys().scan(idx.member_keys().prepare(q), first, first + size, estimate.data(), nullptr, size);
  }
  std::vector<std::vector<std::pair<std::uint32_t, double>>> out(q.heads);
  for (index_t h = 0; h < q.heads; ++h)
    for (index_t i = 0; i < size; ++i)
      if (!read[members[i]]) out[h].push_back({members[i], estimate[h * size + i]});
  return out;
}

double log_sum_exp(const std::vector<double>& x) {
  double top = -std::numeric_limits<double>::infinity(), sum = 0.0;
  for (double v : x) top = std::max(top, v);
  for (double v : x) sum += std::exp(v - top);
  return top + std::log(sum);
}

}  // namespace

TEST_CASE("mog token scan: full budget equals dense, and the index holds a code of every clustered token", "[mog]") {
  INFO("seed " << floe::testing::seed());
  const scan_code code = GENERATE(scan_code::keys_4bit, scan_code::residual_2bit);
  INFO(name_of(code));
  auto g = floe::testing::rng(741);
  for (auto [n, block] : {std::pair<index_t, index_t>{1, 0}, {700, 0}, {2000, 16}}) {
    INFO("n " << n << " block " << block);
    random_kv<half> kv(g, n, 32, 24, 1, block);
    const auto qd = floe::testing::random_floats(g, 3 * 32, 2.f);
    const auto q = query_group::make(qd.data(), 3, 32);
    const floe::testing::mog est(scanning(budget::fraction(1.0), {}, code), {});
    const index_t tokens = n;  // clang 14 captures no structured bindings
    auto run = [&](const auto& view) {
      const auto state = est.build(view);
      const mog_index& idx = state.selector_index;
      index_t clustered = 0;
      for (index_t s = 0; s < idx.subclusters(); ++s) clustered += idx.members(s).size();
      const auto [per_token, per_cluster] = scan_bytes(idx);
      REQUIRE(idx.memory().token_scan == clustered * per_token + (clustered ? idx.clusters() * per_cluster : 0));
      REQUIRE(idx.scanned_clusters() == (clustered ? idx.clusters() : 0));
      REQUIRE((clustered == 0 || (code == scan_code::residual_2bit) == (idx.member_codes().tokens() == clustered)));
      stats s;
      const auto out = floe::testing::decode(est, state, view, q, s);
      REQUIRE(floe::testing::worst_head_error(out, floe::testing::dense_reference(view, q), 3, 24) <= 1e-6);
      REQUIRE(s.tokens_read == tokens);
    };
    if (kv.paged()) run(kv.paged_view());
    else run(kv.view());
  }
  // Off: no 4-bit keys.
  random_kv<float> kv(g, 500, 16, 8);
  REQUIRE(mog_index::build(kv.view()).memory().token_scan == 0);
  REQUIRE(mog_index::build(kv.view()).scanned_clusters() == 0);
}

TEST_CASE("mog token scan: every token is read or estimated once, and unread members carry their scanned mass", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(742);
  const scan_code code = GENERATE(scan_code::keys_4bit, scan_code::residual_2bit);
  INFO(name_of(code));
  const auto kv = clustered_tokens(g);
  const auto view = kv.view();
  const auto sel = scanning(budget::fraction(0.05), {}, code);
  const mog_index idx = sel.build(view);
  const auto qd = floe::testing::random_floats(g, 4 * 32, 1.f);
  const auto q = query_group::make(qd.data(), 4, 32);
  select::mog_clusters::selection out;
  stats s;
  sel.select(idx, view, q, exec::scalar{}, out, s);
  validate_ranges(out.ranges, view.n());
  REQUIRE(out.count() <= 150);
  const auto cover = coverage(idx, out, view.n());
  REQUIRE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }));

  std::vector<char> read(view.n(), 0);
  for (const auto& r : out.ranges)
    for (index_t i = r.begin; i < r.end; ++i) read[i] = 1;
  const index_t groups = out.residual_groups.size();
  index_t partial = 0, refined_tokens = 0;
  for (index_t j = 0; j < groups; ++j) {
    const auto gid = out.residual_groups[j];
    if (gid < idx.clusters()) continue;
    const auto members = idx.members(gid - idx.clusters());
    const auto unread = std::count_if(members.begin(), members.end(), [&](std::uint32_t p) { return !read[p]; });
    REQUIRE(unread > 0);
    if (static_cast<std::size_t>(unread) == members.size()) continue;  // a whole subcluster: its Gaussian, or every member unread
    ++partial;
    // The unread members' mass from their scanned score estimates (member rows of the
    // subcluster), which lie within the code's rounding of the exact scores.
    const auto unread_of = unread_estimates(idx, q, read, gid - idx.clusters());
    for (index_t h = 0; h < 4; ++h) {
      std::vector<double> scanned, exact;
      for (auto [p, e] : unread_of[h]) {
        double dot = 0.0;
        for (index_t t = 0; t < 32; ++t) dot += static_cast<double>(q.row(h)[t]) * view.key_row(p)[t];
        exact.push_back(q.scale * dot);
        scanned.push_back(e);
      }
      REQUIRE(out.residual_log_mass[h * groups + j] == Approx(log_sum_exp(scanned)).margin(1e-4));
      REQUIRE(out.residual_log_mass[h * groups + j] == Approx(log_sum_exp(exact)).margin(code == scan_code::keys_4bit ? 0.5 : 1.5));
    }
  }
  CHECK(partial > 0);
  // The scan's bytes: at least the refined clusters' members (4 x the budget) at the code's row size.
  for (index_t c = 0; c < idx.clusters(); ++c)
    if (std::find(out.residual_groups.begin(), out.residual_groups.end(), c) == out.residual_groups.end())
      refined_tokens += idx.count(c);
  REQUIRE(refined_tokens >= 150);
  REQUIRE(s.summary_bytes >= refined_tokens * scan_bytes(idx).first);
}

TEST_CASE("mog token scan: a heavy token inside a cluster is read exactly, where subclusters exceed the budget", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(743);
  random_kv<float> kv(g, 2000, 32, 16);
  mog_config cfg;
  cfg.clusters = 1;            // one cluster of four subclusters of ~500 tokens,
  cfg.subclusters = 4;         // each larger than the 40-token budget
  cfg.outlier_fraction = 0.0;  // no exact outliers: only the ranking can find the token
  const index_t heavy = 1234;
  std::vector<float> qd(32);
  for (index_t t = 0; t < 32; ++t) qd[t] = 2.f * kv.keys[heavy * 32 + t];  // the query looks for token 1234's key
  const auto q = query_group::make(qd.data(), 1, 32);
  double top = -1e300;  // lift its score 4 above every other token's
  for (index_t i = 0; i < 2000; ++i) {
    double dot = 0.0;
    for (index_t t = 0; t < 32; ++t) dot += static_cast<double>(qd[t]) * kv.keys[i * 32 + t];
    if (i != heavy) top = std::max(top, q.scale * dot);
  }
  double own = 0.0, norm = 0.0;
  for (index_t t = 0; t < 32; ++t) own += static_cast<double>(qd[t]) * kv.keys[heavy * 32 + t], norm += static_cast<double>(qd[t]) * qd[t];
  const double lift = std::max(0.0, (top + 4.0 - q.scale * own) / (q.scale * norm));
  for (index_t t = 0; t < 32; ++t) kv.keys[heavy * 32 + t] += static_cast<float>(lift * qd[t]);
  const auto view = kv.view();
  auto reads_heavy = [&](const select::mog_clusters& sel, double* error) {
    const floe::testing::mog est(sel, {});
    const auto state = est.build(view);
    REQUIRE(state.selector_index.outliers().empty());
    select::mog_clusters::selection out;
    stats s;
    sel.select(state.selector_index, view, q, exec::scalar{}, out, s);
    REQUIRE(out.count() <= 40);
    const auto got = floe::testing::decode(est, state, view, q, s);
    *error = floe::testing::worst_head_error(got, floe::testing::dense_reference(view, q), 1, 16);
    return std::any_of(out.ranges.begin(), out.ranges.end(), [&](const token_range& r) { return r.begin <= heavy && heavy < r.end; });
  };
  double with_scan = 0.0, without = 0.0;
  const scan_code code = GENERATE(scan_code::keys_4bit, scan_code::residual_2bit);
  INFO(name_of(code));
  REQUIRE(reads_heavy(scanning(budget::tokens(40), cfg, code), &with_scan));
  REQUIRE_FALSE(reads_heavy(floe::testing::mog_selector(budget::tokens(40), cfg), &without));  // no subcluster fits
  CHECK(with_scan < 0.15);  // the rest from 4-bit masses and subcluster value means (0.055 seen)
  REQUIRE(with_scan < without);
}

TEST_CASE("mog token scan: clusters formed by append use their subclusters, a rebuild scans again", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(744);
  random_kv<float> kv(g, 3600, 24, 16);
  floe::testing::make_clustered(kv, g, 10);
  auto prefix = [&](index_t n) { return kv_view<float>(kv.keys.data(), kv.values.data(), n, 24, 16); };
  mog_config cfg;
  cfg.tail_capacity = 64;
  cfg.rebuild_drift = 1e9;  // only growth re-clusters here
  cfg.segment_min_tokens = 128;
  const scan_code code = GENERATE(scan_code::keys_4bit, scan_code::residual_2bit);
  INFO(name_of(code));
  auto sel = scanning(budget::fraction(0.1), cfg, code);
  const floe::testing::mog est(sel, {});
  auto state = est.build(prefix(2400));
  const index_t built = state.selector_index.clusters();
  const auto generation = state.selector_index.generation();
  REQUIRE(state.selector_index.scanned_clusters() == built);
  const auto qd = floe::testing::random_floats(g, 2 * 24, 1.f);
  const auto q = query_group::make(qd.data(), 2, 24);
  for (index_t n = 2500; n <= 3100; n += 100) {
    est.append(state, prefix(n));
    REQUIRE(state.selector_index.generation() == generation);
    REQUIRE(state.selector_index.scanned_clusters() == built);  // the built clusters keep their codes
    select::mog_clusters::selection out;
    stats s;
    sel.select(state.selector_index, prefix(n), q, exec::scalar{}, out, s);
    validate_ranges(out.ranges, n);
    const auto cover = coverage(state.selector_index, out, state.selector_index.tokens());
    REQUIRE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }));
    const auto got = floe::testing::decode(est, state, prefix(n), q, s);
    REQUIRE(std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); }));
  }
  REQUIRE(state.selector_index.clusters() > built);  // appended tokens formed clusters of their own
  est.append(state, prefix(3600));                    // 1200 appended >= 0.5 x 2400: re-cluster
  REQUIRE(state.selector_index.generation() == generation + 1);
  REQUIRE(state.selector_index.scanned_clusters() == state.selector_index.clusters());
}

TEST_CASE("mog token scan: keys beyond the 4-bit rows' range are refused naming the keys", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(745);
  random_kv<float> kv(g, 600, 16, 8);
  for (float& k : kv.keys) k *= 1e5f;  // finite, and fine for the Gaussian summaries (a lone large key would be an outlier)
  const std::vector<float> keys = kv.keys, values = kv.values;
  mog_config cfg;
  REQUIRE_NOTHROW(mog_index::build(kv.view(), cfg));
  cfg.token_scan = true;
  REQUIRE_THROWS_WITH(mog_index::build(kv.view(), cfg), Catch::Contains("keys") && Catch::Contains("60000"));
  REQUIRE(kv.keys == keys);  // the caller's cache is read, never written
  REQUIRE(kv.values == values);
}

TEST_CASE("mog token scan: a scanned subcluster far below the head's best keeps its mass, not zero", "[mog]") {
  // Two heads of a group look opposite ways along one axis, so each refines clusters that
  // the other scores ~100 lower: their unread members underflow against that head's maximum
  // and are summed again against their own.
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(746);
  random_kv<float> kv(g, 3000, 32, 16);
  floe::testing::make_clustered(kv, g, 20);
  for (index_t i = 0; i < kv.n; ++i) kv.keys[i * kv.key_stride] += kv.keys[i * kv.key_stride] >= 0.f ? 16.f : -16.f;
  const auto view = kv.view();
  const auto sel = scanning(budget::fraction(0.05));
  const mog_index idx = sel.build(view);
  auto qd = floe::testing::random_floats(g, 2 * 32, 0.3f);
  qd[0] += 20.f, qd[32] -= 20.f;
  const auto q = query_group::make(qd.data(), 2, 32);
  select::mog_clusters::selection out;
  stats s;
  sel.select(idx, view, q, exec::scalar{}, out, s);
  std::vector<char> read(view.n(), 0);
  for (const auto& r : out.ranges)
    for (index_t i = r.begin; i < r.end; ++i) read[i] = 1;
  const index_t groups = out.residual_groups.size();
  double lowest[2] = {1e30, 1e30}, highest[2] = {-1e30, -1e30};
  for (index_t j = 0; j < groups; ++j) {
    const auto gid = out.residual_groups[j];
    if (gid < idx.clusters()) continue;
    const auto unread_of = unread_estimates(idx, q, read, gid - idx.clusters());
    for (index_t h = 0; h < 2; ++h) {
      std::vector<double> scanned;
      for (const auto& member : unread_of[h]) scanned.push_back(member.second);
      const double expected = log_sum_exp(scanned), got = out.residual_log_mass[h * groups + j];
      REQUIRE(std::isfinite(got));
      REQUIRE(got == Approx(expected).margin(1e-4).epsilon(1e-6));
      lowest[h] = std::min(lowest[h], got), highest[h] = std::max(highest[h], got);
    }
  }
  // Some group of each head lies > 80 below another (e^-80 < 1e-30 even against 3000 members): the fallback ran.
  REQUIRE(highest[0] - lowest[0] > 80.0);
  REQUIRE(highest[1] - lowest[1] > 80.0);
}

TEST_CASE("mog token scan: a top-p budget stops the token order once the mass is covered, within floor and cap", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(746);
  const auto kv = clustered_tokens(g);
  const auto view = kv.view();
  const mog_index idx = scanning(budget::fraction(0.5)).build(view);
  const index_t always = idx.sinks() + idx.outliers().size(), cap = 1500;
  // Tokens read, and how many a selection that read every scanned token up to the cap would.
  auto count = [&](budget b, const query_group& q) {
    select::mog_clusters::selection out;
    stats s;
    scanning(b).select(idx, view, q, exec::scalar{}, out, s);
    const auto cover = coverage(idx, out, view.n());  // fewer tokens read: the rest still estimated, once
    REQUIRE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }));
    index_t scanned = 0;
    for (index_t c = 0; c < idx.clusters(); ++c)
      if (std::find(out.residual_groups.begin(), out.residual_groups.end(), c) == out.residual_groups.end()) scanned += idx.count(c);
    return std::pair{out.count(), always + std::min(scanned, b.cap - always)};
  };
  // Refinement also stops at p, by the clusters' Gaussians; where the members' 4-bit scores
  // sum to less than those, the order runs out before p (one query in 20-40 here): so 8 queries.
  index_t stopped_early = 0;
  for (int draw = 0; draw < 8; ++draw) {
    const auto qd = floe::testing::random_floats(g, 2 * 32, 1.f);
    const auto q = query_group::make(qd.data(), 2, 32);
    const auto [loose, loose_all] = count(budget::top_p(0.2, 0, cap), q);
    const auto [tight, tight_all] = count(budget::top_p(0.9, 0, cap), q);
    INFO("tokens read at p = 0.2: " << loose << " of " << loose_all << ", at p = 0.9: " << tight << " of " << tight_all);
    REQUIRE(loose <= loose_all);
    REQUIRE(loose <= tight);
    REQUIRE(tight <= cap);
    stopped_early += loose < loose_all;  // the order stopped at p, before the refined clusters or the cap ran out
    REQUIRE(count(budget::top_p(0.2, 700, cap), q).first >= 700);  // tokens one at a time: the floor is met exactly
    REQUIRE(count(budget::top_p(0.99, 0, 100), q).first <= 100);
  }
  REQUIRE(stopped_early >= 2);
}

namespace {

// The scalar executor lending a pool's threads (LendsThreads), counting the bodies it runs.
struct lending_scalar : exec::scalar {
  thread_pool* pool = nullptr;
  std::atomic<index_t>* bodies = nullptr;
  index_t concurrency() const { return pool->size(); }
  void parallel_for(index_t n, const std::function<void(index_t)>& body) const {
    *bodies += n;
    pool->hook()(n, body);
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace

TEST_CASE("mog token scan: split over an executor's threads, selection and output are those of one thread", "[mog]") {
  INFO("seed " << floe::testing::seed());
  const scan_code code = GENERATE(scan_code::keys_4bit, scan_code::residual_2bit);
  INFO(name_of(code));
  auto g = floe::testing::rng(747);
  random_kv<half> kv(g, 12000, 64, 32);
  floe::testing::make_clustered(kv, g, 40);
  const floe::testing::mog est(scanning(budget::fraction(0.2), {}, code), {});  // refined: over 2 x 4096 rows
  const auto state = est.build(kv.view());
  thread_pool pool(3);
  std::atomic<index_t> bodies{0};
  const lending_scalar lending{{}, &pool, &bodies};
  for (int step = 0; step < 4; ++step) {
    INFO("step " << step);
    const auto qd = floe::testing::random_floats(g, 4 * 64, 2.f);
    const auto q = query_group::make(qd.data(), 4, 64);
    select::mog_clusters::selection one, split;
    stats s1, s2;
    const index_t before = bodies;
    est.selector().select(state.selector_index, kv.view(), q, exec::scalar{}, one, s1);
    est.selector().select(state.selector_index, kv.view(), q, lending, split, s2);
    REQUIRE(bodies - before >= 2);  // the scan (thousands of rows) did split
    REQUIRE(one.ranges.size() == split.ranges.size());
    for (index_t i = 0; i < one.ranges.size(); ++i) {
      REQUIRE(one.ranges[i].begin == split.ranges[i].begin);
      REQUIRE(one.ranges[i].end == split.ranges[i].end);
    }
    REQUIRE(one.residual_groups == split.residual_groups);
    REQUIRE(same_bits(one.residual_log_mass, split.residual_log_mass));
    REQUIRE(s1.summary_bytes == s2.summary_bytes);
    std::vector<float> out1(4 * 32), out2(4 * 32);
    est.decode(state, kv.view(), q, exec::scalar{}, output_group<float>{out1.data(), 4, 32, 0}, s1);
    est.decode(state, kv.view(), q, lending, output_group<float>{out2.data(), 4, 32, 0}, s2);
    REQUIRE(same_bits(out1, out2));
  }
}
