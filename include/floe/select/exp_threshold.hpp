// Selector `exp_threshold` (Elastic Threshold attention): each step, every indexed key i
// gets a fresh Exp(1) variable E_i and is sampled at threshold tau iff w_i / E_i >= tau,
// i.e. with probability pi_i = 1 - exp(-w_i / tau). A geometric grid of thresholds gives
// nested samples; the selector stops at the first level whose error certificate meets
// `epsilon`, or at the deepest level within `cap`. Candidates come from a 4-bit key scan
// whose score bounds are shared by the GQA group, so the sample is drawn with the exact
// weights. Pair it with residual::horvitz_thompson. docs/methods/exp-threshold.md.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/stats.hpp"
#include "floe/index/quantized_keys.hpp"
#include "floe/index/widen.hpp"
#include "floe/select/scorers/gathered_scores.hpp"
#include "floe/select/scorers/middle_ranking.hpp"

namespace floe::select {

// The exact set of exp_threshold and what the Horvitz-Thompson residual needs of it.
struct threshold_sample : floe::selection {
  index_t heads = 0;
  std::vector<index_t> sampled;  // sampled tokens kept with probability pi < 1, ascending
  std::vector<double> odds;      // (1 - pi_i) / pi_i of each
  std::vector<float> scores;     // [heads][sampled.size()]: the exact score z of each
  double certificate = std::numeric_limits<double>::quiet_NaN();  // see exp_threshold::select
  index_t level = 0;             // grid level used; `levels` when every token was read
  double log_threshold = 0;      // t = log tau of that level, in the units of u below
  std::vector<double> offsets;   // c_h: token i is sampled iff u_i + G_i >= t or u_i >= t + log certain,
                                 // u_i = max_h (z_h,i - c_h), G_i = exp_threshold::gumbel(...)

  void clear() {
    selection::clear();
    sampled.clear();
    odds.clear();
    scores.clear();
    certificate = std::numeric_limits<double>::quiet_NaN();
    level = 0;
    log_threshold = 0;
    offsets.clear();
  }
};

// 4-bit keys with deterministic score bounds, and the largest value norm (for the
// certificate's bounded-term constant).
struct threshold_index {
  quantized_keys keys;
  double value_norm_max = 0;

  template <KvView KV>
  void append(const KV& kv) {
    const index_t from = std::min(keys.tokens(), kv.n());
    keys.append(kv);
    if (kv.n() < measured_) value_norm_max = 0, measured_ = 0;  // cut back: measure again
    std::vector<float> row(kv.dv());
    for (index_t i = std::min(from, measured_); i < kv.n(); ++i) {
      detail::widen(kv.value_row(i), row.data(), kv.dv());
      double s = 0;
      for (float x : row) s += double(x) * x;
      require(std::isfinite(s), "values", "value ", i, " is not finite (NaN, Inf or overflowing norm)");
      value_norm_max = std::max(value_norm_max, std::sqrt(s));
    }
    measured_ = kv.n();
  }
  index_t tokens() const { return keys.tokens(); }
  std::uint64_t bytes() const { return keys.bytes() + sizeof(double); }

 private:
  index_t measured_ = 0;
};

struct exp_threshold {
  static constexpr std::string_view name = "exp_threshold";
  double epsilon = 0;   // certified relative L2 error to reach; 0: no target (deepest level within cap)
  index_t cap = std::numeric_limits<index_t>::max();  // most sampled tokens (exact reads)
  double delta = 0.05;  // a step's certificate may fail with this probability (union over levels)
  double ratio = 2;     // tau_j / tau_{j+1}
  index_t levels = 40;  // grid levels, from the largest weight bound down
  double certain = 2;   // w / tau at or above which a token is kept for sure (pi = 1)
  std::uint64_t seed = 0x5eed;  // perturbations are hash(seed, query, token): fresh each step

