// The Mixture-of-Gaussians index of one (layer, KV head): ~sqrt(n) key clusters, ~ln n
// subclusters in each, every group summarised by its count, key mean, diagonal key
// variance and value mean. Tokens are referenced by position in the caller's cache,
// subcluster by subcluster. docs/methods/mog.md.
#pragma once

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/index/kmeans.hpp"

namespace floe {

struct mog_config {
  index_t clusters = 0;           // 0: round(sqrt(n))
  index_t subclusters = 0;        // per cluster; 0: max(1, round(ln n))
  index_t iterations = 6;         // Lloyd iterations at each level
  index_t tail_capacity = 256;    // appended tokens stay exact until this many wait
  double rebuild_growth = 0.5;    // re-cluster once appended tokens reach this fraction of those clustered at build
  double rebuild_drift = 2.0;     // ... or once they lie this many times farther from their centroids (mean squared)
  index_t rebuild_min_tokens = 1024;  // the drift test needs this many appended tokens to be meaningful
  double split_factor = 3.0;      // a (sub)cluster grown past this x the mean size at build is re-clustered alone
  double join_sigma = 4.0;        // an appended token joins a cluster if its squared distance is within
                                  // spread (1 + join_sigma sqrt(2/d)), spread = the members' mean (chi-square tail)
  index_t sinks = 4;              // the first tokens (attention sinks) are never clustered, always exact
  index_t window = 0;             // nor are the most recent ones
  double outlier_sigma = 8.0;     // a key whose squared Mahalanobis distance exceeds d + sigma sqrt(2d)...
  double outlier_fraction = 0.005;  // ... becomes a cluster of its own, for at most this fraction of tokens
  bool cross_covariance = false;  // keep Cov(v, k) per cluster: dv x d floats each
  std::uint64_t seed = 0x6d6f67;
  // Optional sample of queries (rows of d floats, e.g. the last prefill queries of the GQA
  // group): k-means then uses the metric E[(q.(k - k'))^2], so that clusters group keys the
  // queries score alike. Empty: plain Euclidean k-means.
  std::vector<float> query_sample;
  double query_metric_ridge = 0.1;  // adds this fraction of the mean eigenvalue to every direction
};

// log(n E[exp(s q.k)]) for k ~ N(mean, diag(variance)): log n + s q.mean + s^2/2 sum q_t^2 var_t.
FLOE_HOST_DEVICE inline double gaussian_log_mass(double log_count, const float* mean, const float* variance,
                                                 const float* q, index_t d, double scale) {
  double dot = 0.0, spread = 0.0;
  for (index_t t = 0; t < d; ++t) {
    dot += static_cast<double>(q[t]) * mean[t];
    spread += static_cast<double>(q[t]) * q[t] * variance[t];
  }
  return log_count + scale * dot + 0.5 * scale * scale * spread;
}

class mog_index {
 public:
  mog_index() = default;

  // Clusters the n tokens of kv. Rejects NaN/Inf keys or values naming the token.
  template <KvView KV>
  static mog_index build(const KV& kv, const mog_config& cfg = {}, const parallel_for_fn& parallel_for = serial_for) {
    mog_index idx;
    idx.cfg_ = cfg;
    idx.rebuild(kv, parallel_for);
    return idx;
  }

  // Takes in tokens [tokens(), kv.n()) of a cache that grew by decoding. They stay in the
  // exact tail until tail_capacity wait beyond the recent window; then those older than the
  // window join their nearest cluster and subcluster (Welford updates). Past the growth or
  // drift threshold the whole cache is re-clustered.
  template <KvView KV>
  void append(const KV& kv, const parallel_for_fn& parallel_for = serial_for) {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "index built for d = ", d_, ", dv = ", dv_, "; the view has d = ",
            kv.d(), ", dv = ", kv.dv());
    require(kv.n() >= n_, "kv", "the view holds ", kv.n(), " tokens, fewer than the ", n_, " the index covers");
    const index_t first = n_, waiting = kv.n() - n_;
    if (waiting <= cfg_.window || waiting - cfg_.window < std::max<index_t>(cfg_.tail_capacity, 1)) return;
    if (clusters_ == 0) return rebuild(kv, parallel_for);
    const index_t end = kv.n() - cfg_.window;
    const row_matrix keys = read_keys(kv, first, end);
    check_values(kv, first, end);
    join_tokens(kv, keys, first, parallel_for);
    split_oversized(kv);
    if (static_cast<double>(appended_) >= cfg_.rebuild_growth * static_cast<double>(n_at_build_) ||
        (joined_ >= cfg_.rebuild_min_tokens &&
         appended_sq_dist_ > cfg_.rebuild_drift * built_mean_sq_dist_ * static_cast<double>(joined_)))
      rebuild(kv, parallel_for);
  }

