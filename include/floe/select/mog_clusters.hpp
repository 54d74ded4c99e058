// Selector `mog_clusters`: scores the ~sqrt(n) key clusters of a mog_index by their
// Gaussian estimate of attention mass, refines the best into subclusters, and attends the
// best subclusters exactly. The uncovered groups and their estimated log-masses go to the
// residual (gaussian_moments). docs/methods/mog.md.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/budget.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/index/mog_index.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

struct mog_clusters {
  static constexpr std::string_view name = "mog_clusters";
  using index = mog_index;

  // The exact set, plus the groups left uncovered and their estimated log-masses.
  struct selection : floe::selection {
    const mog_index* source = nullptr;           // residual_groups are groups of this index
    index_t heads = 0;
    std::vector<std::uint32_t> residual_groups;  // unrefined clusters and unchosen subclusters
    std::vector<float> residual_log_mass;        // [heads, residual_groups]: log(n_g E[exp(s q.k)]), variance term x f_g
  };

  mog_config config{};
  budget limit = budget::fraction(0.05);
  double refine = 2.0;    // refined clusters hold about this many times the exact-token budget
  double optimism = 1.0;  // priorities use this multiple of the score variance (1: the plain estimate)
  // Multiplies the variance term of every estimate (and priority), on top of each group's
  // fitted factor: 1 keeps it. Measured before that fit existed: 0.5 cut p90 at 5-10 % by up
  // to half on the SmolLM2 dumps and doubled it on the Gaussian-built synthetic cache
  // (docs/log/mog.md, "Outliers by band, and tempering the variance term"); the fit does this per group.
  double variance_scale = 1.0;
  bool maximin = false;   // GQA: rank groups by the largest estimated share of any head; true: heads take turns (maximin)
  // true: rank clusters (to refine) and subclusters (to read) by estimated mass per token,
  // the greedy rule for the most mass covered per token read, instead of by estimated mass,
  // which favours big groups. Lower p90 on the synthetic cache and most SmolLM2 dumps, higher
  // perplexity at 8K, so off (docs/log/mog.md, "Ranking by mass per token").
  bool rank_per_token = false;

  // The default configuration for a budget on a cache of n tokens: 4 sinks and a recent
  // window of 64 exact tokens, each shrunk so that together they use at most a quarter of
  // it, and exact outliers for at most `share` of it (and 2 % of n). The synthetic cache
  // needs 0.5; 0.1 lowers p90 on the SmolLM2 dumps but raises perplexity at 8K
  // (docs/log/mog.md, "Outlier share").
  static constexpr double outlier_share = 0.5;
  static constexpr double lean_outlier_share = 0.1;
  static mog_clusters with_budget(budget b, index_t n, double share = outlier_share) {
    require(std::isfinite(share) && share >= 0.0 && share <= 1.0, "outlier_share", "must lie in [0, 1], got ", share);
    mog_clusters s;
    s.limit = b;
    const index_t tokens = b.resolve(n), quarter = tokens / 4;
    s.config.sinks = std::min<index_t>(4, quarter / 4);
    s.config.window = std::min<index_t>(64, quarter - s.config.sinks);
    if (n > 0) s.config.outlier_fraction = std::min(s.config.outlier_fraction, share * static_cast<double>(tokens) / static_cast<double>(n));
    return s;
  }

  // Token scan (mog_config::token_scan) with refined clusters holding 8x the budget: at
  // equal bytes read, scanning more members beat reading more tokens on the SmolLM2 dumps
  // and the synthetic cache (docs/log/mog.md, "Refine 8 for the token scan").
  static constexpr double token_scan_refine = 8.0;
  // With 2-bit codes (mog_config::scan_code::residual_2bit) a scanned member costs 32 bytes
  // at d = 128 instead of 80: refine 16 read fewer bytes than the 4-bit refine 8 and lowered
  // p90 at 32K and 128K (docs/log/mog.md, "Cheaper keys for the token scan").
  static constexpr double token_scan_code_refine = 16.0;
  // Scanned rows per piece when the scan splits over the executor's threads: 4096 rows take
  // about 20 us cold at d = 128, far more than a hand-off (docs/log/mog.md, "The token scan
  // over the executor's threads").
  static constexpr index_t scan_piece_rows = 4096;
  mog_clusters with_token_scan(mog_config::scan_code code = mog_config::scan_code::keys_4bit) const {
    mog_clusters s = *this;
    s.config.token_scan = true;
    s.config.token_scan_code = code;
    s.refine = code == mog_config::scan_code::residual_2bit ? token_scan_code_refine : token_scan_refine;
    return s;
  }

