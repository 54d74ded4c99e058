// Shared helpers of the MoG tests: clustered random caches and the estimators under test
// (the dense reference and relative error: support/reference.hpp).
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "support/reference.hpp"
#include "floe/select/mog_clusters.hpp"
#include "support/random_kv.hpp"

namespace floe::testing {

using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
using mog_none = estimator<select::mog_clusters, residual::none>;

inline select::mog_clusters mog_selector(budget b, mog_config cfg = {}) {
  select::mog_clusters s;
  s.limit = b;
  s.config = cfg;
  return s;
}

// Keys drawn around `topics` centres (so that clusters exist), values correlated with
// the topic; written over the storage of `kv` in place.
template <KvElement T>
void make_clustered(random_kv<T>& kv, std::mt19937_64& g, index_t topics, float spread = 0.5f, float centre_sigma = 1.f) {
  const auto centres = random_floats(g, topics * kv.d, centre_sigma);
  const auto value_centres = random_floats(g, topics * kv.dv, 1.f);
  std::uniform_int_distribution<index_t> pick(0, topics - 1);
  std::normal_distribution<float> noise(0.f, spread);
  for (index_t i = 0; i < kv.n; ++i) {
    const index_t c = pick(g);
    T* k = kv.paged() ? const_cast<T*>(kv.paged_view().key_row(i)) : kv.keys.data() + i * kv.key_stride;
    T* v = kv.paged() ? const_cast<T*>(kv.paged_view().value_row(i)) : kv.values.data() + i * kv.value_stride;
    for (index_t t = 0; t < kv.d; ++t) k[t] = from_float<T>(centres[c * kv.d + t] + noise(g));
    for (index_t j = 0; j < kv.dv; ++j) v[j] = from_float<T>(value_centres[c * kv.dv + j] + noise(g));
  }
}

// Group gid's estimated log-mass for a query row: the Gaussian formula with the variance term
// times the index's fitted factor (mog_config::variance_fit_probes) and times `tempering`.
inline double fitted_log_mass(const mog_index& idx, std::uint32_t gid, const float* q, index_t d, double scale,
                              double tempering = 1.0) {
  std::vector<float> var = idx.variance(gid);
  for (float& v : var) v *= static_cast<float>(tempering) * idx.variance_fits()[gid];
  return gaussian_log_mass(std::log(static_cast<double>(idx.count(gid))), idx.mean(gid).data(), var.data(), q, d, scale);
}

// Runs est on (kv, q) and returns the output rows [heads, dv].
template <class Est, KvView KV>
std::vector<float> decode(const Est& est, const typename Est::state& st, const KV& kv, const query_group& q, stats& s) {
  std::vector<float> out(q.heads * kv.dv(), std::nanf(""));
  est.decode(st, kv, q, exec::scalar{}, output_group<float>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

}  // namespace floe::testing