  // At most k tokens sampled, no certificate target; k >= n reads everything (dense).
  static exp_threshold with_budget(index_t k) {
    exp_threshold s;
    s.cap = k;
    return s;
  }
  // Stops at the first level certified to epsilon, reading at most `cap` tokens.
  static exp_threshold certified(double epsilon, index_t cap = std::numeric_limits<index_t>::max()) {
    exp_threshold s;
    s.epsilon = epsilon;
    s.cap = cap;
    return s;
  }

  using index = threshold_index;
  using selection = threshold_sample;

  template <KvView KV>
  index build(const KV& kv) const {
    validate();
    index idx;
    idx.keys = quantized_keys::build(kv);
    idx.append(kv);
    return idx;
  }

  void validate() const {
    require(std::isfinite(epsilon) && epsilon >= 0, "epsilon", "must be finite and >= 0, got ", epsilon);
    require(delta > 0 && delta < 1, "delta", "must lie in (0, 1), got ", delta);
    require(std::isfinite(ratio) && ratio > 1, "ratio", "must be finite and > 1, got ", ratio);
    require(levels >= 1 && levels <= 1000, "levels", "must lie in [1, 1000], got ", levels);
    require(std::isfinite(certain) && certain > 0, "certain", "must be finite and > 0, got ", certain);
  }

