// Shared helpers of the SIMD executor tests: the architectures to run, and the relative
// L2 error of the SIMD result against the scalar (double) reference.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "floe/exec/scalar.hpp"
#include "floe/exec/simd.hpp"

namespace floe::testing {

// Every architecture compiled into floe::simd that this CPU can run.
inline std::vector<simd_arch> runnable_archs() {
  std::vector<simd_arch> out;
  for (simd_arch a : {simd_arch::scalar, simd_arch::avx2, simd_arch::avx512})
    if (simd_compiled(a) && cpu_supports(a)) out.push_back(a);
  return out;
}

// Largest relative L2 error over heads of the finalized SIMD partials against the
// finalized scalar partials; an empty reference head must be empty in both.
inline double max_relative_error(const partial_set<float>& got, const partial_set<double>& want) {
  double worst = 0.0;
  for (index_t h = 0; h < want.heads(); ++h) {
    if (want.empty(h)) {
      if (!got.empty(h)) return std::numeric_limits<double>::infinity();
      continue;
    }
    double num = 0.0, den = 0.0;
    for (index_t j = 0; j < want.dv(); ++j) {
      const double o = want.a(h)[j] / want.l(h);
      const double e = static_cast<double>(got.a(h)[j]) / static_cast<double>(got.l(h)) - o;
      num += e * e;
      den += o * o;
    }
    const double rel = std::sqrt(num) / std::sqrt(den);
    if (!(rel <= worst)) worst = rel;  // NaN propagates as a failure
  }
  return worst;
}

// Relative L2 error of output rows [heads, dv] (row strides given) against a reference.
inline double max_relative_error(const float* got, index_t got_stride, const float* want, index_t want_stride,
                                 index_t heads, index_t dv) {
  double worst = 0.0;
  for (index_t h = 0; h < heads; ++h) {
    double num = 0.0, den = 0.0;
    for (index_t j = 0; j < dv; ++j) {
      const double e = static_cast<double>(got[h * got_stride + j]) - want[h * want_stride + j];
      num += e * e;
      den += static_cast<double>(want[h * want_stride + j]) * want[h * want_stride + j];
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (!(rel <= worst)) worst = rel;
  }
  return worst;
}

}  // namespace floe::testing
