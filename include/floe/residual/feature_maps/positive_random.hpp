// Feature map `positive_random` (FAVOR+): phi_m(x) = exp(w_m . x' - |x'|^2 / 2) / sqrt(M)
// with x' = sqrt(s) x and w_m ~ N(0, I_d), orthogonal by default. Unbiased:
// E[phi(q) . phi(k)] = exp(s q.k). docs/methods/retrieval-completion.md, "feature maps".
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "floe/residual/feature_maps/gaussian_directions.hpp"

namespace floe::residual {

struct positive_random {
  static constexpr std::string_view name = "positive_random";
  index_t features = 256;          // M
  bool orthogonal = true;
  std::uint64_t seed = 0x70726631;

  feature_params draw(const key_moments& keys) const {
    const Eigen::MatrixXd w = gaussian_directions(features, keys.d, orthogonal, seed);
    feature_params p;
    p.projection = (w * std::sqrt(keys.scale)).cast<float>();
    p.bias = Eigen::VectorXf::Constant(w.rows(), static_cast<float>(-0.5 * std::log(static_cast<double>(features))));
    p.scale = static_cast<float>(keys.scale);
    return p;
  }
};

}  // namespace floe::residual
