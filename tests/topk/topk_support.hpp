// Shared by the topk and feature_map tests: the dense scalar reference, relative error,
// a decode helper, and the argument a bad call names.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"

namespace floe::testing {

template <KvView KV>
std::vector<double> dense_output(const KV& kv, const query_group& q) {
  estimator<select::dense, residual::none> dense;
  std::vector<double> out(q.heads * kv.dv());
  stats s;
  dense.decode(dense.build(kv), kv, q, exec::scalar{}, output_group<double>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

// Decodes one step with a built state; returns the output rows.
template <class Est, KvView KV, class Exec = exec::scalar>
std::vector<double> decode_output(const Est& est, const typename Est::state& st, const KV& kv, const query_group& q,
                                  stats& s, const Exec& exec = {}) {
  std::vector<double> out(q.heads * kv.dv());
  est.decode(st, kv, q, exec, output_group<double>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

inline double relative_l2(const double* got, const double* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// The median of a sample (the upper one of an even count); the sample is taken by value.
inline double median(std::vector<double> x) {
  const auto mid = x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2);
  std::nth_element(x.begin(), mid, x.end());
  return *mid;
}

// The largest relative L2 error over the heads of a group.
inline double worst_head_error(const std::vector<double>& got, const std::vector<double>& want, index_t heads, index_t dv) {
  double worst = 0;
  for (index_t h = 0; h < heads; ++h) worst = std::max(worst, relative_l2(got.data() + h * dv, want.data() + h * dv, dv));
  return worst;
}

// The argument a call's floe::invalid_argument names, or "(nothing thrown)".
template <class F>
std::string argument_of(F&& f) {
  try {
    f();
  } catch (const floe::invalid_argument& e) {
    return e.argument();
  }
  return "(nothing thrown)";
}

}  // namespace floe::testing