  // Shape.
  index_t d() const { return d_; }
  index_t dv() const { return dv_; }
  index_t tokens() const { return n_; }      // tokens indexed; later ones form the exact tail
  index_t sinks() const { return sinks_; }   // tokens [0, sinks()) are exact, the rest of [0, tokens()) clustered
  index_t clusters() const { return clusters_; }
  index_t subclusters() const { return subclusters_; }
  index_t groups() const { return clusters_ + subclusters_; }  // cluster c is group c, subcluster s is group clusters()+s

  // Group summaries: row g of moments() is [mean (d) | variance (d)].
  const float* moments() const { return moments_.data(); }
  const float* mean(index_t g) const { return moments_.data() + g * 2 * d_; }
  const float* variance(index_t g) const { return mean(g) + d_; }
  const float* value_mean(index_t g) const { return value_means_.data() + g * dv_; }
  const float* log_counts() const { return log_counts_.data(); }
  std::uint32_t count(index_t g) const { return counts_[g]; }
  bool has_cross_covariance() const { return !cross_cov_.empty(); }
  const float* cross_covariance(index_t c) const { return cross_cov_.data() + c * dv_ * d_; }  // [dv, d] row-major

  // Subclusters of cluster c are [first_subcluster(c), first_subcluster(c+1)) (numbered from 0).
  index_t first_subcluster(index_t c) const { return sub_begin_[c]; }
  std::span<const std::uint32_t> members(index_t s) const {
    return {members_.data() + member_begin_[s], member_begin_[s + 1] - member_begin_[s]};
  }

  // Row p of the clustered order holds token clustered_order()[p] (sinks first): an engine
  // that copies the first tokens() rows of its cache into this order and then calls
  // adopt_clustered_order() gets every subcluster as one contiguous range
  // (docs/methods/mog.md, "layout"). A later re-clustering returns to per-token ranges.
  std::vector<std::uint32_t> clustered_order() const {
    std::vector<std::uint32_t> order(sinks_);
    for (index_t p = 0; p < sinks_; ++p) order[p] = static_cast<std::uint32_t>(p);
    order.insert(order.end(), members_.begin(), members_.end());
    return order;
  }
  void adopt_clustered_order() {
    for (index_t p = 0; p < members_.size(); ++p) members_[p] = static_cast<std::uint32_t>(sinks_ + p);
  }

  const mog_config& config() const { return cfg_; }
  std::uint64_t generation() const { return generation_; }  // increments at every (re)build
  double build_seconds() const { return build_seconds_; }   // wall time of the last (re)build
  index_t appended_since_build() const { return appended_; }

  std::uint64_t bytes() const {
    return sizeof(float) * (moments_.size() + value_means_.size() + log_counts_.size() + cross_cov_.size() +
                            static_cast<std::uint64_t>(metric_.size())) +
           sizeof(std::uint32_t) * (counts_.size() + sub_begin_.size() + member_begin_.size() + members_.size());
  }

 private:
  template <KvView KV>
  static row_matrix read_keys(const KV& kv, index_t begin, index_t end) {
    row_matrix keys(static_cast<Eigen::Index>(end - begin), static_cast<Eigen::Index>(kv.d()));
    for (index_t i = begin; i < end; ++i) {
      const auto* k = kv.key_row(i);
      for (index_t t = 0; t < kv.d(); ++t) {
        const float x = to_float(k[t]);
        require(std::isfinite(x), "keys", "token ", i, " has a non-finite key element at dimension ", t, " (", x, ")");
        keys(static_cast<Eigen::Index>(i - begin), static_cast<Eigen::Index>(t)) = x;
      }
    }
    return keys;
  }

  template <KvView KV>
  static void check_values(const KV& kv, index_t begin, index_t end) {
    for (index_t i = begin; i < end; ++i) {
      const auto* v = kv.value_row(i);
      for (index_t j = 0; j < kv.dv(); ++j)
        require(std::isfinite(to_float(v[j])), "values", "token ", i, " has a non-finite value element at dimension ",
                j, " (", to_float(v[j]), ")");
    }
  }

