// Shared by the topk and feature_map tests: a decode helper, the median of a sample, and
// the argument a bad call names (the dense reference and relative error:
// support/reference.hpp).
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
#include "support/argument_of.hpp"
#include "support/reference.hpp"

namespace floe::testing {

// Decodes one step with a built state; returns the output rows.
template <class Est, KvView KV, class Exec = exec::scalar>
std::vector<double> decode_output(const Est& est, const typename Est::state& st, const KV& kv, const query_group& q,
                                  stats& s, const Exec& exec = {}) {
  std::vector<double> out(q.heads * kv.dv());
  est.decode(st, kv, q, exec, output_group<double>{out.data(), q.heads, kv.dv(), 0}, s);
  return out;
}

// The median of a sample (the upper one of an even count); the sample is taken by value.
inline double median(std::vector<double> x) {
  const auto mid = x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2);
  std::nth_element(x.begin(), mid, x.end());
  return *mid;
}

}  // namespace floe::testing