  // Writes the sample of one step. Tokens past the index (appended, not yet indexed) are
  // read exactly. The certificate (in `out`) bounds, for every head, ||o_hat - o|| / ||o||
  // of the Horvitz-Thompson output: 0 when every token is read, +inf when not certified.
  template <KvView KV, class Exec>
  void select(const index& idx, const KV& kv, const query_group& q, const Exec&, selection& out, stats& io) const {
    validate();
    require(idx.keys.d() == kv.d(), "index", "4-bit keys of d = ", idx.keys.d(), " for a cache of d = ", kv.d());
    out.clear();
    out.heads = q.heads;
    out.keys_counted = true;
    const index_t n = kv.n(), m = std::min(idx.tokens(), n), g = q.heads, dv = kv.dv();
    const std::uint64_t key_row = static_cast<std::uint64_t>(kv.d()) * sizeof(typename KV::element_type);
    auto read_all = [&] {
      out.ranges.clear();
      out.add(0, n);
      out.sampled.clear(), out.odds.clear(), out.scores.clear();
      out.certificate = 0;
      out.level = levels;
      io.key_bytes += n * key_row;
    };
    if (m == 0 || (epsilon == 0 && cap >= m)) return read_all();

    // Score bounds of every indexed token, and c_h = log sum_i exp(estimate): weights
    // are e^{z - c_h}, about head h's attention probabilities.
    struct center_tag;
    struct radius_tag;
    float* center = ranking::scratch<center_tag>(g * m);
    float* radius = ranking::scratch<radius_tag>(g * m);
    std::vector<float> top(g);
    idx.keys.scan(idx.keys.prepare(q), 0, m, center, radius, m, scan_kernel::automatic, top.data());
    io.summary_bytes += static_cast<std::uint64_t>(m) * idx.keys.bytes_per_token();
    std::vector<double> c(g);
    for (index_t h = 0; h < g; ++h) {
      double sum = 0;
      for (index_t i = 0; i < m; ++i) sum += std::exp(double(center[h * m + i]) - top[h]);
      c[h] = top[h] + std::log(sum);
    }
    // Group-shared log-weight u_i = max_h (z_h,i - c_h) (its upper bound here) plus the
    // Gumbel variable G_i = -log E_i: token i is sampled at level j iff u_i + G_i >= t_j.
    const std::uint64_t stream = perturbation_stream(q);
    const double step = std::log(ratio), log_certain = std::log(certain);
    std::vector<double> perturbation(m);
    std::vector<double> upper(m);
    double t0 = -std::numeric_limits<double>::infinity();
    for (index_t i = 0; i < m; ++i) {
      double u = -std::numeric_limits<double>::infinity();
      for (index_t h = 0; h < g; ++h) u = std::max(u, double(center[h * m + i]) + radius[h * m + i] - c[h]);
      upper[i] = u;
      perturbation[i] = gumbel(stream, i);
      t0 = std::max(t0, u);
    }
    // Candidates by the level at which their bound first admits them (sampled or certain).
    std::vector<std::vector<index_t>> arriving(levels);
    for (index_t i = 0; i < m; ++i) {
      const double reach = std::max(upper[i] + perturbation[i], upper[i] - log_certain);
      const double j = std::ceil((t0 - reach) / step);
      if (j < double(levels)) arriving[static_cast<index_t>(std::max(0.0, j))].push_back(i);
    }

    // Candidates read so far: token, exact u, exact z per head, value row (once sampled).
    std::vector<index_t> cand;
    std::vector<double> cand_u;
    std::vector<float> cand_z;      // [candidate][head]
    std::vector<float> cand_v;      // [candidate][dv], filled when first sampled
    std::vector<char> has_value;
    std::vector<float> z_block;
    auto member = [&](index_t k, double t) { return cand_u[k] + perturbation[cand[k]] >= t || cand_u[k] >= t + log_certain; };
    const double log_union = std::log(2.0 * double(levels) / delta);

    index_t chosen = levels;  // level used; `levels`: none (read everything or empty)
    double chosen_certificate = std::numeric_limits<double>::infinity();
    std::vector<index_t> members, chosen_members;
    for (index_t j = 0; j < levels; ++j) {
      const double t = t0 - double(j) * step;
      const std::vector<index_t>& fresh = arriving[j];
      if (!fresh.empty()) {
        z_block.resize(g * fresh.size());
        io.key_bytes += ranking::gathered_scores(kv, q, fresh.data(), fresh.size(), z_block.data(), fresh.size());
        for (index_t k = 0; k < fresh.size(); ++k) {
          double u = -std::numeric_limits<double>::infinity();
          for (index_t h = 0; h < g; ++h) {
            cand_z.push_back(z_block[h * fresh.size() + k]);
            u = std::max(u, double(z_block[h * fresh.size() + k]) - c[h]);
          }
          cand.push_back(fresh[k]);
          cand_u.push_back(u);
          has_value.push_back(0);
        }
        cand_v.resize(cand.size() * dv);
      }
      members.clear();
      for (index_t k = 0; k < cand.size(); ++k)
        if (member(k, t)) members.push_back(k);
      if (members.size() > cap) break;
      for (index_t k : members)
        if (!has_value[k]) {
          detail::widen(kv.value_row(cand[k]), cand_v.data() + k * dv, dv);
          has_value[k] = 1;
        }
      const double cert = certify(members, cand_u, cand_z, cand_v, c, g, dv, t, log_union, idx.value_norm_max);
      chosen = j;
      chosen_certificate = cert;
      chosen_members = members;
      if (epsilon > 0 && cert <= epsilon) break;
    }
    if (epsilon > 0 && !(chosen_certificate <= epsilon) && cap >= m) return read_all();

    // The sample of the chosen level, ascending, then the unindexed tail.
    std::sort(chosen_members.begin(), chosen_members.end(), [&](index_t a, index_t b) { return cand[a] < cand[b]; });
    const double t = t0 - double(chosen) * step;
    for (index_t k : chosen_members) {
      out.add(cand[k], cand[k] + 1);
      if (chosen < levels && !(cand_u[k] >= t + log_certain)) {
        out.sampled.push_back(cand[k]);
        out.odds.push_back(1.0 / std::expm1(std::exp(cand_u[k] - t)));
      }
    }
    out.add(m, n);
    out.scores.resize(g * out.sampled.size());
    for (index_t s = 0, k = 0; k < chosen_members.size(); ++k) {
      const index_t cidx = chosen_members[k];
      if (s < out.sampled.size() && out.sampled[s] == cand[cidx]) {
        for (index_t h = 0; h < g; ++h) out.scores[h * out.sampled.size() + s] = cand_z[cidx * g + h];
        ++s;
      }
    }
    out.level = chosen;
    out.log_threshold = t;
    out.offsets = c;
    out.certificate = chosen < levels ? chosen_certificate : std::numeric_limits<double>::infinity();
  }

