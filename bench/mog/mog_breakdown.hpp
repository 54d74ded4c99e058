// Where MoG's error comes from, per query head (floe-mog-accuracy --breakdown): the output is
// recomputed in double from the selection (exact set read exactly, every residual group
// estimated by its Gaussian), then again with one class of residual groups replaced by the
// truth (their true mass and attention-weighted value mean). The class whose correction
// removes most of the error is where the error comes from. docs/methods/mog.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/select/mog_clusters.hpp"

namespace floe::bench {

// Counterfactual errors of one query head; corrected classes get their true (D_g, N_g).
struct mog_breakdown {
  double error = 0;           // recomputed (checks the reconstruction against the estimator)
  double fix_clusters = 0;    // unrefined clusters exact
  double fix_subclusters = 0; // unchosen subclusters of refined clusters exact
  double fix_spiky = 0;       // groups whose heaviest token holds >= 1/4 of the group's true mass exact
  double fix_smooth = 0;      // the other groups exact
  double fix_mass = 0;        // every group's true mass, its value mean kept
  double fix_value = 0;       // every group's true weighted value mean, its estimated mass kept
  double residual_share = 0;  // true share of mass outside the exact set
  double missed_share = 0;    // true share of mass of residual tokens among the top-B by weight (B = tokens read)
  // An oracle's floor at the same reads: B tokens read exactly, those outside the subclusters
  // (sinks, outliers, tail) and then the largest true weights (each head its own; or one set for
  // the group, by the largest share of any head); every other token from its subcluster's
  // stored value mean at the true unread mass.
  double floor_own = 0, floor_shared = 0;
};

// Relative L2 error of acc / mass against ref, dv elements.
inline double relative_error(const double* acc, double mass, const double* ref, index_t dv) {
  double num = 0, den = 0;
  for (index_t t = 0; t < dv; ++t) {
    const double o = acc[t] / mass;
    num += (o - ref[t]) * (o - ref[t]);
    den += ref[t] * ref[t];
  }
  return std::sqrt(num / den);
}

// Every head's scores s q.k_i in double, [heads, n].
template <KvView KV>
std::vector<double> true_scores(const KV& kv, const query_group& q) {
  const index_t n = kv.n(), d = kv.d();
  std::vector<double> z(q.heads * n);
  for (index_t h = 0; h < q.heads; ++h)
    for (index_t i = 0; i < n; ++i) {
      double dot = 0;
      const auto* k = kv.key_row(i);
      for (index_t t = 0; t < d; ++t) dot += static_cast<double>(q.row(h)[t]) * to_float(k[t]);
      z[h * n + i] = q.scale * dot;
    }
  return z;
}

// Fills floor_own and floor_shared of `out` (one per query head) for an exact budget of b
// tokens, from the heads' scores z (true_scores).
template <KvView KV>
void oracle_floors(const mog_index& idx, const KV& kv, const query_group& q, const std::vector<double>& z,
                   const std::vector<double>& reference, index_t b, std::vector<mog_breakdown>& out) {
  const index_t n = kv.n(), dv = kv.dv(), heads = q.heads;
  b = std::min(std::max<index_t>(b, 1), n);
  std::vector<std::int64_t> sub_of(n, -1);  // tokens outside every subcluster (sinks, outliers, tail) stay exact
  for (index_t s = 0; s < idx.subclusters(); ++s)
    for (auto p : idx.members(s)) sub_of[p] = static_cast<std::int64_t>(s);
  std::vector<double> log_total(heads);
  for (index_t h = 0; h < heads; ++h) {
    const double top = *std::max_element(z.begin() + static_cast<std::ptrdiff_t>(h * n), z.begin() + static_cast<std::ptrdiff_t>((h + 1) * n));
    double sum = 0;
    for (index_t i = 0; i < n; ++i) sum += std::exp(z[h * n + i] - top);
    log_total[h] = top + std::log(sum);
  }
  auto top_b = [&](auto key) {  // b tokens: every one outside the subclusters, then the largest keys
    std::vector<std::pair<double, index_t>> order(n);
    for (index_t i = 0; i < n; ++i) order[i] = {sub_of[i] < 0 ? INFINITY : key(i), i};
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(b - 1), order.end(), std::greater<>());
    std::vector<char> exact(n, 0);
    for (index_t i = 0; i < b; ++i) exact[order[i].second] = 1;
    for (index_t i = 0; i < n; ++i) exact[i] |= sub_of[i] < 0;  // should b be fewer than they are
    return exact;
  };
  const std::vector<char> shared = top_b([&](index_t i) {
    double m = -INFINITY;
    for (index_t h = 0; h < heads; ++h) m = std::max(m, z[h * n + i] - log_total[h]);
    return m;
  });
  std::vector<float> nu(dv);
  auto error_of = [&](index_t h, const std::vector<char>& exact) {
    std::vector<double> unread(idx.subclusters(), 0.0), acc(dv, 0.0);
    double mass = 0;
    for (index_t i = 0; i < n; ++i) {
      const double w = std::exp(z[h * n + i] - log_total[h]);
      if (!exact[i]) {
        unread[static_cast<index_t>(sub_of[i])] += w;
        continue;
      }
      mass += w;
      const auto* v = kv.value_row(i);
      for (index_t t = 0; t < dv; ++t) acc[t] += w * to_float(v[t]);
    }
    for (index_t s = 0; s < idx.subclusters(); ++s) {
      if (unread[s] == 0) continue;
      idx.decode_value_mean(idx.clusters() + s, nu.data());
      mass += unread[s];
      for (index_t t = 0; t < dv; ++t) acc[t] += unread[s] * nu[t];
    }
    return relative_error(acc.data(), mass, reference.data() + h * dv, dv);
  };
  for (index_t h = 0; h < heads; ++h) {
    out[h].floor_own = error_of(h, top_b([&](index_t i) { return z[h * n + i]; }));
    out[h].floor_shared = error_of(h, shared);
  }
}

