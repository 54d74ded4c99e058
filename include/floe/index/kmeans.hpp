// k-means for prefill-time indexes: k-means++ seeding on a sample, a fixed number of
// Lloyd iterations, empty clusters reseeded at the farthest points. docs/methods/mog.md.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/exec/parallel.hpp"

namespace floe {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct kmeans_config {
  index_t clusters = 1;
  index_t iterations = 6;    // Lloyd iterations after seeding
  index_t seed_sample = 8;   // k-means++ runs on min(n, max(seed_sample * k, 1024)) sampled points
  std::uint64_t seed = 1;
};

struct kmeans_result {
  row_matrix centroids;                // [k, d]; k <= clusters, every cluster non-empty
  std::vector<std::uint32_t> labels;   // [n]
  std::vector<float> sq_distance;      // [n] squared distance of each point to its centroid
};

namespace detail {

// Rows of x assigned to their nearest centroid: |x - c|^2 = |x|^2 - 2 x.c + |c|^2, blocked so
// that the x.c products are matrix products.
inline void kmeans_assign(const row_matrix& x, const row_matrix& c, std::vector<std::uint32_t>& labels,
                          std::vector<float>& sq_distance, const parallel_for_fn& parallel_for) {
  constexpr index_t block = 512;
  const index_t n = static_cast<index_t>(x.rows());
  const Eigen::VectorXf c_norm = c.rowwise().squaredNorm();
  labels.resize(n);
  sq_distance.resize(n);
  const index_t blocks = (n + block - 1) / block;
  parallel_for(blocks, [&](index_t b) {
    const index_t begin = b * block, rows = std::min(block, n - begin);
    const auto xb = x.middleRows(static_cast<Eigen::Index>(begin), static_cast<Eigen::Index>(rows));
    Eigen::MatrixXf dots(c.rows(), static_cast<Eigen::Index>(rows));  // column r: point r against every centroid
    dots.noalias() = c * xb.transpose();
    const index_t k = static_cast<index_t>(c.rows());
    for (index_t r = 0; r < rows; ++r) {
      const float* col = dots.data() + r * k;
      index_t best = 0;
      float value = c_norm[0] - 2.f * col[0];
      for (index_t j = 1; j < k; ++j) {
        const float v = c_norm[static_cast<Eigen::Index>(j)] - 2.f * col[j];
        if (v < value) {
          value = v;
          best = j;
        }
      }
      labels[begin + r] = static_cast<std::uint32_t>(best);
      sq_distance[begin + r] = std::max(0.f, xb.row(static_cast<Eigen::Index>(r)).squaredNorm() + value);
    }
  });
}

// k-means++ (D^2 sampling) on a sample of the rows. Stops early when every remaining
// sample point coincides with a chosen centre (duplicate keys): k may come out smaller.
inline row_matrix kmeans_seed(const row_matrix& x, index_t k, index_t sample_size, std::mt19937_64& rng) {
  const index_t n = static_cast<index_t>(x.rows());
  std::vector<index_t> pick(n);
  std::iota(pick.begin(), pick.end(), index_t{0});
  const index_t m = std::min(n, sample_size);
  for (index_t i = 0; i < m; ++i)  // partial Fisher-Yates: the first m entries are the sample
    std::swap(pick[i], pick[i + std::uniform_int_distribution<index_t>(0, n - 1 - i)(rng)]);
  row_matrix sample(static_cast<Eigen::Index>(m), x.cols());
  for (index_t i = 0; i < m; ++i) sample.row(static_cast<Eigen::Index>(i)) = x.row(static_cast<Eigen::Index>(pick[i]));

  // D^2 to the nearest chosen centre, updated by one matrix-vector product per new centre.
  const Eigen::VectorXf norms = sample.rowwise().squaredNorm();
  const auto dist_to = [&](index_t j) -> Eigen::VectorXf {
    const auto c = sample.row(static_cast<Eigen::Index>(j));
    const Eigen::ArrayXf scale = norms.array() + norms[static_cast<Eigen::Index>(j)];
    const Eigen::ArrayXf d = scale - 2.f * (sample * c.transpose()).array();
    return (d > 1e-6f * scale).select(d, 0.f).matrix();  // below rounding of the expansion: the same point
  };
  std::vector<index_t> chosen{std::uniform_int_distribution<index_t>(0, m - 1)(rng)};
  Eigen::VectorXf d2 = dist_to(chosen[0]);
  d2[static_cast<Eigen::Index>(chosen[0])] = 0.f;
  while (chosen.size() < k) {
    const double total = d2.cast<double>().sum();
    if (!(total > 0.0)) break;
    double u = std::uniform_real_distribution<double>(0.0, total)(rng);
    index_t next = m;
    for (index_t i = 0; i < m; ++i) {
      const double w = d2[static_cast<Eigen::Index>(i)];
      if (!(w > 0.0)) continue;
      next = i;  // the last positive weight absorbs rounding in u
      if ((u -= w) < 0.0) break;
    }
    chosen.push_back(next);
    d2 = d2.cwiseMin(dist_to(next));
    d2[static_cast<Eigen::Index>(next)] = 0.f;
  }
  row_matrix centroids(static_cast<Eigen::Index>(chosen.size()), x.cols());
  for (index_t j = 0; j < chosen.size(); ++j)
    centroids.row(static_cast<Eigen::Index>(j)) = sample.row(static_cast<Eigen::Index>(chosen[j]));
  return centroids;
}

}  // namespace detail

// Clusters the rows of x (n >= 1). Deterministic for a given config.seed and thread count
// independent: parallel_for only splits the assignment into blocks.
inline kmeans_result kmeans(const row_matrix& x, const kmeans_config& cfg, const parallel_for_fn& parallel_for = serial_for) {
  const index_t n = static_cast<index_t>(x.rows());
  const index_t k_asked = std::max<index_t>(1, std::min(cfg.clusters, n));
  std::mt19937_64 rng(cfg.seed);
  kmeans_result res;
  res.centroids = detail::kmeans_seed(x, k_asked, std::max<index_t>(cfg.seed_sample * k_asked, 1024), rng);

  for (index_t it = 0; it < cfg.iterations; ++it) {
    detail::kmeans_assign(x, res.centroids, res.labels, res.sq_distance, parallel_for);
    const index_t k = static_cast<index_t>(res.centroids.rows());
    Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> sums =
        Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>::Zero(static_cast<Eigen::Index>(k), x.cols());
    std::vector<index_t> counts(k, 0);
    for (index_t i = 0; i < n; ++i) {
      sums.row(res.labels[i]) += x.row(static_cast<Eigen::Index>(i)).cast<double>();
      ++counts[res.labels[i]];
    }
    // Empty clusters move to the points farthest from their centroids (distinct points).
    std::vector<index_t> empty;
    for (index_t j = 0; j < k; ++j)
      if (counts[j] == 0) empty.push_back(j);
    std::vector<index_t> far;
    if (!empty.empty()) {
      far.resize(n);
      std::iota(far.begin(), far.end(), index_t{0});
      const index_t take = std::min(empty.size(), n);
      std::partial_sort(far.begin(), far.begin() + static_cast<std::ptrdiff_t>(take), far.end(),
                        [&](index_t a, index_t b) { return res.sq_distance[a] > res.sq_distance[b]; });
      far.resize(take);
    }
    for (index_t j = 0, e = 0; j < k; ++j) {
      if (counts[j] > 0) {
        res.centroids.row(static_cast<Eigen::Index>(j)) =
            (sums.row(static_cast<Eigen::Index>(j)) / static_cast<double>(counts[j])).cast<float>();
      } else if (e < far.size() && res.sq_distance[far[e]] > 0.f) {
        res.centroids.row(static_cast<Eigen::Index>(j)) = x.row(static_cast<Eigen::Index>(far[e++]));
      }
    }
  }
  detail::kmeans_assign(x, res.centroids, res.labels, res.sq_distance, parallel_for);

  // Drop clusters left empty (duplicate points), renumbering labels densely.
  const index_t k = static_cast<index_t>(res.centroids.rows());
  std::vector<index_t> counts(k, 0);
  for (auto l : res.labels) ++counts[l];
  std::vector<std::uint32_t> renumber(k, 0);
  index_t kept = 0;
  for (index_t j = 0; j < k; ++j) {
    if (counts[j] == 0) continue;
    renumber[j] = static_cast<std::uint32_t>(kept);
    if (kept != j) res.centroids.row(static_cast<Eigen::Index>(kept)) = res.centroids.row(static_cast<Eigen::Index>(j));
    ++kept;
  }
  if (kept != k) {
    res.centroids.conservativeResize(static_cast<Eigen::Index>(kept), Eigen::NoChange);
    for (auto& l : res.labels) l = renumber[l];
  }
  return res;
}

}  // namespace floe