  template <KvView KV>
  void rebuild(const KV& kv, const parallel_for_fn& parallel_for) {
    const auto start = std::chrono::steady_clock::now();
    d_ = kv.d();
    dv_ = kv.dv();
    const index_t n = kv.n() > cfg_.window ? kv.n() - cfg_.window : 0;  // the last `window` tokens stay exact
    sinks_ = std::min(cfg_.sinks, n);
    const row_matrix keys = read_keys(kv, 0, kv.n());
    check_values(kv, 0, kv.n());
    const auto middle = keys.middleRows(static_cast<Eigen::Index>(sinks_), static_cast<Eigen::Index>(n - sinks_));
    metric_ = cfg_.query_sample.empty() ? row_matrix() : query_metric_root();
    clusters_ = subclusters_ = 0;
    sub_begin_.assign(1, 0);
    member_begin_.assign(1, 0);
    members_.clear();
    if (n > sinks_) add_clusters(partition(in_metric(middle), parallel_for), sinks_);
    n_ = n;
    moments_.clear();
    value_means_.clear();
    counts_.clear();
    log_counts_.clear();
    cross_cov_.clear();
    compute_moments(kv, [&](index_t i) { return keys.row(static_cast<Eigen::Index>(i)).data(); }, 0, 0, parallel_for);
    built_mean_sq_dist_ = 0.0;
    for (index_t c = 0; c < clusters_; ++c) built_mean_sq_dist_ += static_cast<double>(counts_[c]) * metric_spread(c);
    built_mean_sq_dist_ /= static_cast<double>(std::max<index_t>(n_ - sinks_, 1));
    n_at_build_ = n;
    appended_ = joined_ = 0;
    built_clusters_ = clusters_;
    built_subclusters_ = subclusters_;
    appended_sq_dist_ = 0.0;
    ++generation_;
    build_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  using cluster_members = std::vector<std::vector<std::uint32_t>>;  // subclusters, each increasing positions

  // L with L L^T = E[q q^T] + ridge: Euclidean distance of k L is the query metric.
  row_matrix query_metric_root() const {
    const auto rows = static_cast<Eigen::Index>(cfg_.query_sample.size() / d_);
    require(rows > 0 && cfg_.query_sample.size() % d_ == 0, "config.query_sample", "holds ", cfg_.query_sample.size(),
            " floats, not a positive multiple of d = ", d_);
    const Eigen::Map<const row_matrix> q(cfg_.query_sample.data(), rows, static_cast<Eigen::Index>(d_));
    Eigen::MatrixXd m = (q.transpose() * q).cast<double>() / static_cast<double>(rows);
    m.diagonal().array() += cfg_.query_metric_ridge * m.trace() / static_cast<double>(d_) + 1e-12;
    return Eigen::LLT<Eigen::MatrixXd>(m).matrixL().toDenseMatrix().cast<float>();
  }
  template <class Rows>
  row_matrix in_metric(const Rows& keys) const { return metric_.size() ? row_matrix(keys * metric_) : row_matrix(keys); }

  index_t subclusters_per_cluster(index_t n) const {
    return cfg_.subclusters ? cfg_.subclusters : std::max<index_t>(1, static_cast<index_t>(std::lround(std::log(double(n)))));
  }

  // k clusters of the rows of keys, each split into up to s subclusters; positions are row
  // numbers. With `mahalanobis`, also each row's leave-one-out squared Mahalanobis distance
  // (diagonal) to its cluster: the worst-case z-score of its score over query directions.
  std::vector<cluster_members> two_level(const row_matrix& keys, index_t k, index_t s, const parallel_for_fn& parallel_for,
                                         std::vector<float>* mahalanobis) const {
    const index_t n = static_cast<index_t>(keys.rows());
    const kmeans_result top = kmeans(keys, {std::max<index_t>(1, k), cfg_.iterations, 8, cfg_.seed}, parallel_for);
    const index_t kept = static_cast<index_t>(top.centroids.rows());
    std::vector<std::vector<std::uint32_t>> in_cluster(kept);
    for (index_t i = 0; i < n; ++i) in_cluster[top.labels[i]].push_back(static_cast<std::uint32_t>(i));
    std::vector<cluster_members> parts(kept);
    parallel_for(kept, [&](index_t c) {
      const auto& rows = in_cluster[c];
      row_matrix x(static_cast<Eigen::Index>(rows.size()), keys.cols());
      for (index_t j = 0; j < rows.size(); ++j) x.row(static_cast<Eigen::Index>(j)) = keys.row(rows[j]);
      if (mahalanobis && rows.size() >= 8) {
        const Eigen::RowVectorXd mean = x.cast<double>().colwise().mean();
        const Eigen::RowVectorXd var = (x.cast<double>().rowwise() - mean).array().square().colwise().mean();
        // Leave-one-out: a lone far point must not hide by inflating the variance it is judged by.
        const double floor = 1e-6 * var.mean() + 1e-30, m = static_cast<double>(rows.size());
        for (index_t j = 0; j < rows.size(); ++j) {
          const Eigen::ArrayXd dev = (x.row(static_cast<Eigen::Index>(j)).cast<double>() - mean).transpose().array();
          const Eigen::ArrayXd var_loo = (m / (m - 1)) * (var.transpose().array() - dev.square() / (m - 1)).max(0.0);
          (*mahalanobis)[rows[j]] = static_cast<float>(((m / (m - 1)) * (m / (m - 1)) * dev.square() / (var_loo + floor)).sum());
        }
      }
      std::vector<std::uint32_t> labels(rows.size(), 0);
      index_t subs = 1;
      if (s > 1 && rows.size() > 1) {
        kmeans_result sub = kmeans(x, {s, cfg_.iterations, 8, cfg_.seed ^ ((c + 1) * 0x9e3779b97f4a7c15ull)}, serial_for);
        labels = std::move(sub.labels);
        subs = static_cast<index_t>(sub.centroids.rows());
      }
      parts[c].resize(subs);
      for (index_t j = 0; j < rows.size(); ++j) parts[c][labels[j]].push_back(rows[j]);
    });
    return parts;
  }

  // Two-level k-means of the rows of keys, then outliers split off as clusters of one.
  std::vector<cluster_members> partition(const row_matrix& keys, const parallel_for_fn& parallel_for) const {
    const index_t n = static_cast<index_t>(keys.rows()), d = static_cast<index_t>(keys.cols());
    const index_t want_c = cfg_.clusters ? cfg_.clusters : static_cast<index_t>(std::lround(std::sqrt(double(n))));
    std::vector<float> mahalanobis(n, 0.f);
    std::vector<cluster_members> parts = two_level(keys, want_c, subclusters_per_cluster(n), parallel_for, &mahalanobis);
    // Outliers: far in the tail of their cluster's Gaussian, at most outlier_fraction of n.
    const double threshold = static_cast<double>(d) + cfg_.outlier_sigma * std::sqrt(2.0 * static_cast<double>(d));
    std::vector<std::uint32_t> outliers;
    for (index_t i = 0; i < n; ++i)
      if (mahalanobis[i] > threshold) outliers.push_back(static_cast<std::uint32_t>(i));
    const auto cap = static_cast<index_t>(cfg_.outlier_fraction * static_cast<double>(n));
    if (outliers.size() > cap) {
      std::nth_element(outliers.begin(), outliers.begin() + static_cast<std::ptrdiff_t>(cap), outliers.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return mahalanobis[a] > mahalanobis[b]; });
      outliers.resize(cap);
    }
    if (outliers.empty()) return parts;
    std::vector<char> is_outlier(n, 0);
    for (auto i : outliers) is_outlier[i] = 1;
    std::vector<cluster_members> kept;
    for (auto& cl : parts) {
      cluster_members subs;
      for (auto& sub : cl) {
        std::erase_if(sub, [&](std::uint32_t i) { return is_outlier[i] != 0; });
        if (!sub.empty()) subs.push_back(std::move(sub));
      }
      if (!subs.empty()) kept.push_back(std::move(subs));
    }
    std::sort(outliers.begin(), outliers.end());
    for (auto i : outliers) kept.push_back(cluster_members{{i}});
    return kept;
  }