  template <KvView KV>
  index build(const KV& kv) const { return mog_index::build(kv, config); }

  // One selection shared by the g query heads of the group: a group's priority is the
  // largest share of estimated mass it has for any head.
  template <KvView KV, class Exec>
  void select(const index& idx, const KV& kv, const query_group& q, const Exec& exec, selection& out, stats& st) const {
    out.clear();
    out.source = &idx;
    out.heads = q.heads;
    out.residual_groups.clear();
    out.residual_log_mass.clear();
    require(kv.d() == idx.d() && kv.dv() == idx.dv(), "index", "built for d = ", idx.d(), ", dv = ", idx.dv(),
            "; the view has d = ", kv.d(), ", dv = ", kv.dv());
    const index_t n = kv.n(), tail_begin = idx.tokens();
    require_view_covers(n, tail_begin, "the index");
    const index_t b = limit.resolve(n);  // for top-p: the cap
    const bool by_mass = limit.kind == budget::unit::mass;
    if (idx.clusters() == 0 || (by_mass ? limit.value >= 1.0 : b >= n)) {  // all exact: dense attention
      out.add(0, n);
      return;
    }
    const index_t always = idx.sinks() + idx.outliers().size() + (n - tail_begin), heads = q.heads, clusters = idx.clusters();
    index_t left = b > always ? b - always : 0;  // sinks, outliers and tail are exact whatever the budget
    require(std::isfinite(variance_scale) && variance_scale >= 0.0, "variance_scale", "must be finite and >= 0, got ",
            variance_scale);
    require(std::isfinite(optimism) && optimism >= 0.0, "optimism", "must be finite and >= 0, got ", optimism);
    group_scorer scorer(idx, q, optimism, variance_scale);

    // Clusters: estimated log-mass and priority per head.
    scores cl = scorer.rows(0, clusters);
    st.summary_bytes += scorer.bytes(clusters);
    if (rank_per_token) cl.per_token(idx, [](index_t r) { return r; });

    // Refine clusters until they hold `refine` x the budget (top-p: until they hold an
    // estimated share p of every head, or the same token cap).
    std::vector<char> refined(clusters, 0);
    index_t candidates = 0, refined_tokens = 0, refined_clusters = 0;
    const double target = refine * static_cast<double>(left);
    std::vector<double> covered(heads, 0.0);
    cl.take_greedy(
        covered, [&] { return left == 0 || static_cast<double>(refined_tokens) >= target ||
                              (by_mass && refined_tokens >= limit.floor && min_of(covered) >= limit.value); },
        [&](index_t) { return true; },
        [&](index_t c) {
          refined[c] = 1;
          ++refined_clusters;
          refined_tokens += idx.count(c);
          candidates += idx.first_subcluster(c + 1) - idx.first_subcluster(c);
        },
        maximin);

    if (idx.scanned_clusters() > 0) return select_tokens(idx, q, scorer, cl, refined, left, n, exec, out, st);

    // Subclusters of refined clusters, normalised against the refined partition.
    std::vector<std::uint32_t> cand;
    cand.reserve(candidates);
    for (index_t c = 0; c < clusters; ++c)
      if (refined[c])
        for (index_t s = idx.first_subcluster(c); s < idx.first_subcluster(c + 1); ++s) cand.push_back(static_cast<std::uint32_t>(s));
    scores sub = scorer.rows_of(cand, clusters);
    st.summary_bytes += scorer.bytes(candidates) + refined_clusters * 2 * sizeof(std::uint32_t);
    sub.normalise_with(cl, refined);
    if (rank_per_token) sub.per_token(idx, [&](index_t j) { return clusters + cand[j]; });

    // Take subclusters while they fit the budget (top-p: until every head's estimated
    // covered share reaches p and the floor is met).
    std::vector<char> chosen(candidates, 0);
    std::fill(covered.begin(), covered.end(), 0.0);
    index_t taken = 0, chosen_count = 0;
    sub.take_greedy(
        covered, [&] { return left == 0 || (by_mass && taken >= limit.floor && min_of(covered) >= limit.value); },
        [&](index_t j) { return idx.count(clusters + cand[j]) <= left; },
        [&](index_t j) {
          const index_t size = idx.count(clusters + cand[j]);
          chosen[j] = 1;
          ++chosen_count;
          left -= size;
          taken += size;
        },
        maximin);

    // Exact set: sinks, outliers and members of chosen subclusters in increasing position, the tail.
    std::vector<std::uint32_t> picked;
    picked.reserve(chosen_count);
    for (index_t j = 0; j < candidates; ++j)
      if (chosen[j]) picked.push_back(cand[j]);
    st.summary_bytes += idx.outliers().size() * sizeof(std::uint32_t);
    st.summary_bytes += taken * sizeof(std::uint32_t) + chosen_count * 2 * sizeof(std::uint32_t);  // positions, offsets
    out.add(0, idx.sinks());
    if (!add_whole_runs(idx, picked, out)) add_marked(idx, picked, {}, out);
    out.add(tail_begin, n);

    // Hints for the residual: every group not read exactly, with its log-mass per head.
    for (index_t c = 0; c < clusters; ++c)
      if (!refined[c]) out.residual_groups.push_back(static_cast<std::uint32_t>(c));
    for (index_t j = 0; j < candidates; ++j)
      if (!chosen[j]) out.residual_groups.push_back(static_cast<std::uint32_t>(clusters + cand[j]));
    const index_t g = out.residual_groups.size();
    out.residual_log_mass.resize(heads * g);
    for (index_t h = 0; h < heads; ++h) {
      index_t r = 0;
      for (index_t c = 0; c < clusters; ++c)
        if (!refined[c]) out.residual_log_mass[h * g + r++] = cl.log_mass(c, h);
      for (index_t j = 0; j < candidates; ++j)
        if (!chosen[j]) out.residual_log_mass[h * g + r++] = sub.log_mass(j, h);
    }
  }

