// Random projection directions for positive random features: M rows, each marginally
// N(0, I_d). Orthogonal draws take blocks of d mutually orthogonal rows (QR of a Gaussian
// matrix) with row lengths redrawn from the chi distribution: the same marginal law,
// lower variance. What a map is: docs/methods/retrieval-completion.md, "feature maps".
#pragma once

#include <Eigen/Core>
#include <Eigen/QR>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"

namespace floe::residual {

// The log-features of one map: log phi_m(x) = bias_m + (W x)_m - (s/2)|x|^2, with
// E_W[phi(q) . phi(k)] = exp(s q.k) for the score scale s.
struct feature_params {
  Eigen::MatrixXf projection;  // W: [M, d]
  Eigen::VectorXf bias;        // [M]
  float scale = 0.f;           // s
  index_t features() const { return static_cast<index_t>(projection.rows()); }
};

// What a map may use to tune itself, measured on the keys it will summarise.
struct key_moments {
  index_t d = 0;
  double scale = 0.0;               // s
  double mean_sq_centred = 0.0;     // mean |k - c|^2 over the summarised keys
  double mean_sq_raw = 0.0;         // mean |k|^2 over the same keys
};

inline Eigen::MatrixXd gaussian_directions(index_t m, index_t d, bool orthogonal, std::uint64_t seed) {
  require(m > 0, "features", "a feature map needs at least one feature (M = 0)");
  std::mt19937_64 g(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto rows = static_cast<Eigen::Index>(m), dims = static_cast<Eigen::Index>(d);
  Eigen::MatrixXd w(rows, dims);
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index t = 0; t < dims; ++t) w(i, t) = normal(g);
  if (!orthogonal) return w;
  for (Eigen::Index first = 0; first < rows; first += dims) {
    Eigen::MatrixXd square(dims, dims);
    for (Eigen::Index i = 0; i < dims; ++i)
      for (Eigen::Index t = 0; t < dims; ++t) square(i, t) = normal(g);
    const Eigen::HouseholderQR<Eigen::MatrixXd> qr(square);
    const Eigen::MatrixXd q = qr.householderQ();
    for (Eigen::Index r = 0; r < std::min(dims, rows - first); ++r) {
      double chi2 = 0.0;  // a fresh row length, distributed as |N(0, I_d)|
      for (Eigen::Index t = 0; t < dims; ++t) {
        const double x = normal(g);
        chi2 += x * x;
      }
      // Signs of R's diagonal make Q Haar-distributed, so each row is uniform on the sphere.
      const double sign = qr.matrixQR()(r, r) < 0.0 ? -1.0 : 1.0;
      w.row(first + r) = q.col(r).transpose() * (sign * std::sqrt(chi2));
    }
  }
  return w;
}

}  // namespace floe::residual