  // Appends clusters to the CSR layout (clusters, their subclusters, their members);
  // member positions are shifted by offset.
  void add_clusters(const std::vector<cluster_members>& parts, index_t offset) {
    for (const auto& cl : parts) {
      for (const auto& sub : cl) {
        for (auto p : sub) members_.push_back(static_cast<std::uint32_t>(p + offset));
        member_begin_.push_back(static_cast<std::uint32_t>(members_.size()));
      }
      sub_begin_.push_back(static_cast<std::uint32_t>(sub_begin_.back() + cl.size()));
    }
    clusters_ = sub_begin_.size() - 1;
    subclusters_ = member_begin_.size() - 1;
  }

  // Exact moments of subclusters [s_first, subclusters()) (two passes in double) and of
  // clusters [c_first, clusters()) by pooling their subclusters, plus the optional
  // per-cluster value-key covariance. Summary arrays grow to the new group count; rows of
  // earlier groups keep their values (cluster rows come first, so subcluster rows move).
  template <KvView KV, class KeyOf>
  void compute_moments(const KV& kv, const KeyOf& key_of, index_t s_first, index_t c_first, const parallel_for_fn& parallel_for) {
    regroup(c_first, s_first);
    const index_t new_subs = subclusters_ - s_first;
    Eigen::MatrixXd sub_mean(static_cast<Eigen::Index>(d_), static_cast<Eigen::Index>(new_subs));
    Eigen::MatrixXd sub_m2(static_cast<Eigen::Index>(d_), static_cast<Eigen::Index>(new_subs));
    Eigen::MatrixXd sub_vsum(static_cast<Eigen::Index>(dv_), static_cast<Eigen::Index>(new_subs));
    parallel_for(new_subs, [&](index_t j) {
      const auto rows = members(s_first + j);
      Eigen::VectorXd mean = Eigen::VectorXd::Zero(static_cast<Eigen::Index>(d_));
      Eigen::VectorXd m2 = Eigen::VectorXd::Zero(static_cast<Eigen::Index>(d_));
      Eigen::VectorXd vsum = Eigen::VectorXd::Zero(static_cast<Eigen::Index>(dv_));
      for (auto i : rows) mean += Eigen::Map<const Eigen::VectorXf>(key_of(i), static_cast<Eigen::Index>(d_)).cast<double>();
      mean /= static_cast<double>(rows.size());
      for (auto i : rows) {
        m2 += (Eigen::Map<const Eigen::VectorXf>(key_of(i), static_cast<Eigen::Index>(d_)).cast<double>() - mean).array().square().matrix();
        const auto* v = kv.value_row(i);
        for (index_t t = 0; t < dv_; ++t) vsum[static_cast<Eigen::Index>(t)] += to_float(v[t]);
      }
      sub_mean.col(static_cast<Eigen::Index>(j)) = mean;
      sub_m2.col(static_cast<Eigen::Index>(j)) = m2;
      sub_vsum.col(static_cast<Eigen::Index>(j)) = vsum;
      set_group(clusters_ + s_first + j, rows.size(), mean, m2, vsum);
    });
    for (index_t c = c_first; c < clusters_; ++c) {
      require(sub_begin_[c] >= s_first, "index", "internal: cluster ", c, " has subclusters outside the new range");
      const auto s0 = static_cast<Eigen::Index>(sub_begin_[c] - s_first), ns = static_cast<Eigen::Index>(sub_begin_[c + 1] - sub_begin_[c]);
      Eigen::VectorXd w(ns);
      for (Eigen::Index j = 0; j < ns; ++j) w[j] = counts_[clusters_ + sub_begin_[c] + static_cast<index_t>(j)];
      const double total = w.sum();
      const Eigen::VectorXd mean = sub_mean.middleCols(s0, ns) * w / total;
      // Pooled second moment: within-subcluster spread plus the spread of subcluster means.
      Eigen::VectorXd m2 = sub_m2.middleCols(s0, ns).rowwise().sum();
      for (Eigen::Index j = 0; j < ns; ++j) m2 += w[j] * (sub_mean.col(s0 + j) - mean).array().square().matrix();
      set_group(c, static_cast<index_t>(total), mean, m2, sub_vsum.middleCols(s0, ns).rowwise().sum());
    }
    if (!cfg_.cross_covariance) return;
    parallel_for(clusters_ - c_first, [&](index_t j) {
      const index_t c = c_first + j, nc = counts_[c];
      Eigen::MatrixXd kc(static_cast<Eigen::Index>(nc), static_cast<Eigen::Index>(d_));
      Eigen::MatrixXd vc(static_cast<Eigen::Index>(nc), static_cast<Eigen::Index>(dv_));
      index_t r = 0;
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s)
        for (auto i : members(s)) {
          const float* k = key_of(i);
          for (index_t t = 0; t < d_; ++t) kc(static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(t)) = k[t] - mean(c)[t];
          const auto* v = kv.value_row(i);
          for (index_t t = 0; t < dv_; ++t)
            vc(static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(t)) = to_float(v[t]) - value_mean(c)[t];
          ++r;
        }
      const Eigen::MatrixXd cov = vc.transpose() * kc / static_cast<double>(nc);  // [dv, d]
      for (index_t a = 0; a < dv_; ++a)
        for (index_t t = 0; t < d_; ++t)
          cross_cov_[(c * dv_ + a) * d_ + t] = static_cast<float>(cov(static_cast<Eigen::Index>(a), static_cast<Eigen::Index>(t)));
    });
  }

  // Resizes the summary arrays from (old_clusters, old_subclusters) groups to the current
  // counts, keeping every existing group's row.
  void regroup(index_t old_clusters, index_t old_subclusters) {
    auto grow = [&](auto& v, index_t width) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      std::vector<T> out(groups() * width, T{});
      std::copy_n(v.begin(), old_clusters * width, out.begin());
      std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(old_clusters * width), old_subclusters * width,
                  out.begin() + static_cast<std::ptrdiff_t>(clusters_ * width));
      v = std::move(out);
    };
    grow(moments_, 2 * d_);
    grow(value_means_, dv_);
    grow(log_counts_, 1);
    grow(counts_, 1);
    if (cfg_.cross_covariance) cross_cov_.resize(clusters_ * dv_ * d_, 0.f);
  }

  void set_group(index_t g, index_t count, const Eigen::VectorXd& mean, const Eigen::VectorXd& m2,
                 const Eigen::VectorXd& value_sum) {
    counts_[g] = static_cast<std::uint32_t>(count);
    log_counts_[g] = static_cast<float>(std::log(static_cast<double>(count)));
    float* row = moments_.data() + g * 2 * d_;
    for (index_t t = 0; t < d_; ++t) {
      row[t] = static_cast<float>(mean[static_cast<Eigen::Index>(t)]);
      row[d_ + t] = static_cast<float>(m2[static_cast<Eigen::Index>(t)] / static_cast<double>(count));
    }
    for (index_t j = 0; j < dv_; ++j)
      value_means_[g * dv_ + j] = static_cast<float>(value_sum[static_cast<Eigen::Index>(j)] / static_cast<double>(count));
  }

  // New tokens [first, first + keys.rows()) join their nearest cluster when they lie within
  // the chi-square tail of its spread, then the nearest subcluster of it, with Welford
  // updates of the moments. The others form new clusters of their own (a new topic must not
  // swell an old cluster that happens to be nearest).
  template <KvView KV>
  void join_tokens(const KV& kv, const row_matrix& keys, index_t first, const parallel_for_fn& parallel_for) {
    const index_t count = static_cast<index_t>(keys.rows());
    const row_matrix placed = in_metric(keys);  // the metric the clusters were built in
    row_matrix centres(static_cast<Eigen::Index>(clusters_), static_cast<Eigen::Index>(d_));
    for (index_t c = 0; c < clusters_; ++c) centres.row(static_cast<Eigen::Index>(c)) = in_metric(mean_row(c));
    std::vector<std::uint32_t> cluster_of;
    std::vector<float> sq_dist;
    detail::kmeans_assign(placed, centres, cluster_of, sq_dist, parallel_for);

    const double join_factor = 1.0 + cfg_.join_sigma * std::sqrt(2.0 / static_cast<double>(d_));
    std::vector<std::int64_t> sub_of(count, -1);
    std::vector<std::uint32_t> novel;
    std::vector<float> value(dv_);
    for (index_t r = 0; r < count; ++r) {
      const index_t c = cluster_of[r];
      if (sq_dist[r] > join_factor * spread_in_metric(c)) {
        novel.push_back(static_cast<std::uint32_t>(r));
        continue;
      }
      const float* k = keys.data() + r * d_;
      index_t best = sub_begin_[c];
      float best_d2 = std::numeric_limits<float>::infinity();
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s) {
        const float d2 = (placed.row(static_cast<Eigen::Index>(r)) - in_metric(mean_row(clusters_ + s))).squaredNorm();
        if (d2 < best_d2) {
          best_d2 = d2;
          best = s;
        }
      }
      sub_of[r] = static_cast<std::int64_t>(best);
      const auto* v = kv.value_row(first + r);
      for (index_t j = 0; j < dv_; ++j) value[j] = to_float(v[j]);
      if (has_cross_covariance()) welford_cross(c, k, value.data());
      welford(c, k, value.data());
      welford(clusters_ + best, k, value.data());
      appended_sq_dist_ += sq_dist[r];
      ++joined_;
    }
    // Members: new positions are larger than every old one, so each list stays increasing.
    std::vector<std::uint32_t> added(subclusters_ + 1, 0);
    for (auto s : sub_of)
      if (s >= 0) ++added[static_cast<index_t>(s) + 1];
    for (index_t s = 0; s < subclusters_; ++s) added[s + 1] += added[s];
    std::vector<std::uint32_t> merged(members_.size() + added[subclusters_]);
    std::vector<std::uint32_t> begin(subclusters_ + 1);
    for (index_t s = 0; s <= subclusters_; ++s) begin[s] = member_begin_[s] + added[s];
    for (index_t s = 0; s < subclusters_; ++s)
      std::copy(members_.begin() + member_begin_[s], members_.begin() + member_begin_[s + 1], merged.begin() + begin[s]);
    std::vector<std::uint32_t> fill(subclusters_);
    for (index_t s = 0; s < subclusters_; ++s) fill[s] = begin[s] + (member_begin_[s + 1] - member_begin_[s]);
    for (index_t r = 0; r < count; ++r)
      if (sub_of[r] >= 0) merged[fill[static_cast<index_t>(sub_of[r])]++] = static_cast<std::uint32_t>(first + r);
    members_ = std::move(merged);
    member_begin_ = std::move(begin);

    if (!novel.empty()) {  // new clusters of about the current mean size
      row_matrix fresh(static_cast<Eigen::Index>(novel.size()), static_cast<Eigen::Index>(d_));
      for (index_t j = 0; j < novel.size(); ++j) fresh.row(static_cast<Eigen::Index>(j)) = placed.row(novel[j]);
      const index_t typical = std::max<index_t>(1, (n_ - sinks_) / std::max<index_t>(clusters_, 1));
      auto parts = two_level(fresh, (novel.size() + typical - 1) / typical, subclusters_per_cluster(n_), serial_for, nullptr);
      for (auto& cl : parts)
        for (auto& sub : cl)
          for (auto& p : sub) p = novel[p];  // batch row numbers
      const index_t c_first = clusters_, s_first = subclusters_;
      add_clusters(parts, first);
      compute_moments(kv, [&](index_t i) { return keys.row(static_cast<Eigen::Index>(i - first)).data(); }, s_first, c_first,
                      serial_for);
    }
    n_ = first + count;
    appended_ += count;
  }

  Eigen::Map<const Eigen::RowVectorXf> mean_row(index_t g) const { return {mean(g), static_cast<Eigen::Index>(d_)}; }

  // A cluster's mean squared distance of members to its mean, in the clustering metric:
  // tr(L^T Sigma L) with the diagonal Sigma; clusters of one borrow the build-wide mean.
  float spread_in_metric(index_t c) const {
    return counts_[c] < 2 ? static_cast<float>(built_mean_sq_dist_) : metric_spread(c);
  }
  float metric_spread(index_t c) const {
    const Eigen::Map<const Eigen::VectorXf> var(variance(c), static_cast<Eigen::Index>(d_));
    if (!metric_.size()) return var.sum();
    return (metric_.array().square().colwise() * var.array()).sum();
  }

  // Clusters (or subclusters) that joined tokens have swollen past split_factor x the mean
  // size at build are re-clustered on their own members (two-level k-means); the other groups keep their
  // moments, which are recomputed from the cache with the new layout.
  template <KvView KV>
  void split_oversized(const KV& kv) {
    const double typical = static_cast<double>(n_at_build_ - sinks_) / static_cast<double>(std::max<index_t>(built_clusters_, 1));
    const double typical_sub =
        static_cast<double>(n_at_build_ - sinks_) / static_cast<double>(std::max<index_t>(built_subclusters_, 1));
    auto swollen_group = [&](index_t c) {
      if (static_cast<double>(counts_[c]) > cfg_.split_factor * typical) return true;
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s)
        if (static_cast<double>(counts_[clusters_ + s]) > cfg_.split_factor * typical_sub) return true;
      return false;
    };
    bool any = false;
    for (index_t c = 0; c < clusters_ && !any; ++c) any = swollen_group(c);
    if (!any) return;
    std::vector<cluster_members> parts;
    const row_matrix keys = read_keys(kv, 0, n_);
    for (index_t c = 0; c < clusters_; ++c) {
      cluster_members cl;
      std::vector<std::uint32_t> all;
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s) {
        const auto m = members(s);
        cl.emplace_back(m.begin(), m.end());
        all.insert(all.end(), m.begin(), m.end());
      }
      if (!swollen_group(c)) {
        parts.push_back(std::move(cl));
        continue;
      }
      std::sort(all.begin(), all.end());
      row_matrix x(static_cast<Eigen::Index>(all.size()), static_cast<Eigen::Index>(d_));
      for (index_t j = 0; j < all.size(); ++j) x.row(static_cast<Eigen::Index>(j)) = keys.row(all[j]);
      auto pieces = two_level(in_metric(x), static_cast<index_t>(std::ceil(static_cast<double>(all.size()) / typical)),
                              subclusters_per_cluster(n_), serial_for, nullptr);
      for (auto& piece : pieces) {
        for (auto& sub : piece)
          for (auto& p : sub) p = all[p];
        parts.push_back(std::move(piece));
      }
    }
    clusters_ = subclusters_ = 0;
    sub_begin_.assign(1, 0);
    member_begin_.assign(1, 0);
    members_.clear();
    add_clusters(parts, 0);
    moments_.clear();
    value_means_.clear();
    counts_.clear();
    log_counts_.clear();
    cross_cov_.clear();
    compute_moments(kv, [&](index_t i) { return keys.row(static_cast<Eigen::Index>(i)).data(); }, 0, 0, serial_for);
  }

  void welford(index_t g, const float* k, const float* v) {
    const double n1 = static_cast<double>(counts_[g]) + 1.0;
    float* mu = moments_.data() + g * 2 * d_;
    float* var = mu + d_;
    for (index_t t = 0; t < d_; ++t) {
      const double delta = k[t] - mu[t];
      const double mu1 = mu[t] + delta / n1;
      var[t] = static_cast<float>(((n1 - 1.0) * var[t] + delta * (k[t] - mu1)) / n1);
      mu[t] = static_cast<float>(mu1);
    }
    float* nu = value_means_.data() + g * dv_;
    for (index_t j = 0; j < dv_; ++j) nu[j] = static_cast<float>(nu[j] + (v[j] - static_cast<double>(nu[j])) / n1);
    counts_[g] += 1;
    log_counts_[g] = static_cast<float>(std::log(n1));
  }

  // Co-moment update, before welford() moves the means: C' = (n C + (v - nu') (k - mu)^T) / (n + 1).
  void welford_cross(index_t c, const float* k, const float* v) {
    const double n = counts_[c], n1 = n + 1.0;
    float* cov = cross_cov_.data() + c * dv_ * d_;
    for (index_t j = 0; j < dv_; ++j) {
      const double dvj = v[j] - (value_mean(c)[j] + (v[j] - static_cast<double>(value_mean(c)[j])) / n1);
      for (index_t t = 0; t < d_; ++t)
        cov[j * d_ + t] = static_cast<float>((n * cov[j * d_ + t] + dvj * (k[t] - static_cast<double>(mean(c)[t]))) / n1);
    }
  }

  mog_config cfg_{};
  index_t d_ = 0, dv_ = 0, n_ = 0, sinks_ = 0, clusters_ = 0, subclusters_ = 0;
  std::vector<float> moments_;            // [groups, 2d]: key mean | key variance
  std::vector<float> value_means_;        // [groups, dv]
  std::vector<float> log_counts_;         // [groups]
  std::vector<std::uint32_t> counts_;     // [groups]
  std::vector<std::uint32_t> sub_begin_;  // [clusters + 1]
  std::vector<std::uint32_t> member_begin_;  // [subclusters + 1]
  std::vector<std::uint32_t> members_;    // [tokens] positions, subcluster by subcluster
  std::vector<float> cross_cov_;          // [clusters, dv, d] when configured
  row_matrix metric_;                     // [d, d] L of the query metric, empty for Euclidean
  index_t n_at_build_ = 0, appended_ = 0, joined_ = 0, built_clusters_ = 0, built_subclusters_ = 0;
  double built_mean_sq_dist_ = 0.0, appended_sq_dist_ = 0.0;
  std::uint64_t generation_ = 0;
  double build_seconds_ = 0.0;
};

}  // namespace floe
