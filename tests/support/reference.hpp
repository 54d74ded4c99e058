// The test suites' common yardstick: dense attention on the scalar reference executor
// (double accumulation and output) and the relative L2 error against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"

namespace floe::testing {

// Dense attention on the scalar reference, double output: [heads, dv].
template <KvView KV>
std::vector<double> dense_reference(const KV& kv, const query_group& q) {
  const estimator<select::dense, residual::none> dense;
  std::vector<double> out(q.heads * kv.dv());
  stats s;
  dense.decode(dense.build(kv), kv, q, exec::scalar{}, output_group<double>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

// ||got - want|| / ||want|| over n elements.
template <class G>
double relative_l2(const G* got, const double* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    num += e * e;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// The largest relative L2 error over the heads of a group ([heads, dv] rows).
template <class G>
double worst_head_error(const std::vector<G>& got, const std::vector<double>& want, index_t heads, index_t dv) {
  double worst = 0;
  for (index_t h = 0; h < heads; ++h) worst = std::max(worst, relative_l2(got.data() + h * dv, want.data() + h * dv, dv));
  return worst;
}

}  // namespace floe::testing
