// A low-rank sketch of the value rows of a region of the cache: the r principal
// directions U (dv x r) of the region's values at build, and per token the coordinates
// u_i = U^T (v_i - c) (c: the build-time mean) in fp16, stored per direction so that a
// pass over the tokens runs in vector lanes. The completion uses it for how the
// left-out tokens' values vary with their weights.
// docs/methods/retrieval-completion.md, "value sketch".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/core/selection.hpp"

namespace floe {

class value_sketch {
 public:
  value_sketch() = default;

  // Sketches region [b, e) of kv with `rank` directions (0: an empty sketch); append()
  // later takes tokens up to n - window.
  template <KvView KV>
  static value_sketch build(const KV& kv, token_range region, index_t window, index_t rank) {
    value_sketch s;
    s.window_ = window;
    s.dv_ = kv.dv();
    s.rank_ = region.size() > 0 ? std::min<index_t>(rank, kv.dv()) : 0;  // no directions of nothing
    s.region_ = {region.begin, region.begin};
    if (s.rank_ == 0) return s;
    const index_t n = region.size(), dv = kv.dv();
    // Mean, then covariance over blocks of rows: a few MiB at a time, not n x dv doubles.
    auto value = [&](index_t i, index_t j) { return static_cast<double>(to_float(kv.value_row(region.begin + i)[j])); };
    Eigen::RowVectorXd mean = Eigen::RowVectorXd::Zero(dv);
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < dv; ++j) mean(j) += value(i, j);
    mean /= static_cast<double>(n);
    constexpr index_t block = 4096;
    Eigen::MatrixXd cov = Eigen::MatrixXd::Zero(dv, dv), rows(std::min(block, n), dv);
    for (index_t i0 = 0; i0 < n; i0 += block) {
      const index_t m = std::min(block, n - i0);
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < dv; ++j) rows(i, j) = value(i0 + i, j) - mean(j);
      cov.noalias() += rows.topRows(m).transpose() * rows.topRows(m);
    }
    cov /= static_cast<double>(n);
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(cov);
    s.centre_.resize(dv);
    for (index_t j = 0; j < dv; ++j) s.centre_[j] = static_cast<float>(mean(j));
    s.basis_.resize(dv * s.rank_);  // [dv][rank], the largest eigenvalues first
    for (index_t k = 0; k < s.rank_; ++k)
      for (index_t j = 0; j < dv; ++j) s.basis_[j * s.rank_ + k] = static_cast<float>(eig.eigenvectors()(j, dv - 1 - k));
    s.add_rows(kv, region.end);
    return s;
  }

  template <KvView KV>
  void append(const KV& kv) {
    if (rank_ == 0) return;
    require(kv.dv() == dv_, "kv", "value sketch built for dv = ", dv_, "; the view has dv = ", kv.dv());
    require_view_covers(kv.n(), region_.end, "the value sketch");
    if (kv.n() > region_.end + window_) add_rows(kv, kv.n() - window_);
  }

  index_t rank() const { return rank_; }
  token_range region() const { return region_; }
  const float* basis() const { return basis_.data(); }    // [dv][rank]
  const float* centre() const { return centre_.data(); }  // [dv]
  // Direction k's coordinate of every region-relative token, in order.
  const half* coordinates(index_t k) const { return coordinates_[k].data(); }
  float coordinate(index_t k, index_t i) const { return coordinates_[k][i].to_float(); }
  // The sum of every token's coordinates over the region (rank doubles).
  const std::vector<double>& coordinate_sum() const { return coordinate_sum_; }
  // Bytes a step reads: every token's coordinates, the basis, the centre and the sums.
  std::uint64_t bytes() const {
    return rank_ * region_.size() * sizeof(half) + (basis_.size() + centre_.size()) * sizeof(float) +
           coordinate_sum_.size() * sizeof(double);
  }

 private:
  template <KvView KV>
  void add_rows(const KV& kv, index_t end) {
    coordinate_sum_.resize(rank_, 0.0);
    coordinates_.resize(rank_);
    std::vector<float> u(rank_);
    for (index_t i = region_.end; i < end; ++i) {
      std::fill(u.begin(), u.end(), 0.f);
      for (index_t j = 0; j < dv_; ++j) {
        const float x = to_float(kv.value_row(i)[j]) - centre_[j];
        for (index_t k = 0; k < rank_; ++k) u[k] += x * basis_[j * rank_ + k];
      }
      for (index_t k = 0; k < rank_; ++k) {
        const half c = half::from_float(std::clamp(u[k], -65504.f, 65504.f));  // finite in fp16
        coordinates_[k].push_back(c);
        coordinate_sum_[k] += static_cast<double>(c.to_float());
      }
    }
    region_.end = end;
  }

  index_t window_ = 0, dv_ = 0, rank_ = 0;
  token_range region_;
  std::vector<float> basis_, centre_;
  std::vector<std::vector<half>> coordinates_;  // [rank][tokens]
  std::vector<double> coordinate_sum_;
};

}  // namespace floe