 private:
  // Per row (group) and head: the estimated log-mass and the priority log-mass, and the
  // per-head log of the total estimated mass that shares are taken against.
  struct scores {
    Eigen::MatrixXf lam, pri;     // [rows, heads]
    Eigen::RowVectorXf log_z;     // [heads], log-sum of estimated masses of the partition

    float log_mass(index_t r, index_t h) const { return lam(static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(h)); }
    void add_share(index_t r, std::vector<double>& covered) const {
      for (index_t h = 0; h < covered.size(); ++h)
        covered[h] += std::exp(static_cast<double>(log_mass(r, h) - log_z[static_cast<Eigen::Index>(h)]));
    }
    // Takes rows that fit until done(). Default: one order for all heads, by the largest
    // estimated share of any head. With maximin, the head with the least estimated covered
    // share takes its best remaining row, so that no head starves (docs/methods/mog.md
    // measures both). One head: plain greedy by priority either way.
    template <class Done, class Fits, class Take>
    void take_greedy(std::vector<double>& covered, Done done, Fits fits, Take take, bool maximin = true) const {
      const auto rows = static_cast<index_t>(pri.rows()), heads = maximin ? covered.size() : 1;
      // One max-heap of rows per head: only the rows actually taken are ever ordered.
      std::vector<std::vector<std::pair<float, index_t>>> heap(heads);
      for (index_t h = 0; h < heads; ++h) {
        heap[h].resize(rows);
        for (index_t r = 0; r < rows; ++r) {
          const float key = maximin ? pri(static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(h))
                                    : (pri.row(static_cast<Eigen::Index>(r)) - log_z).maxCoeff();
          heap[h][r] = {key, rows - r};  // ties: lower row first
        }
        std::make_heap(heap[h].begin(), heap[h].end());
      }
      std::vector<char> used(rows, 0);
      while (!done()) {
        index_t h = heads;
        for (index_t k = 0; k < heads; ++k)
          if (!heap[k].empty() && (h == heads || covered[k] < covered[h])) h = k;
        if (h == heads) return;  // every head has run out of rows that fit
        std::pop_heap(heap[h].begin(), heap[h].end());
        const index_t r = rows - heap[h].back().second;
        heap[h].pop_back();
        if (used[r] || !fits(r)) continue;  // what does not fit now never will
        used[r] = 1;
        take(r);
        add_share(r, covered);
      }
    }
    // Priorities per token: each row's priority less the log of its group's count.
    template <class GroupOf>
    void per_token(const mog_index& idx, GroupOf group_of) {
      for (index_t r = 0; r < static_cast<index_t>(pri.rows()); ++r)
        pri.row(static_cast<Eigen::Index>(r)).array() -= idx.log_counts()[group_of(r)];
    }
    // Totals over the partition where refined clusters are replaced by these subclusters.
    void normalise_with(const scores& clusters, const std::vector<char>& refined) {
      const index_t unrefined = static_cast<index_t>(std::count(refined.begin(), refined.end(), 0));
      Eigen::MatrixXf all(static_cast<Eigen::Index>(unrefined) + lam.rows(), lam.cols());
      Eigen::Index r = 0;
      for (index_t c = 0; c < refined.size(); ++c)
        if (!refined[c]) all.row(r++) = clusters.lam.row(static_cast<Eigen::Index>(c));
      all.bottomRows(lam.rows()) = lam;
      log_z = log_sum_exp_cols(all);
    }
  };

