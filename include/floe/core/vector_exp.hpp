// Sums of exponentials in vector lanes, for selectors that turn score estimates into
// masses (exp_threshold).
#pragma once

#include <cmath>

#include <xsimd/xsimd.hpp>

#include "floe/core/config.hpp"

namespace floe::detail {

// sum_i exp(x_i - top) over count floats; -inf entries add nothing.
inline double sum_exp(const float* x, index_t count, float top) {
  using lanes = xsimd::batch<float>;
  constexpr index_t L = lanes::size;
  lanes acc(0.f);
  index_t i = 0;
  for (; i + L <= count; i += L) acc += xsimd::exp(lanes::load_unaligned(x + i) - lanes(top));
  double sum = xsimd::hadd(acc);
  for (; i < count; ++i) sum += std::exp(double(x[i]) - top);
  return sum;
}

}  // namespace floe::detail