template <KvView KV>
std::vector<mog_breakdown> breakdown(const mog_index& idx, const select::mog_clusters::selection& sel, const KV& kv,
                                     const query_group& q, const std::vector<double>& reference) {
  const index_t n = kv.n(), dv = kv.dv(), groups = sel.residual_groups.size();
  std::vector<char> exact(n, 0);
  index_t read = 0;
  for (const auto& r : sel.ranges)
    for (index_t i = r.begin; i < r.end; ++i) exact[i] = 1, ++read;
  // Members of every residual group.
  std::vector<std::vector<std::uint32_t>> members(groups);
  for (index_t j = 0; j < groups; ++j) {
    const index_t g = sel.residual_groups[j];
    if (g < idx.clusters()) {
      for (index_t s = idx.first_subcluster(g); s < idx.first_subcluster(g + 1); ++s)
        for (auto p : idx.members(s)) members[j].push_back(p);
    } else {
      for (auto p : idx.members(g - idx.clusters())) members[j].push_back(p);
    }
  }
  std::vector<mog_breakdown> out(q.heads);
  const std::vector<double> scores = true_scores(kv, q);
  std::vector<double> value_mean(groups * dv);
  std::vector<float> nu(dv);
  for (index_t j = 0; j < groups; ++j) {
    idx.decode_value_mean(sel.residual_groups[j], nu.data());
    for (index_t t = 0; t < dv; ++t) value_mean[j * dv + t] = nu[t];
  }
  for (index_t h = 0; h < q.heads; ++h) {
    const std::vector<double> z(scores.begin() + static_cast<std::ptrdiff_t>(h * n),
                                scores.begin() + static_cast<std::ptrdiff_t>((h + 1) * n));
    double top = *std::max_element(z.begin(), z.end());
    for (index_t j = 0; j < groups; ++j) top = std::max(top, static_cast<double>(sel.residual_log_mass[h * groups + j]));
    auto w = [&](index_t i) { return std::exp(z[i] - top); };
    // Heavy tokens: the top `read` by weight.
    std::vector<double> sorted(z);
    const index_t b = std::min(read, n);
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(b ? b - 1 : 0), sorted.end(), std::greater<>());
    const double heavy_z = b ? sorted[b - 1] : INFINITY;
    // Exact part and per-group truths.
    double l_exact = 0.0;
    std::vector<double> a_exact(dv, 0.0);
    double total = 0;
    for (index_t i = 0; i < n; ++i) {
      total += w(i);
      if (!exact[i]) continue;
      l_exact += w(i);
      const auto* v = kv.value_row(i);
      for (index_t t = 0; t < dv; ++t) a_exact[t] += w(i) * to_float(v[t]);
    }
    struct truth {
      double est_d, true_d, heaviest, missed_d;
      std::vector<double> true_n;
    };
    std::vector<truth> tr(groups);
    double missed = 0;
    for (index_t j = 0; j < groups; ++j) {
      truth& t = tr[j];
      t.est_d = std::exp(static_cast<double>(sel.residual_log_mass[h * groups + j]) - top);
      t.true_d = t.heaviest = t.missed_d = 0;
      t.true_n.assign(dv, 0.0);
      for (auto p : members[j]) {
        const double wi = w(p);
        t.true_d += wi;
        t.heaviest = std::max(t.heaviest, wi);
        const auto* v = kv.value_row(p);
        const bool heavy = z[p] >= heavy_z;
        if (heavy) t.missed_d += wi;
        for (index_t c = 0; c < dv; ++c) t.true_n[c] += wi * to_float(v[c]);
      }
      missed += t.missed_d;
    }
    auto err = [&](const std::vector<double>& acc, double den_l) {
      return relative_error(acc.data(), den_l, reference.data() + h * dv, dv);
    };
    auto error_with = [&](auto truth_of) {  // truth_of(j, t): group j at its true mass and value
      double l = l_exact;
      std::vector<double> a(a_exact);
      for (index_t j = 0; j < groups; ++j) {
        const truth& t = tr[j];
        if (truth_of(j, t)) {
          l += t.true_d;
          for (index_t c = 0; c < dv; ++c) a[c] += t.true_n[c];
        } else {
          l += t.est_d;
          for (index_t c = 0; c < dv; ++c) a[c] += t.est_d * value_mean[j * dv + c];
        }
      }
      return err(a, l);
    };
    mog_breakdown& r = out[h];
    r.error = error_with([](index_t, const truth&) { return false; });
    r.fix_clusters = error_with([&](index_t j, const truth&) { return sel.residual_groups[j] < idx.clusters(); });
    r.fix_subclusters = error_with([&](index_t j, const truth&) { return sel.residual_groups[j] >= idx.clusters(); });
    r.fix_spiky = error_with([](index_t, const truth& t) { return t.heaviest >= 0.25 * t.true_d; });
    r.fix_smooth = error_with([](index_t, const truth& t) { return t.heaviest < 0.25 * t.true_d; });
    {  // mass only / value only
      double l = l_exact, lv = l_exact;
      std::vector<double> a(a_exact), av(a_exact);
      for (index_t j = 0; j < groups; ++j) {
        const truth& t = tr[j];
        l += t.true_d;
        lv += t.est_d;
        for (index_t c = 0; c < dv; ++c) {
          a[c] += t.true_d * value_mean[j * dv + c];
          av[c] += t.true_d > 0 ? t.est_d * t.true_n[c] / t.true_d : t.est_d * value_mean[j * dv + c];
        }
      }
      r.fix_mass = err(a, l);
      r.fix_value = err(av, lv);
    }
    r.residual_share = (total - l_exact) / total;
    r.missed_share = missed / total;
  }
  oracle_floors(idx, kv, q, scores, reference, read, out);
  return out;
}

}  // namespace floe::bench