  // lam = log n_g + [mean | f_g var] . [s q | c s^2 q^2 / 2] (c = variance_scale, f_g the
  // group's fitted factor); pri the same with `optimism` x the variance term. Each group's
  // fp16 row is decoded into one L1 row, then dotted with every head's column (a block of
  // decoded rows was 64 KiB of scratch written cold every step).
  class group_scorer {
   public:
    group_scorer(const mog_index& idx, const query_group& q, double optimism, double variance_scale)
        : idx_(idx), heads_(q.heads),
          w_(static_cast<Eigen::Index>(2 * idx.d()), static_cast<Eigen::Index>((optimism == 1.0 ? 1 : 2) * q.heads)),
          row_(static_cast<Eigen::Index>(2 * idx.d())) {
      const index_t d = idx.d();
      for (index_t h = 0; h < heads_; ++h)
        for (index_t t = 0; t < d; ++t) {
          const float sq = q.scale * q.row(h)[t];
          const auto r = static_cast<Eigen::Index>(t), c = static_cast<Eigen::Index>(h);
          w_(r, c) = sq;
          w_(static_cast<Eigen::Index>(d) + r, c) = static_cast<float>(0.5 * variance_scale) * sq * sq;
          if (w_.cols() == 2 * static_cast<Eigen::Index>(heads_)) {  // priorities differ from estimates
            const auto cp = static_cast<Eigen::Index>(heads_ + h);
            w_(r, cp) = sq;
            w_(static_cast<Eigen::Index>(d) + r, cp) = static_cast<float>(0.5 * optimism * variance_scale) * sq * sq;
          }
        }
    }

    // Groups [first, first + count).
    scores rows(index_t first, index_t count) {
      std::vector<std::uint32_t> groups(count);
      std::iota(groups.begin(), groups.end(), static_cast<std::uint32_t>(first));
      return rows_of(groups, 0);
    }

    // Subclusters `subs` (numbered from 0; group offset `first_sub_group`).
    scores rows_of(const std::vector<std::uint32_t>& subs, index_t first_sub_group) {
      Eigen::MatrixXf p(static_cast<Eigen::Index>(subs.size()), w_.cols());
      for (index_t j = 0; j < subs.size(); ++j) {
        if (j + rows_ahead < subs.size()) idx_.prefetch_moments(first_sub_group + subs[j + rows_ahead]);
        const index_t g = first_sub_group + subs[j];
        idx_.decode_moments(g, row_.data());
        if (const float fit = idx_.variance_fits()[g]; fit != 1.f) row_.tail(row_.size() / 2) *= fit;  // its factor
        const auto r = static_cast<Eigen::Index>(j);
        for (Eigen::Index c = 0; c < w_.cols(); ++c) p(r, c) = row_.dot(w_.col(c)) + idx_.log_counts()[g];
      }
      return finish(std::move(p));
    }

