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
#include <utility>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/default_init_vector.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/vector_exp.hpp"
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
  // Per head, sum_S w_i v_i (1 - pi_i) / pi_i as a partial (log mass, 1, mean value): the
  // Horvitz-Thompson estimate of the tokens left out (-inf and zeros when none).
  std::vector<double> residual_log_mass;
  std::vector<float> residual_mean;  // [heads][dv]
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
    residual_log_mass.clear();
    residual_mean.clear();
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
      floe::detail::widen(kv.value_row(i), row.data(), kv.dv());
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
  index_t levels = 40;  // grid levels, from ln n above the largest estimated weight down
  double certain = 2;   // w / tau at or above which a token is kept for sure (pi = 1)
  // true: the sample is drawn with the exact weights (the keys of every token the 4-bit
  // bounds cannot rule out are read); false: with the 4-bit estimates' weights (only the
  // sample's keys are read; still unbiased, as pi is known, with a looser certificate).
  bool exact_weights = true;
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

    // Score bounds of every indexed token; c_h = log sum_i exp(estimate_h,i), so that
    // e^{z - c_h} is about head h's attention probability.
    struct center_tag;
    struct radius_tag;
    struct upper_tag;
    struct gumbel_tag;
    struct sampling_tag;
    float* center = ranking::scratch<center_tag>(g * m);
    // Sampling by the estimates needs no radius: the grid starts at the largest estimate.
    float* radius = exact_weights ? ranking::scratch<radius_tag>(g * m) : nullptr;
    std::vector<float> top(g);
    idx.keys.scan(idx.keys.prepare(q), 0, m, center, radius, m, scan_kernel::automatic, top.data());
    io.summary_bytes += static_cast<std::uint64_t>(m) * idx.keys.bytes_per_token();
    std::vector<double> c(g);
    for (index_t h = 0; h < g; ++h) c[h] = top[h] + std::log(floe::detail::sum_exp(center + h * m, m, top[h]));
    // Per token: U_i = max_h (estimate + radius - c_h) >= u_i, and the log-weight the
    // sample is drawn with: the exact u_i (read later) or the estimate's.
    float* by_estimate = exact_weights ? nullptr : ranking::scratch<sampling_tag>(m);
    float* upper = exact_weights ? ranking::scratch<upper_tag>(m) : by_estimate;
    float* perturbation = ranking::scratch<gumbel_tag>(m);
    shared_log_weights(center, radius, c, g, m, upper, by_estimate);
    gumbels(perturbation_stream(q), m, perturbation);
    // The grid starts where the heaviest token by estimate is sampled with probability
    // about 1/m (so a small cap still finds a level); fixed before the draw. (Not from
    // the upper bounds: a wide radius would push the whole grid up.)
    double top_estimate = -std::numeric_limits<double>::infinity();
    for (index_t h = 0; h < g; ++h) top_estimate = std::max(top_estimate, double(top[h]) - c[h]);
    const double t0 = top_estimate + std::log(double(m));
    const double step = std::log(ratio), log_certain = std::log(certain);
    const float* reach_of = exact_weights ? upper : by_estimate;
    // Tokens by the level at which they may first be sampled or certain (exact weights:
    // candidates, decided once their keys are read; estimates: members from then on).
    thread_local default_init_vector<index_t> order;
    thread_local default_init_vector<std::int32_t> level_of;
    level_of.resize(m);
    std::vector<index_t> bucket_start(levels + 1, 0);
    arrival_levels(reach_of, perturbation, m, float(t0), float(step), float(log_certain), levels, level_of.data());
    for (index_t i = 0; i < m; ++i) ++bucket_start[level_of[i]];
    // Arrivals are members when sampling by the estimates: no level past the first whose
    // arrivals exceed the cap can be used, so only tokens up to it are sorted.
    index_t last = levels - 1;
    if (!exact_weights)
      for (index_t j = 0, sum = 0; j < levels; ++j)
        if ((sum += bucket_start[j]) > cap) {
          last = j;
          break;
        }
    std::fill(bucket_start.begin() + last + 1, bucket_start.end(), 0);
    for (index_t j = 0, sum = 0; j <= levels; ++j) sum += std::exchange(bucket_start[j], sum);
    order.resize(bucket_start[levels]);
    {
      std::vector<index_t> fill(bucket_start.begin(), bucket_start.end() - 1);
      for (index_t i = 0; i < m; ++i)
        if (index_t(level_of[i]) <= last) order[fill[level_of[i]]++] = i;
    }

    // Tokens read so far (candidates): exact scores, the sampling log-weight, the level
    // from which each is a member, and its value row once it is.
    thread_local sample_state st;
    st.reset(g, dv);
    index_t chosen = levels;  // the level used; `levels`: none
    level_summary summary;
    std::vector<index_t> members_at(levels + 1, 0);  // members first at level j
    index_t members = 0;
    for (index_t j = 0; j <= last; ++j) {
      const double t = t0 - double(j) * step;
      const index_t* fresh = order.data() + bucket_start[j];
      const index_t count = bucket_start[j + 1] - bucket_start[j];
      if (count) {
        const index_t first = st.add(kv, q, fresh, count, io);
        for (index_t k = first; k < st.size(); ++k) {
          const double u = exact_weights ? st.exact_u(k, c) : double(by_estimate[st.token[k]]);
          st.u[k] = u;
          const double reach = std::max(u + perturbation[st.token[k]], u - log_certain);
          const double level = std::max(double(j), std::ceil((t0 - reach) / step));
          st.level[k] = level < double(levels) ? static_cast<index_t>(level) : levels;
          ++members_at[st.level[k]];
        }
      }
      members += members_at[j];
      if (members > cap) break;
      chosen = j;
      if (epsilon == 0 && j + 1 < levels) continue;  // no target: evaluate the chosen level only
      evaluate(st, kv, j, t, c, idx.value_norm_max, summary);
      if (epsilon > 0 && summary.certificate <= epsilon) break;
    }
    if (epsilon > 0 && !(summary.certificate <= epsilon) && cap >= m) return read_all();
    if (chosen < levels && epsilon == 0) evaluate(st, kv, chosen, t0 - double(chosen) * step, c, idx.value_norm_max, summary);

    // The sample of the chosen level, ascending, then the unindexed tail.
    const double t = t0 - double(chosen) * step;
    std::vector<index_t> picked;
    for (index_t k = 0; k < st.size(); ++k)
      if (st.level[k] <= chosen && chosen < levels) picked.push_back(k);
    std::sort(picked.begin(), picked.end(), [&](index_t a, index_t b) { return st.token[a] < st.token[b]; });
    std::vector<index_t> listed;
    for (index_t k : picked) {
      out.add(st.token[k], st.token[k] + 1);
      if (!(st.u[k] >= t + log_certain)) {
        listed.push_back(k);
        out.sampled.push_back(st.token[k]);
        out.odds.push_back(1.0 / std::expm1(std::exp(st.u[k] - t)));
      }
    }
    out.add(m, n);
    out.scores.resize(g * listed.size());
    for (index_t s = 0; s < listed.size(); ++s)
      for (index_t h = 0; h < g; ++h) out.scores[h * listed.size() + s] = st.z[listed[s] * g + h];
    out.level = chosen;
    out.log_threshold = t;
    out.offsets = c;
    if (chosen < levels) {
      out.certificate = summary.certificate;
      out.residual_log_mass = summary.residual_log_mass;
      out.residual_mean = summary.residual_mean;
    } else {
      out.certificate = std::numeric_limits<double>::infinity();
    }
  }

  // The perturbations of one step: G_i = -log E_i, E_i ~ Exp(1), from a hash of the seed,
  // the query and i (a new query draws new ones; the same query and seed, the same ones).
  std::uint64_t perturbation_stream(const query_group& q) const { return query_hash(q) ^ seed; }
  // G_i = -log(-log1p(-V_i)), V_i uniform in (0, 1) from 32 bits: in float, G <= 22.9,
  // so a token of pi < 1e-10 is never sampled (a relative bias below n 1e-10 tau / D).
  static float gumbel(std::uint64_t stream, index_t i) {
    float g;
    gumbels(stream, 1, &g, i);
    return g;
  }
  // out[k] = G_{first + k} for k < count, the same values gumbel() gives one at a time:
  // 32 bits per token from a multiply-xorshift hash of (token, stream), in vector lanes.
  static void gumbels(std::uint64_t stream, index_t count, float* out, index_t first = 0) {
    using lanes = xsimd::batch<float>;
    using bits = xsimd::batch<std::uint32_t>;
    constexpr index_t L = lanes::size;
    static_assert(bits::size == L, "one hash lane per float lane");
    const bits k1(static_cast<std::uint32_t>(stream)), k2(static_cast<std::uint32_t>(stream >> 32));
    alignas(64) std::uint32_t index[L];
    alignas(64) float tail[L];
    for (index_t k0 = 0; k0 < count; k0 += L) {
      for (index_t k = 0; k < L; ++k) index[k] = static_cast<std::uint32_t>(first + k0 + k);
      bits x = bits::load_aligned(index) * bits(0x9e3779b9u) + k1;
      x ^= x >> 16, x *= bits(0x85ebca6bu), x ^= x >> 13, x *= bits(0xc2b2ae35u), x ^= x >> 16;
      x ^= k2, x *= bits(0x27d4eb2du), x ^= x >> 15;
      // V in (0, 1) from 32 bits (both halves exact in float); E = -log(1 - V) by its
      // series where V is small (1 - V would round), G = -log E.
      const lanes hi = xsimd::batch_cast<float>(xsimd::batch_cast<std::int32_t>(x >> 16));
      const lanes lo = xsimd::batch_cast<float>(xsimd::batch_cast<std::int32_t>(x & bits(0xffffu)));
      const lanes v = (hi * lanes(65536.f) + lo + lanes(0.5f)) * lanes(0x1p-32f);
      const lanes series = v * (lanes(1.f) + v * (lanes(0.5f) + v * (lanes(1.f / 3) + v * lanes(0.25f))));
      const lanes e = xsimd::select(v < lanes(0x1p-6f), series, -log_positive(lanes(1.f) - v));
      const lanes g = -log_positive(e);
      if (k0 + L <= count) {
        g.store_unaligned(out + k0);
      } else {
        g.store_aligned(tail);
        std::copy(tail, tail + (count - k0), out + k0);
      }
    }
  }

 private:
  // The tokens whose keys were read, in order of arrival (per thread, reused).
  struct sample_state {
    index_t g = 0, dv = 0;
    std::vector<index_t> token, level;  // level: first level where it is a member (`levels`: never)
    std::vector<double> u;              // the log-weight it is sampled with
    std::vector<float> z;               // [k][head] exact scores
    default_init_vector<float> values;  // [k][dv], loaded when first evaluated
    default_init_vector<float> norm_sq; // |v_k|^2, with the values
    std::vector<char> loaded;
    std::vector<float> block;
    void reset(index_t heads, index_t value_dim) {
      g = heads, dv = value_dim;
      token.clear(), level.clear(), u.clear(), z.clear(), values.clear(), norm_sq.clear(), loaded.clear();
    }
    index_t size() const { return token.size(); }
    template <KvView KV>
    index_t add(const KV& kv, const query_group& q, const index_t* fresh, index_t count, stats& io) {
      const index_t first = size();
      block.resize(g * count);
      io.key_bytes += ranking::gathered_scores(kv, q, fresh, count, block.data(), count);
      for (index_t k = 0; k < count; ++k) {
        token.push_back(fresh[k]);
        for (index_t h = 0; h < g; ++h) z.push_back(block[h * count + k]);
      }
      level.resize(size());
      u.resize(size());
      loaded.resize(size(), 0);
      norm_sq.resize(size());
      values.resize(size() * dv);
      return first;
    }
    double exact_u(index_t k, const std::vector<double>& c) const {
      double best = -std::numeric_limits<double>::infinity();
      for (index_t h = 0; h < g; ++h) best = std::max(best, double(z[k * g + h]) - c[h]);
      return best;
    }
  };

  // One level's certificate and residual partials.
  struct level_summary {
    double certificate = std::numeric_limits<double>::infinity();
    std::vector<double> residual_log_mass;  // [heads]
    std::vector<float> residual_mean;       // [heads][dv]
  };

  // Level j's certificate, the largest over heads: a Bernstein bound for the
  // Horvitz-Thompson error Y = N_hat - o D_hat (o_hat - o = Y / D_hat) with probability
  // 1 - delta / levels (Pinelis' inequality for sums of bounded independent vectors):
  // E|Y|^2 = sum_i w_i^2 (1 - pi_i) / pi_i |v_i - o|^2 over the not-certain tokens,
  // estimated from the sample (plug-in, so coverage is measured rather than proven;
  // with exact weights each w_i (1 - pi_i) / pi_i is replaced by its bound tau).
  // |X_i| <= b: see `term` below. Also the residual partial sum_S w v odds per head.
  template <KvView KV>
  void evaluate(sample_state& st, const KV& kv, index_t j, double t, const std::vector<double>& c,
                double value_norm_max, level_summary& out) const {
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    const index_t g = st.g, dv = st.dv, padded = (dv + L - 1) / L * L;
    const double tau = std::exp(t), log_certain = std::log(certain);
    const double log_union = std::log(2.0 * double(levels) / delta);
    thread_local std::vector<index_t> in;
    thread_local std::vector<float> odds, weight, coef, sums;  // sums: [3][padded] numerator, residual, spread
    thread_local std::vector<index_t> fresh;
    in.clear(), fresh.clear();
    for (index_t k = 0; k < st.size(); ++k) {
      if (st.level[k] > j) continue;
      in.push_back(k);
      if (!st.loaded[k]) fresh.push_back(k);
    }
    constexpr index_t ahead = 8;  // rows in flight: the gather is latency-bound
    for (index_t f = 0; f < fresh.size(); ++f) {
      if (f + ahead < fresh.size()) floe::detail::prefetch_row(kv.value_row(st.token[fresh[f + ahead]]), dv);
      const index_t k = fresh[f];
      float* v = st.values.data() + k * dv;
      floe::detail::widen(kv.value_row(st.token[k]), v, dv);
      lanes sq(0.f);
      index_t e = 0;
      for (; e + L <= dv; e += L) sq = xsimd::fma(lanes::load_unaligned(v + e), lanes::load_unaligned(v + e), sq);
      float rest = 0;
      for (; e < dv; ++e) rest += v[e] * v[e];
      st.norm_sq[k] = xsimd::hadd(sq) + rest;
      st.loaded[k] = 1;
    }
    odds.resize(in.size());
    for (index_t s = 0; s < in.size(); ++s) {
      const double u = st.u[in[s]];
      odds[s] = u >= t + log_certain ? 0.f : static_cast<float>(1.0 / std::expm1(std::exp(u - t)));
    }
    out.certificate = 0;
    out.residual_log_mass.assign(g, -std::numeric_limits<double>::infinity());
    out.residual_mean.assign(g * dv, 0.f);
    sums.resize(3 * padded);
    for (index_t h = 0; h < g; ++h) {
      std::fill(sums.begin(), sums.end(), 0.f);
      float* num = sums.data();
      float* res = num + padded;
      float* spread = res + padded;
      double den = 0, res_mass = 0, spread_weight = 0, spread_sq = 0;
      // |X_i| / |v_i - o| is w_i odds_i when sampled, w_i when not: the largest of these.
      // A token not certain has e^u < certain tau, so w < certain tau with exact weights
      // (with the estimates' weights, the estimate stands in for w: plug-in).
      double term = certain * tau;
      // Weights relative to the largest, so that float sums cannot overflow.
      double top = -std::numeric_limits<double>::infinity();
      for (index_t k : in) top = std::max(top, double(st.z[k * g + h]));
      const double scale = std::exp(top - c[h]);
      weight.resize(in.size());
      for (index_t s = 0; s < in.size(); ++s) weight[s] = static_cast<float>(double(st.z[in[s] * g + h]) - top);
      exp_in_place(weight.data(), in.size());
      coef.resize(3 * in.size());  // a = w / pi, r = w odds, b: per sampled token
      float* ca = coef.data();
      float* cr = ca + in.size();
      float* cb = cr + in.size();
      for (index_t s = 0; s < in.size(); ++s) {
        const float w = weight[s];
        const float a = w * (1 + odds[s]), r = w * odds[s];
        // (w / pi) * w (1 - pi) / pi, or with exact weights its bound (w / pi) tau.
        const float b = odds[s] == 0 ? 0.f : exact_weights ? a * static_cast<float>(tau / scale) : a * r;
        den += a, res_mass += r, spread_weight += b, spread_sq += double(b) * st.norm_sq[in[s]];
        term = std::max(term, double(r) * scale);
        ca[s] = a, cr[s] = r, cb[s] = b;
      }
      weighted_row_sums(st.values.data(), dv, in, ca, cr, cb, num, res, spread);
      if (res_mass > 0) {
        out.residual_log_mass[h] = top + std::log(res_mass);
        for (index_t e = 0; e < dv; ++e) out.residual_mean[h * dv + e] = static_cast<float>(res[e] / res_mass);
      }
      if (!(den > 0)) {
        out.certificate = std::numeric_limits<double>::infinity();
        continue;
      }
      double norm_sq = 0, cross = 0;
      for (index_t e = 0; e < dv; ++e) {
        const double o = num[e] / den;
        norm_sq += o * o;
        cross += o * spread[e];
      }
      // In units of e^{top}: sum (w / pi) w odds |v - o_hat|^2 (or with tau), then D_hat.
      const double variance = std::max(0.0, spread_sq - 2 * cross + norm_sq * spread_weight) * scale * scale;
      const double term_bound = term * 2 * value_norm_max;  // |v_i - o| <= 2 max |v|
      const double bound = std::sqrt(2 * variance * log_union) + (2.0 / 3.0) * term_bound * log_union;
      const double err = bound / (den * scale), norm = std::sqrt(norm_sq);
      out.certificate =
          std::max(out.certificate, norm > err ? err / (norm - err) : std::numeric_limits<double>::infinity());
    }
  }

  // level[i] = the first grid level where max(x_i + G_i, x_i - log certain) >= t_j, or
  // `levels` for none; in float, vectorised (the exact rule is applied when a token is read).
  static void arrival_levels(const float* x, const float* gumbel, index_t m, float t0, float step, float log_certain,
                             index_t levels, std::int32_t* level) {
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    const float inv = 1.f / step, cap = static_cast<float>(levels);
    auto one = [&](lanes xi, lanes gi) {
      const lanes reach = xsimd::max(xi + gi, xi - lanes(log_certain));
      // Rounded down a little: a token may arrive one level early (it is then read and
      // judged exactly), never late.
      const lanes j = xsimd::max(lanes(0.f), xsimd::ceil((lanes(t0) - reach) * lanes(inv) - lanes(1e-3f)));
      return xsimd::min(j, lanes(cap));
    };
    index_t i = 0;
    alignas(64) float tmp[L];
    for (; i + L <= m; i += L) {
      one(lanes::load_unaligned(x + i), lanes::load_unaligned(gumbel + i)).store_aligned(tmp);
      for (index_t k = 0; k < L; ++k) level[i + k] = static_cast<std::int32_t>(tmp[k]);
    }
    for (; i < m; ++i) {
      one(lanes(x[i]), lanes(gumbel[i])).store_aligned(tmp);
      level[i] = static_cast<std::int32_t>(tmp[0]);
    }
  }

  // num = sum_s a_s v_k(s), res = sum_s r_s v_k(s), spread = sum_s b_s v_k(s) over the
  // rows k = in[s] of `values` ([k][dv]); four vectors of each in registers at a time.
  static void weighted_row_sums(const float* values, index_t dv, const std::vector<index_t>& in, const float* a,
                                const float* r, const float* b, float* num, float* res, float* spread) {
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size, W = 4;
    index_t e0 = 0;
    for (; e0 + W * L <= dv; e0 += W * L) {
      lanes an[W], rn[W], bn[W];
      for (index_t w = 0; w < W; ++w) an[w] = rn[w] = bn[w] = lanes(0.f);
      for (index_t s = 0; s < in.size(); ++s) {
        const float* v = values + in[s] * dv + e0;
        const lanes as(a[s]), rs(r[s]), bs(b[s]);
        for (index_t w = 0; w < W; ++w) {
          const lanes x = lanes::load_unaligned(v + w * L);
          an[w] = xsimd::fma(as, x, an[w]);
          rn[w] = xsimd::fma(rs, x, rn[w]);
          bn[w] = xsimd::fma(bs, x, bn[w]);
        }
      }
      for (index_t w = 0; w < W; ++w) {
        an[w].store_unaligned(num + e0 + w * L);
        rn[w].store_unaligned(res + e0 + w * L);
        bn[w].store_unaligned(spread + e0 + w * L);
      }
    }
    for (index_t e = e0; e < dv; ++e) {  // the rest, element by element
      float x = 0, y = 0, z = 0;
      for (index_t s = 0; s < in.size(); ++s) {
        const float v = values[in[s] * dv + e];
        x += a[s] * v, y += r[s] * v, z += b[s] * v;
      }
      num[e] = x, res[e] = y, spread[e] = z;
    }
  }

  // log x for finite x > 0 (not subnormal), to about 1e-7 relative: exponent and mantissa
  // from the bits, the mantissa in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m-1)/(m+1)).
  // (xsimd 8.1's own log does not compile at -O0 for AVX-512BW.)
  template <class Lanes>
  static Lanes log_positive(const Lanes& x) {
    using ints = xsimd::batch<std::int32_t, typename Lanes::arch_type>;
    const ints b = xsimd::bitwise_cast<ints>(x);
    Lanes exponent = xsimd::batch_cast<float>((b >> 23) - ints(127));
    Lanes m = xsimd::bitwise_cast<Lanes>((b & ints(0x007fffff)) | ints(0x3f800000));
    const auto big = m > Lanes(1.41421356f);
    m = xsimd::select(big, m * Lanes(0.5f), m);
    exponent = xsimd::select(big, exponent + Lanes(1.f), exponent);
    const Lanes t = (m - Lanes(1.f)) / (m + Lanes(1.f)), t2 = t * t;
    const Lanes series =
        t * (Lanes(2.f) + t2 * (Lanes(2.f / 3) + t2 * (Lanes(2.f / 5) + t2 * (Lanes(2.f / 7) + t2 * Lanes(2.f / 9)))));
    return exponent * Lanes(0.693147180559945f) + series;
  }

  // x_i = exp(x_i), vectorised.
  static void exp_in_place(float* x, index_t count) {
    using lanes = xsimd::batch<float>;
    constexpr index_t L = lanes::size;
    index_t i = 0;
    for (; i + L <= count; i += L) xsimd::exp(lanes::load_unaligned(x + i)).store_unaligned(x + i);
    for (; i < count; ++i) x[i] = std::exp(x[i]);
  }


  // With radii: upper[i] = max_h (center + radius - c_h); else estimate[i] = max_h (center - c_h).
  static void shared_log_weights(const float* center, const float* radius, const std::vector<double>& c, index_t g,
                                 index_t m, float* upper, float* estimate) {
    float* out = radius ? upper : estimate;
    std::fill(out, out + m, -std::numeric_limits<float>::infinity());
    for (index_t h = 0; h < g; ++h) {
      const float ch = static_cast<float>(c[h]);
      const float* __restrict e = center + h * m;
      if (radius) {
        const float* __restrict r = radius + h * m;
        for (index_t i = 0; i < m; ++i) out[i] = std::max(out[i], e[i] + r[i] - ch);
      } else {
        for (index_t i = 0; i < m; ++i) out[i] = std::max(out[i], e[i] - ch);
      }
    }
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
};

}  // namespace floe::select
