// Feature map `optimized_positive_random`: the positive features
//   phi_m(x) = D exp(A |w_m|^2 + B w_m . x' - |x'|^2 / 2) / sqrt(M),  x' = sqrt(s) x,
// with B = sqrt(1 - 4A) and D = (1 - 4A)^(d/4), unbiased for every A < 1/8 (A = 0 is
// positive_random). A is chosen at build to minimise the variance of one feature for a
// typical |q' + k'|^2 = R estimated from the keys (the root of 16 d A^2 + (4R - 2d) A - R
// = 0 below zero). docs/methods/retrieval-completion.md, "feature maps".
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "floe/residual/feature_maps/gaussian_directions.hpp"

namespace floe::residual {

struct optimized_positive_random {
  static constexpr std::string_view name = "optimized_positive_random";
  index_t features = 256;          // M
  bool orthogonal = true;
  std::uint64_t seed = 0x6f707266;
  // Expected |q|^2 of the decode queries (unscaled); 0 assumes the keys' mean |k|^2.
  double query_sq_norm = 0.0;

  // The variance-minimising A for a typical R = |q' + k'|^2 in dimension d.
  static double optimal_a(double r, double d) {
    return ((2.0 * d - 4.0 * r) - std::sqrt((4.0 * r - 2.0 * d) * (4.0 * r - 2.0 * d) + 64.0 * d * r)) / (32.0 * d);
  }

  feature_params draw(const key_moments& keys) const {
    const double d = static_cast<double>(keys.d);
    const double q2 = query_sq_norm > 0.0 ? query_sq_norm : keys.mean_sq_raw;
    const double a = optimal_a(keys.scale * (q2 + keys.mean_sq_centred), d);
    const double b = std::sqrt(1.0 - 4.0 * a);
    const Eigen::MatrixXd w = gaussian_directions(features, keys.d, orthogonal, seed);
    feature_params p;
    p.projection = (w * (b * std::sqrt(keys.scale))).cast<float>();
    const double log_norm = 0.25 * d * std::log(1.0 - 4.0 * a) - 0.5 * std::log(static_cast<double>(features));
    p.bias = (a * w.rowwise().squaredNorm().array() + log_norm).cast<float>().matrix();
    p.scale = static_cast<float>(keys.scale);
    return p;
  }
};

}  // namespace floe::residual