    // Summary bytes read to score `count` groups: fp16 mean and variance, their two scales, log count, variance fit.
    std::uint64_t bytes(index_t count) const { return count * (2 * idx_.d() * sizeof(half) + 4 * sizeof(float)); }

   private:
    scores finish(Eigen::MatrixXf p) const {
      scores s;
      const auto g = static_cast<Eigen::Index>(heads_);
      s.lam = p.leftCols(g);
      s.pri = p.cols() == g ? s.lam : Eigen::MatrixXf(p.rightCols(g));  // optimism 1: the estimate itself
      s.log_z = log_sum_exp_cols(s.lam);
      return s;
    }
    static constexpr index_t rows_ahead = 4;  // summary rows asked for ahead of decoding
    const mog_index& idx_;
    index_t heads_;
    Eigen::MatrixXf w_;
    Eigen::VectorXf row_;  // one decoded [mean | variance] row: L1-sized scratch, not a block of rows
  };

  static Eigen::RowVectorXf log_sum_exp_cols(const Eigen::MatrixXf& lam) {
    Eigen::RowVectorXf out(lam.cols());
    for (Eigen::Index h = 0; h < lam.cols(); ++h) {
      if (lam.rows() == 0) {
        out[h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float top = lam.col(h).maxCoeff();
      out[h] = top + std::log((lam.col(h).array() - top).exp().sum());
    }
    return out;
  }

  // When the outliers and the members of each chosen subcluster are each one run of
  // consecutive positions (a cache in the adopted clustered order), adds those runs in
  // increasing order and returns true; otherwise adds nothing (the caller marks tokens).
  static bool add_whole_runs(const mog_index& idx, const std::vector<std::uint32_t>& subs, floe::selection& out) {
    std::vector<token_range> runs;
    runs.reserve(subs.size() + 1);
    auto run_of = [&](std::span<const std::uint32_t> m) {  // the index keeps every list increasing:
      if (m.empty()) return true;                           // a run iff it spans size() positions
      if (m.back() - m.front() + 1 != m.size()) return false;
      runs.push_back({m.front(), index_t{m.back()} + 1});
      return true;
    };
    if (!run_of(idx.outliers())) return false;
    for (auto s : subs)
      if (!run_of(idx.members(s))) return false;
    std::sort(runs.begin(), runs.end(), [](const token_range& a, const token_range& b) { return a.begin < b.begin; });
    for (const auto& r : runs) out.add(r.begin, r.end);
    return true;
  }

  // Adds the outliers, the members of subclusters `subs` and the tokens at `positions`, in
  // increasing order (all below idx.tokens()).
  static void add_marked(const mog_index& idx, const std::vector<std::uint32_t>& subs,
                         const std::vector<std::uint32_t>& positions, floe::selection& out) {
    std::vector<std::uint64_t> marks((idx.tokens() + 63) / 64, 0);
    auto mark = [&](std::uint32_t p) { marks[p >> 6] |= std::uint64_t{1} << (p & 63); };
    for (auto p : idx.outliers()) mark(p);
    for (auto s : subs)
      for (auto p : idx.members(s)) mark(p);
    for (auto p : positions) mark(p);
    for (index_t word = 0; word < marks.size(); ++word)
      for (std::uint64_t bits = marks[word]; bits != 0; bits &= bits - 1) {
        const index_t p = word * 64 + static_cast<index_t>(std::countr_zero(bits));
        out.add(p, p + 1);
      }
  }

  // mog_config::token_scan: the members of refined clusters that have 4-bit keys (or 2-bit
  // codes, mog_config::scan_code) are ranked one by one by their score estimates, the
  // subclusters of other refined clusters (formed by append) by their Gaussians, in one
  // order by largest estimated share of any head (maximin is not applied); a top-p budget
  // stops that order once every head's estimated covered share reaches p (and the floor is met). A scanned subcluster's unread members go
  // to the residual as one group with their summed estimated mass and the subcluster's value mean.
  template <class Exec>
  void select_tokens(const index& idx, const query_group& q, group_scorer& scorer, const scores& cl,
                     const std::vector<char>& refined, index_t left, index_t n, const Exec& exec, selection& out,
                     stats& st) const {
    const index_t heads = q.heads, clusters = idx.clusters(), scanned = idx.scanned_clusters();
    const quantized_keys& keys = idx.member_keys();
    const residual_codes& codes = idx.member_codes();
    const bool coded = codes.tokens() > 0;
    std::vector<std::uint32_t> cand;       // subclusters of refined clusters without 4-bit keys or codes
    std::vector<std::uint32_t> scanned_of;  // the refined scanned clusters, in member-row order
    index_t rows = 0;
    for (index_t c = 0; c < clusters; ++c) {
      if (!refined[c]) continue;
      if (c >= scanned) {
        for (index_t s = idx.first_subcluster(c); s < idx.first_subcluster(c + 1); ++s) cand.push_back(static_cast<std::uint32_t>(s));
        continue;
      }
      scanned_of.push_back(static_cast<std::uint32_t>(c));
      rows += member_rows(idx, c).size();
    }
    // Score estimates [heads, rows], scanned straight into place: the k-th scanned cluster's
    // member rows one after another. Long scans split over the executor's threads, in
    // pieces of whole clusters (each row's estimate is the same whichever thread makes it).
    thread_local std::vector<float> estimate;
    estimate.resize(heads * rows);
    const quantized_query prepared = coded ? quantized_query{} : keys.prepare(q);
    const index_t pieces = std::max<index_t>(1, std::min(lent_threads(exec), rows / scan_piece_rows));
    std::vector<index_t> first(pieces + 1, scanned_of.size());  // first scanned cluster of each piece
    std::vector<index_t> first_row(pieces + 1, rows);
    for (index_t k = 0, at = 0, p = 0; k < scanned_of.size() && p < pieces; at += member_rows(idx, scanned_of[k++]).size())
      while (p < pieces && at >= p * rows / pieces) first[p] = k, first_row[p++] = at;
    std::vector<float> piece_top(pieces * heads, -std::numeric_limits<float>::infinity());  // per piece and head: max
    float* const into = estimate.data();  // not `estimate` in the body: a worker's thread_local is another vector
    const auto scan_piece = [&](index_t p) {
      std::vector<float> part(heads);
      for (index_t k = first[p], at = first_row[p]; k < first[p + 1]; ++k) {
        const index_t c = scanned_of[k];
        const token_range r = member_rows(idx, c);
        if (coded) codes.scan(q, c, r.begin, r.end, into + at, rows, part.data());
        else keys.scan(prepared, r.begin, r.end, into + at, nullptr, rows, scan_kernel::automatic, part.data());
        for (index_t h = 0; h < heads; ++h) piece_top[p * heads + h] = std::max(piece_top[p * heads + h], part[h]);
        at += r.size();
      }
    };
    if (pieces == 1) scan_piece(0);
    else parallel_for_on(exec, pieces, scan_piece);
    std::vector<float> top(heads, -std::numeric_limits<float>::infinity());  // per head: max estimate
    for (index_t p = 0; p < pieces; ++p)
      for (index_t h = 0; h < heads; ++h) top[h] = std::max(top[h], piece_top[p * heads + h]);
    st.summary_bytes += rows * (coded ? codes.bytes_per_token() : keys.bytes_per_token()) +
                        scanned_of.size() * (2 * sizeof(std::uint32_t) + (coded ? codes.bytes_per_cluster() : 0));
    scores sub = scorer.rows_of(cand, clusters);
    st.summary_bytes += scorer.bytes(cand.size());

    // One greedy order by largest estimated share of any head: items [0, rows) are tokens,
    // the rest subclusters.
    std::vector<float> share(rows + cand.size(), -std::numeric_limits<float>::infinity());
    for (index_t h = 0; h < heads; ++h) {
      const float z = cl.log_z[static_cast<Eigen::Index>(h)];
      const float* e = estimate.data() + h * rows;
      for (index_t j = 0; j < rows; ++j) share[j] = std::max(share[j], e[j] - z);
      for (index_t j = 0; j < cand.size(); ++j)
        share[rows + j] = std::max(share[rows + j], sub.pri(static_cast<Eigen::Index>(j), static_cast<Eigen::Index>(h)) - z);
    }
    std::vector<char> chosen(share.size(), 0);
    std::vector<std::uint32_t> picked;
    std::vector<index_t> tokens;  // the chosen token items, ascending
    // Top-p: each head's estimated share of an item, and whether the taken items cover p of every head.
    const bool by_mass = limit.kind == budget::unit::mass;
    std::vector<double> covered(heads, 0.0);
    const auto cover = [&](index_t j) {
      for (index_t h = 0; h < heads; ++h) {
        const float lam = j < rows ? estimate[h * rows + j] : sub.log_mass(j - rows, h);
        covered[h] += std::exp(static_cast<double>(lam - cl.log_z[static_cast<Eigen::Index>(h)]));
      }
    };
    const auto enough = [&](index_t taken) { return by_mass && taken >= limit.floor && min_of(covered) >= limit.value; };
    const auto better = [&](index_t a, index_t b) { return share[a] > share[b] || (share[a] == share[b] && a < b); };
    if (cand.empty()) {  // tokens only, one each: the `left` largest shares (ties: lower rows), by radix selection
      tokens = ranking::top_k(share.data(), rows, std::min(rows, left));
      if (by_mass) tokens = covering_prefix(std::move(tokens), better, cover, enough);
      for (index_t j : tokens) chosen[j] = 1;
    } else {  // only the best `left + cand` items can be taken (each costs a token; only subclusters are skipped)
      std::vector<std::uint32_t> order(share.size());
      std::iota(order.begin(), order.end(), 0u);
      const auto top = order.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(order.size(), left + cand.size()));
      std::nth_element(order.begin(), top, order.end(), better);
      std::sort(order.begin(), top, better);
      index_t taken = 0;
      for (auto it = order.begin(); it != top && left > 0 && !enough(taken); ++it) {
        const index_t j = *it, size = j < rows ? 1 : idx.count(clusters + cand[j - rows]);
        if (size > left) continue;
        chosen[j] = 1;
        left -= size;
        taken += size;
        if (by_mass) cover(j);
        if (j >= rows) picked.push_back(cand[j - rows]);
      }
      for (index_t j = 0; j < rows; ++j)
        if (chosen[j]) tokens.push_back(j);
    }
    // Positions of the chosen rows: item j is row j - first of the scanned cluster whose rows cover it.
    std::vector<std::uint32_t> positions(tokens.size());
    token_range r = tokens.empty() ? token_range{0, 0} : member_rows(idx, scanned_of[0]);
    for (index_t k = 0, first = 0, c = 0; k < tokens.size(); ++k) {
      while (tokens[k] >= first + r.size()) first += r.size(), r = member_rows(idx, scanned_of[++c]);
      positions[k] = idx.member_position(r.begin + (tokens[k] - first));
    }
    index_t picked_members = 0;
    for (auto s : picked) picked_members += idx.count(clusters + s);
    st.summary_bytes += (idx.outliers().size() + positions.size() + picked_members) * sizeof(std::uint32_t) +
                        picked.size() * 2 * sizeof(std::uint32_t);
    out.add(0, idx.sinks());
    add_marked(idx, picked, positions, out);
    out.add(idx.tokens(), n);

    // Residual: unrefined clusters, unchosen subclusters, unread members of scanned subclusters.
    std::vector<float> masses;  // [groups, heads]
    for (index_t c = 0; c < clusters; ++c)
      if (!refined[c]) {
        out.residual_groups.push_back(static_cast<std::uint32_t>(c));
        for (index_t h = 0; h < heads; ++h) masses.push_back(cl.log_mass(c, h));
      }
    for (index_t j = 0; j < cand.size(); ++j)
      if (!chosen[rows + j]) {
        out.residual_groups.push_back(static_cast<std::uint32_t>(clusters + cand[j]));
        for (index_t h = 0; h < heads; ++h) masses.push_back(sub.log_mass(j, h));
      }
    unread_masses(idx, scanned_of, chosen, top, rows, estimate, out.residual_groups, masses);
    const index_t g = out.residual_groups.size();
    out.residual_log_mass.resize(heads * g);
    for (index_t r = 0; r < g; ++r)
      for (index_t h = 0; h < heads; ++h) out.residual_log_mass[h * g + r] = masses[r * heads + h];
  }

  // Top-p over tokens: of `tokens` (ascending), the fewest first in `better` order that make
  // enough(count) true (all of them if none do), ascending again.
  template <class Better, class Cover, class Enough>
  static std::vector<index_t> covering_prefix(std::vector<index_t> tokens, Better better, Cover cover, Enough enough) {
    std::sort(tokens.begin(), tokens.end(), better);
    index_t kept = 0;
    while (kept < tokens.size() && !enough(kept)) cover(tokens[kept++]);
    tokens.resize(kept);
    std::sort(tokens.begin(), tokens.end());
    return tokens;
  }

  // Member rows of cluster c: its subclusters' rows, consecutive.
  static token_range member_rows(const mog_index& idx, index_t c) {
    return {idx.first_member(idx.first_subcluster(c)), idx.first_member(idx.first_subcluster(c + 1))};
  }

  // Every scanned subcluster with an unread member becomes a residual group of log-mass
  // log sum exp(estimate) over its unread members, per head: exp(e - top[h]) (top: the
  // head's largest estimate) in one vector pass, then sums per subcluster; one whose sum
  // falls below 1e-30 (underflow) is summed again against its own maximum.
  static void unread_masses(const mog_index& idx, const std::vector<std::uint32_t>& scanned_of,
                            const std::vector<char>& chosen, const std::vector<float>& top, index_t rows,
                            const std::vector<float>& estimate, std::vector<std::uint32_t>& groups,
                            std::vector<float>& masses) {
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    const index_t heads = top.size();
    thread_local std::vector<float> keep, weight;  // keep: 0 for a read row, else 1; weight: keep * exp(e - top[h]), [heads, rows]
    keep.resize(rows);
    for (index_t j = 0; j < rows; ++j) keep[j] = chosen[j] ? 0.f : 1.f;
    weight.resize(heads * rows);
    for (index_t h = 0; h < heads; ++h) {
      const float* e = estimate.data() + h * rows;
      float* w = weight.data() + h * rows;
      const lanes t(top[h]);
      index_t j = 0;
      for (; j + L <= rows; j += L)
        (xsimd::exp(lanes::load_unaligned(e + j) - t) * lanes::load_unaligned(keep.data() + j)).store_unaligned(w + j);
      for (; j < rows; ++j) w[j] = keep[j] * std::exp(e[j] - top[h]);
    }
    index_t j = 0;
    for (auto c : scanned_of)
      for (index_t s = idx.first_subcluster(c); s < idx.first_subcluster(c + 1); ++s) {
        const index_t size = idx.first_member(s + 1) - idx.first_member(s);
        const char* read = chosen.data() + j;
        if (std::find(read, read + size, 0) != read + size) {
          groups.push_back(static_cast<std::uint32_t>(idx.clusters() + s));
          for (index_t h = 0; h < heads; ++h) {
            const float sum = sum_of(weight.data() + h * rows + j, size);
            masses.push_back(sum >= 1e-30f ? top[h] + std::log(sum) : unread_log_sum_exp(estimate.data() + h * rows + j, read, size));
          }
        }
        j += size;
      }
  }

  // Four running sums, not one: a single chain of dependent adds bounds the loop by add latency.
  static float sum_of(const float* x, index_t n) {
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    index_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (index_t k = 0; k < 4; ++k) a[k] += x[i + k];
    for (; i < n; ++i) a[0] += x[i];
    return (a[0] + a[1]) + (a[2] + a[3]);
  }

  // log sum exp(x_i) over the i with read[i] == 0 (one at least), against their maximum.
  static float unread_log_sum_exp(const float* x, const char* read, index_t n) {
    float top = -std::numeric_limits<float>::infinity();
    for (index_t i = 0; i < n; ++i)
      if (!read[i]) top = std::max(top, x[i]);
    double sum = 0.0;
    for (index_t i = 0; i < n; ++i)
      if (!read[i]) sum += std::exp(static_cast<double>(x[i]) - top);
    return top + static_cast<float>(std::log(sum));
  }

  static double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
};

}  // namespace floe::select