  // The perturbations of one step: G_i = -log E_i, E_i ~ Exp(1), from a hash of the seed,
  // the query and i (a new query draws new ones; the same query and seed, the same ones).
  std::uint64_t perturbation_stream(const query_group& q) const { return query_hash(q) ^ seed; }
  static double gumbel(std::uint64_t stream, index_t i) { return -std::log(-std::log(uniform(stream, i))); }

 private:
  // The level's certificate, the largest over heads: a Bernstein bound for the
  // Horvitz-Thompson error Y = N_hat - o D_hat (o_hat - o = Y / D_hat) with probability
  // 1 - delta / levels (Pinelis' inequality for sums of bounded independent vectors):
  // E|Y|^2 <= tau sum w_i |v_i - o|^2 over the not-certain tokens, that sum estimated
  // from the sample (plug-in, so the coverage is measured rather than proven).
  double certify(const std::vector<index_t>& members, const std::vector<double>& cand_u,
                 const std::vector<float>& cand_z, const std::vector<float>& cand_v, const std::vector<double>& c,
                 index_t g, index_t dv, double t, double log_union, double value_norm_max) const {
    const double tau = std::exp(t), log_certain = std::log(certain);
    // |X_i| <= tau |v_i - o| when sampled, w_i |v_i - o| < certain tau |v_i - o| when not.
    const double term_bound = std::max(certain, 1.0) * tau * 2 * value_norm_max;
    double worst = 0;
    std::vector<double> num(dv), spread_sum(dv);
    for (index_t h = 0; h < g; ++h) {
      std::fill(num.begin(), num.end(), 0.0);
      std::fill(spread_sum.begin(), spread_sum.end(), 0.0);
      double den = 0, spread_weight = 0, spread_sq = 0;
      for (index_t k : members) {
        const bool sure = cand_u[k] >= t + log_certain;
        const double w = std::exp(double(cand_z[k * g + h]) - c[h]);
        const double a = sure ? w : -w / std::expm1(-std::exp(cand_u[k] - t));  // w / pi
        const float* v = cand_v.data() + k * dv;
        den += a;
        double sq = 0;
        for (index_t j = 0; j < dv; ++j) num[j] += a * v[j], sq += double(v[j]) * v[j];
        if (sure) continue;
        spread_weight += a;
        spread_sq += a * sq;
        for (index_t j = 0; j < dv; ++j) spread_sum[j] += a * v[j];
      }
      if (!(den > 0)) return std::numeric_limits<double>::infinity();
      double norm_sq = 0, cross = 0;
      for (index_t j = 0; j < dv; ++j) {
        const double o = num[j] / den;
        norm_sq += o * o;
        cross += o * spread_sum[j];
      }
      // sum over sampled uncertain tokens of (w / pi) |v - o_hat|^2
      const double spread = std::max(0.0, spread_sq - 2 * cross + norm_sq * spread_weight);
      const double variance = tau * spread;
      const double bound = std::sqrt(2 * variance * log_union) + (2.0 / 3.0) * term_bound * log_union;
      const double err = bound / den, norm = std::sqrt(norm_sq);
      worst = std::max(worst, norm > err ? err / (norm - err) : std::numeric_limits<double>::infinity());
    }
    return worst;
  }

  static std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  static std::uint64_t query_hash(const query_group& q) {
    std::uint64_t hsh = mix(q.heads * 0x100000001b3ull + q.d);
    for (index_t h = 0; h < q.heads; ++h)
      for (index_t t = 0; t < q.d; ++t) hsh = mix(hsh ^ std::bit_cast<std::uint32_t>(q.row(h)[t]));
    return hsh;
  }
  // Uniform in (0, 1), never 0 or 1, so that both logs of the Gumbel variable are finite.
  static double uniform(std::uint64_t stream, index_t i) {
    return (double(mix(stream + 0x632be59bd9b4e019ull * (i + 1)) >> 11) + 0.5) * 0x1p-53;
  }
};

}  // namespace floe::select
