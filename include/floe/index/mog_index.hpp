// The Mixture-of-Gaussians index of one (layer, KV head): ~sqrt(n) key clusters, ~(2/3) ln n
// subclusters in each, every group summarised by its count, key mean, diagonal key
// variance and value mean, stored as fp16 with a power-of-two scale per row. Outlier keys
// are exact tokens. Tokens are referenced by position in the caller's cache, subcluster by
// subcluster. docs/methods/mog.md.
#pragma once

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/index/kmeans.hpp"
#include "floe/index/quantized_keys.hpp"
#include "floe/index/residual_codes.hpp"
#include "floe/index/widen.hpp"

namespace floe {

struct mog_config {
  index_t clusters = 0;           // 0: round(sqrt(n))
  index_t subclusters = 0;        // per cluster; 0: max(1, round(2/3 ln n))
  index_t iterations = 6;         // Lloyd iterations at each level
  index_t tail_capacity = 256;    // appended tokens stay exact until this many wait
  double rebuild_growth = 0.5;    // re-cluster once appended tokens reach this fraction of those clustered at build
  double rebuild_drift = 2.0;     // ... or once they lie this many times farther from their centroids (mean squared)
  index_t rebuild_min_tokens = 1024;  // the drift test needs this many appended tokens to be meaningful
  double segment_growth = 0.25;    // re-partition the appended tokens among themselves once those joined since
  index_t segment_min_tokens = 512;  // ... the last time reach this fraction of them (and at least this many)
  double split_factor = 3.0;      // a (sub)cluster grown past this x the mean size at build is re-clustered alone
  double join_sigma = 4.0;        // an appended token joins a cluster if its squared distance is within
                                  // spread (1 + join_sigma sqrt(2/d)), spread = the members' mean (chi-square tail)
  index_t sinks = 4;              // the first tokens (attention sinks) are never clustered, always exact
  index_t window = 0;             // nor are the most recent ones
  double outlier_sigma = 3.0;     // a key whose squared Mahalanobis distance exceeds d + sigma sqrt(2d)...
  double outlier_fraction = 0.02;  // ... is an exact token (always attended), for at most this fraction of tokens
  // ... or whose whitened deviation along the `outlier_directions` principal directions of all
  // clusters' whitened deviations is as improbable (chi-square tails matched): catches keys whose
  // deviation is concentrated in a few directions that the all-dimension distance dilutes. 0: off.
  index_t outlier_directions = 0;
  // ... or whose deviation within one window of RoPE pairs is as improbable, after a factor
  // for the windows tested: windows of d/2/`outlier_bands` consecutive rotation pairs at half
  // that stride, and of twice that at its width, in the rotate-half layout (pair j is
  // dimensions j and j + d/2, as Llama's). Catches keys out in one band (a salient token)
  // that the all-dimension distance dilutes. 0: off. Not applied with a query-sample metric
  // (its dimensions are not RoPE pairs). 8 measured best of 4 / 8 / 16 on the synthetic
  // cache with disjoint bands (docs/log/mog.md, "Outliers by band"); the overlapping
  // windows lowered p90 further ("Overlapping windows and sigma clipping").
  index_t outlier_bands = 8;
  // Passes of sigma clipping in each cluster's outlier test: the moments again without the
  // members already past the threshold, and every statistic against them. Several far keys
  // of one cluster inflate its variance along their shared deviation and hide each other
  // from the leave-one-out test. 0: one pass over the full moments.
  index_t outlier_clip_passes = 1;
  // Each group's variance term is multiplied by a factor fitted at build: the least-squares
  // ratio, over this many probe queries (rows of query_sample if given, else keys of the
  // cache spread evenly over it; at the default scale 1/sqrt(d)), of the group's true
  // log-mass above log n + s q.mu to the Gaussian's s^2/2 sum q_t^2 var_t, clamped to [0, 1].
  // Real keys have lighter tails than a Gaussian in the directions queries score them by
  // (docs/log/mog.md, "Fitted variance term"). 0: off (the Gaussian's term as is).
  index_t variance_fit_probes = 64;
  bool cross_covariance = false;  // keep Cov(v, k) per cluster
  // 0: Cov(v, k) kept whole, dv x d floats per cluster; r >= 1: its best rank-r factors
  // (subspace iteration), r (dv + d) floats, which is what a step reads per unrefined cluster.
  index_t cross_covariance_rank = 0;
  // With a query_sample: this share of the outlier cap goes to the keys the sample attends
  // most (softmax weights at the scale 1/sqrt(d), summed over its rows), whatever their
  // distance to their cluster; the rest to the distance tests. On the SmolLM2 dumps the
  // farthest keys hold no more of the decode queries' mass than random ones; 0.75 keeps a
  // quarter for the synthetic cache's salient tokens that the sample does not attend
  // (docs/log/mog.md, "Outliers chosen by a query sample"). 1 leaves none to distance: on the
  // synthetic 32K cache the retrieval heads' p99 error then rose past 1, their mass left in
  // unrefined clusters (log "What the 32K error is made of"). Tokens appended later are
  // tested by distance only. Without a query_sample every outlier is chosen by distance.
  double sample_outlier_share = 0.75;
  std::uint64_t seed = 0x6d6f67;
  // Optional sample of queries (rows of d floats, e.g. the last prefill queries of the GQA
  // group): it picks sample_outlier_share of the outliers and is the variance fit's probes.
  std::vector<float> query_sample;
  // With query_sample: k-means in the metric E[(q.(k - k'))^2], so that clusters group keys
  // the queries score alike. Off by default: with the sample's outliers it raised p90 on the
  // synthetic cache and on some SmolLM2 layers (docs/log/mog.md, "Outliers chosen by a query sample").
  bool query_metric = false;
  double query_metric_ridge = 0.1;  // adds this fraction of the mean eigenvalue to every direction
  // Keep 4-bit keys of the clustered tokens in cluster order (quantized_keys, d/2 + d/8
  // bytes per token), so that the selector ranks the members of refined clusters token by
  // token instead of by subcluster Gaussians: a heavy token inside a cluster is read
  // however its subcluster's moments look (docs/methods/mog.md, "Token scan"). Tokens of
  // clusters formed by append are not scanned. Costs index memory beyond the 5 % target.
  bool token_scan = false;
  // What the token scan ranks by: 4-bit keys, or 2-bit codes of each key standardised by its
  // cluster's mean and spread (residual_codes, d/4 bytes a token and 2d floats a cluster),
  // with which the same bytes scan about twice the members (docs/log/mog.md, "Cheaper keys
  // for the token scan"; mog_clusters::token_scan_code_refine).
  enum class scan_code { keys_4bit, residual_2bit };
  scan_code token_scan_code = scan_code::keys_4bit;
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

namespace detail {
// Wilson-Hilferty: (x/k)^(1/3) of a chi-square(k) value x is about normal with mean
// 1 - 2/(9k) and variance 2/(9k). These map a value to that z-score and back.
inline double chi_square_z(double x, double k) {
  return (std::cbrt(x / k) - (1.0 - 2.0 / (9.0 * k))) / std::sqrt(2.0 / (9.0 * k));
}
inline double chi_square_at_z(double z, double k) {
  const double root = std::max(0.0, 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k)));
  return k * root * root * root;
}
// z with P(Z > z) = p for a standard normal Z, 0 < p <= 1/2: Newton on log P(Z > z), which
// is concave, from above (sqrt(-2 ln p) exceeds the root), so it converges monotonically.
inline double normal_upper_quantile(double p) {
  const auto log_tail = [](double z) { return std::log(0.5 * std::erfc(z / std::sqrt(2.0))); };
  double z = std::sqrt(-2.0 * std::log(p));
  for (int it = 0; it < 50; ++it) {
    const double lt = log_tail(z);
    const double slope = -std::exp(-0.5 * z * z - lt) / std::sqrt(2.0 * 3.141592653589793);  // -phi(z) / tail
    const double step = (lt - std::log(p)) / slope;
    z -= step;
    if (std::abs(step) < 1e-12 * (1.0 + std::abs(z))) break;
  }
  return z;
}
// The largest chi-square deviation of one window of RoPE pairs (rotate-half layout), as the
// chi-square(d) value of the same tail probability once multiplied by the number of windows
// tested (Bonferroni). Windows: `bands` pairs/bands wide at half that stride (so a deviation
// straddling two bands still falls in one window), and twice as wide at their width.
// z2 holds the d squared whitened deviations of one key. Values at most `floor` are not
// needed, and their tail inversion (a few Newton steps) is skipped: 0.
inline double band_deviation(const double* z2, index_t d, index_t bands, double floor = 0.0) {
  const index_t pairs = d / 2;
  bands = std::min(bands, pairs);
  if (bands == 0) return 0.0;
  const index_t width = pairs / bands;
  double worst = -std::numeric_limits<double>::infinity();
  index_t tested = 0;
  for (index_t w : {width, 2 * width}) {
    if (w > pairs) break;
    double largest = 0.0;  // the z-score rises with the sum: one conversion per width
    for (index_t lo = 0; lo + w <= pairs; lo += std::max<index_t>(1, w / 2)) {
      double t = 0.0;
      for (index_t j = lo; j < lo + w; ++j) t += z2[j] + z2[j + pairs];
      largest = std::max(largest, t);
      ++tested;
    }
    worst = std::max(worst, chi_square_z(largest, 2.0 * static_cast<double>(w)));
  }
  if (chi_square_at_z(worst, static_cast<double>(d)) <= floor) return 0.0;  // the factor only lowers it
  constexpr double far = 37.0;  // beyond it the normal tail underflows a double
  const double factor = static_cast<double>(tested);
  const double tail = 0.5 * std::erfc(std::min(worst, far) / std::sqrt(2.0)) * factor;
  if (!(tail < 0.5)) return 0.0;  // not improbable after the factor: no evidence
  const double z = worst >= far ? worst - std::log(factor) / worst : normal_upper_quantile(tail);
  return chi_square_at_z(z, static_cast<double>(d));
}

// log(e^a + e^b), either may be -inf.
inline double log_add(double a, double b) {
  if (a < b) std::swap(a, b);
  return a == -std::numeric_limits<double>::infinity() ? a : a + std::log1p(std::exp(b - a));
}

// fp16 bits to float without branches (so that decoding loops vectorise); finite values only.
inline float half_bits_to_float(std::uint16_t h) {
  const float magnitude = bits_float(static_cast<std::uint32_t>(h & 0x7fffu) << 13) * 0x1p112f;
  return bits_float(float_bits(magnitude) | (static_cast<std::uint32_t>(h & 0x8000u) << 16));
}
// x / scale as fp16, scale a power of two putting max |x| below 2^15 (no overflow, and
// rounding errors of at most 2^-11 relative to each element, or 2^-39 of the row's max for
// elements in the subnormal range). Returns the scale.
inline float encode_halves(const double* x, index_t n, half* out) {
  double top = 0.0;
  for (index_t t = 0; t < n; ++t) top = std::max(top, std::abs(x[t]));
  int e = 0;
  if (top > 0.0) std::frexp(top, &e);  // top < 2^e
  const double scale = std::ldexp(1.0, std::max(e - 15, -126));
  for (index_t t = 0; t < n; ++t) out[t] = half::from_float(static_cast<float>(x[t] / scale));
  return static_cast<float>(scale);
}
inline void decode_halves(const half* x, float scale, index_t n, float* out) {
  for (index_t t = 0; t < n; ++t) out[t] = half_bits_to_float(x[t].bits) * scale;
}
}  // namespace detail

// Index memory by part (bytes).
struct mog_memory {
  std::uint64_t cluster_summaries = 0;     // per cluster: fp16 mean, variance, value mean; 3 scales, count, log count, variance fit
  std::uint64_t subcluster_summaries = 0;  // the same per subcluster
  std::uint64_t positions = 0;             // member positions (4 bytes per clustered token) and exact outliers
  std::uint64_t offsets = 0;               // CSR offsets of subclusters and members
  std::uint64_t cross_covariance = 0;      // optional, float [clusters, dv, d]
  std::uint64_t metric = 0;                // optional query metric, float [d, d]
  std::uint64_t probes = 0;                // the variance fit's probe queries, float [probes, d] (kept for append)
  std::uint64_t token_scan = 0;            // optional 4-bit keys of the clustered tokens (mog_config::token_scan)
  std::uint64_t total() const {
    return cluster_summaries + subcluster_summaries + positions + offsets + cross_covariance + metric + probes + token_scan;
  }
};

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
  // window join their nearest cluster and subcluster (moments recomputed). Past the growth or
  // drift threshold the whole cache is re-clustered.
  template <KvView KV>
  void append(const KV& kv, const parallel_for_fn& parallel_for = serial_for) {
    require(kv.d() == d_ && kv.dv() == dv_, "kv", "index built for d = ", d_, ", dv = ", dv_, "; the view has d = ",
            kv.d(), ", dv = ", kv.dv());
    require_view_covers(kv.n(), n_, "the index");
    const index_t first = n_, waiting = kv.n() - n_;
    if (waiting <= cfg_.window || waiting - cfg_.window < std::max<index_t>(cfg_.tail_capacity, 1)) return;
    if (clusters_ == 0) return rebuild(kv, parallel_for);
    const index_t end = kv.n() - cfg_.window;
    const row_matrix keys = read_keys(kv, first, end);
    check_values(kv, first, end);
    join_tokens(kv, keys, first, parallel_for);
    split_oversized(kv);
    const index_t unpartitioned = appended_ - segment_size_;
    if (appended_ >= cfg_.segment_min_tokens &&
        static_cast<double>(unpartitioned) >= cfg_.segment_growth * static_cast<double>(segment_size_))
      repartition_appended(kv, parallel_for);
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

  // Group summaries, fp16 rows [mean (d) | variance (d) | value mean (dv)] with a
  // power-of-two scale per part. decode_moments writes [mean | variance] (2d floats),
  // decode_value_mean dv floats; mean(), variance() and value_mean() return copies.
  void decode_moments(index_t g, float* out) const {
    const half* row = summary_.data() + g * row_width();
    detail::decode_halves(row, scales_[3 * g], d_, out);
    detail::decode_halves(row + d_, scales_[3 * g + 1], d_, out + d_);
  }
  // Ask for group g's [mean | variance] or value mean ahead of decoding it (cold steps read
  // the rows of scattered groups from DRAM one after another).
  void prefetch_moments(index_t g) const { detail::prefetch_row(summary_.data() + g * row_width(), 2 * d_); }
  void prefetch_value_mean(index_t g) const { detail::prefetch_row(summary_.data() + g * row_width() + 2 * d_, dv_); }
  void decode_value_mean(index_t g, float* out) const {
    detail::decode_halves(summary_.data() + g * row_width() + 2 * d_, scales_[3 * g + 2], dv_, out);
  }
  std::vector<float> mean(index_t g) const { return decoded(g, 0, d_); }
  std::vector<float> variance(index_t g) const { return decoded(g, 1, d_); }
  std::vector<float> value_mean(index_t g) const { return decoded(g, 2, dv_); }
  const float* log_counts() const { return log_counts_.data(); }
  // The factor of group g's variance term in its mass estimate (mog_config::variance_fit_probes).
  const float* variance_fits() const { return variance_fit_.data(); }
  std::uint32_t count(index_t g) const { return counts_[g]; }
  bool has_cross_covariance() const { return !cross_cov_.empty(); }
  // Floats kept (and read by a step) per cluster for Cov(v, k): dv d, or r (d + dv) at rank r.
  index_t cross_covariance_width() const {
    return cfg_.cross_covariance_rank == 0 ? dv_ * d_ : cfg_.cross_covariance_rank * (d_ + dv_);
  }
  // out[dv] = scale Cov(v, k) q of cluster c (its rank-r factors when configured).
  void cross_covariance_times(index_t c, const float* q, double scale, float* out) const {
    const float* m = cross_cov_.data() + c * cross_covariance_width();
    const index_t rank = cfg_.cross_covariance_rank;
    if (rank == 0) {  // [dv, d] row-major
      for (index_t i = 0; i < dv_; ++i) {
        double dot = 0.0;
        for (index_t t = 0; t < d_; ++t) dot += static_cast<double>(m[i * d_ + t]) * q[t];
        out[i] = static_cast<float>(scale * dot);
      }
      return;
    }
    std::fill(out, out + dv_, 0.f);
    for (index_t j = 0; j < rank; ++j) {  // B [rank, d] (orthonormal rows), then A^T [rank, dv]
      double y = 0.0;
      for (index_t t = 0; t < d_; ++t) y += static_cast<double>(m[j * d_ + t]) * q[t];
      const float f = static_cast<float>(scale * y);
      const float* a = m + rank * d_ + j * dv_;
      for (index_t i = 0; i < dv_; ++i) out[i] += f * a[i];
    }
  }

  // Subclusters of cluster c are [first_subcluster(c), first_subcluster(c+1)) (numbered from 0).
  index_t first_subcluster(index_t c) const { return sub_begin_[c]; }
  std::span<const std::uint32_t> members(index_t s) const {
    return {members_.data() + member_begin_[s], member_begin_[s + 1] - member_begin_[s]};
  }
  // Member row of subcluster s's first member: members of cluster c are the member rows
  // [first_member(first_subcluster(c)), first_member(first_subcluster(c + 1))).
  index_t first_member(index_t s) const { return member_begin_[s]; }
  std::uint32_t member_position(index_t row) const { return members_[row]; }
  // 4-bit keys (or 2-bit codes) of member rows [0, first_member(first_subcluster(scanned_clusters()))),
  // the members of the clusters as built (mog_config::token_scan; append leaves them in place).
  index_t scanned_clusters() const {
    return scanned_clusters_ > 0 && scanned_clusters_ <= clusters_ &&
                   member_begin_[sub_begin_[scanned_clusters_]] == member_keys_.tokens() + member_codes_.tokens()
               ? scanned_clusters_
               : 0;
  }
  const quantized_keys& member_keys() const { return member_keys_; }
  // mog_config::scan_code::residual_2bit: the members' 2-bit codes instead (one of the two is empty).
  const residual_codes& member_codes() const { return member_codes_; }
  // Outlier keys, increasing positions: in no cluster, always attended exactly.
  std::span<const std::uint32_t> outliers() const { return outliers_; }

  // Row p of the clustered order holds token clustered_order()[p] (sinks, then outliers,
  // then subcluster by subcluster): an engine that copies the first tokens() rows of its
  // cache into this order and then calls adopt_clustered_order() gets every subcluster as
  // one contiguous range (docs/methods/mog.md, "layout"). A later re-clustering returns to
  // per-token ranges.
  std::vector<std::uint32_t> clustered_order() const {
    std::vector<std::uint32_t> order(sinks_);
    for (index_t p = 0; p < sinks_; ++p) order[p] = static_cast<std::uint32_t>(p);
    order.insert(order.end(), outliers_.begin(), outliers_.end());
    order.insert(order.end(), members_.begin(), members_.end());
    return order;
  }
  void adopt_clustered_order() {
    for (index_t p = 0; p < outliers_.size(); ++p) outliers_[p] = static_cast<std::uint32_t>(sinks_ + p);
    for (index_t p = 0; p < members_.size(); ++p) members_[p] = static_cast<std::uint32_t>(sinks_ + outliers_.size() + p);
  }

  const mog_config& config() const { return cfg_; }
  std::uint64_t generation() const { return generation_; }  // increments at every (re)build
  double build_seconds() const { return build_seconds_; }   // wall time of the last (re)build
  index_t appended_since_build() const { return appended_; }

  mog_memory memory() const {
    mog_memory m;
    const std::uint64_t per_group = row_width() * sizeof(half) + 3 * sizeof(float) + 2 * sizeof(float) + sizeof(std::uint32_t);
    m.cluster_summaries = clusters_ * per_group;
    m.subcluster_summaries = subclusters_ * per_group;
    m.positions = sizeof(std::uint32_t) * (members_.size() + outliers_.size());
    m.offsets = sizeof(std::uint32_t) * (sub_begin_.size() + member_begin_.size());
    m.cross_covariance = sizeof(float) * cross_cov_.size();
    m.metric = sizeof(float) * static_cast<std::uint64_t>(metric_.size());
    m.probes = sizeof(float) * static_cast<std::uint64_t>(probes_.size());
    m.token_scan = member_keys_.bytes() + member_codes_.bytes();
    return m;
  }
  std::uint64_t bytes() const { return memory().total(); }

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
    require(cfg_.cross_covariance_rank <= std::min(d_, dv_), "config.cross_covariance_rank", "must be at most min(d, dv) = ",
            std::min(d_, dv_), " (0: full), got ", cfg_.cross_covariance_rank);
    const index_t n = kv.n() > cfg_.window ? kv.n() - cfg_.window : 0;  // the last `window` tokens stay exact
    sinks_ = std::min(cfg_.sinks, n);
    const row_matrix keys = read_keys(kv, 0, kv.n());
    check_values(kv, 0, kv.n());
    const auto middle = keys.middleRows(static_cast<Eigen::Index>(sinks_), static_cast<Eigen::Index>(n - sinks_));
    require(cfg_.sample_outlier_share >= 0.0 && cfg_.sample_outlier_share <= 1.0, "config.sample_outlier_share",
            "must lie in [0, 1], got ", cfg_.sample_outlier_share);
    require(cfg_.query_sample.size() % d_ == 0, "config.query_sample", "holds ", cfg_.query_sample.size(),
            " floats, not a multiple of d = ", d_);
    for (std::size_t i = 0; i < cfg_.query_sample.size(); ++i)
      require(std::isfinite(cfg_.query_sample[i]), "config.query_sample", "element ", i, " (row ", i / d_, ") is not finite");
    require(!cfg_.query_metric || !cfg_.query_sample.empty(), "config.query_metric",
            "needs config.query_sample: the queries that define the metric");
    metric_ = cfg_.query_metric ? query_metric_root() : row_matrix();
    clear_layout();
    if (n > sinks_) {
      std::vector<std::uint32_t> outliers;
      const bool by_sample = cfg_.sample_outlier_share > 0.0 && !cfg_.query_sample.empty();
      const std::vector<float> attention = by_sample ? sample_attention(middle) : std::vector<float>();
      add_clusters(partition(in_metric(middle), parallel_for, outliers, by_sample ? &attention : nullptr), sinks_);
      for (auto p : outliers) outliers_.push_back(static_cast<std::uint32_t>(p + sinks_));
    }
    n_ = n;
    choose_probes(keys);
    clear_summaries();
    regroup(0, 0, 0);
    compute_moments(kv, clusters_from(0), parallel_for);
    build_token_scan(keys);
    built_mean_sq_dist_ = 0.0;
    for (index_t c = 0; c < clusters_; ++c) built_mean_sq_dist_ += static_cast<double>(counts_[c]) * metric_spread(c);
    built_mean_sq_dist_ /= static_cast<double>(std::max<index_t>(n_ - sinks_ - outliers_.size(), 1));
    n_at_build_ = n;
    appended_ = joined_ = segment_size_ = 0;
    built_clusters_ = clusters_;
    built_subclusters_ = subclusters_;
    appended_sq_dist_ = 0.0;
    ++generation_;
    build_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  using cluster_members = std::vector<std::vector<std::uint32_t>>;  // subclusters, each increasing positions

  // The members' keys in member order, 4-bit or as 2-bit codes (mog_config::token_scan, token_scan_code).
  void build_token_scan(const row_matrix& keys) {
    member_keys_ = quantized_keys();
    member_codes_ = residual_codes();
    scanned_clusters_ = 0;
    if (!cfg_.token_scan || members_.empty()) return;
    row_matrix rows(static_cast<Eigen::Index>(members_.size()), static_cast<Eigen::Index>(d_));
    for (index_t j = 0; j < members_.size(); ++j)
      rows.row(static_cast<Eigen::Index>(j)) = keys.row(static_cast<Eigen::Index>(members_[j]));
    if (cfg_.token_scan_code == mog_config::scan_code::residual_2bit) {
      std::vector<index_t> cluster_rows(clusters_ + 1);
      for (index_t c = 0; c <= clusters_; ++c) cluster_rows[c] = member_begin_[sub_begin_[c]];
      member_codes_ = residual_codes::build(rows.data(), members_.size(), d_, cluster_rows);
    } else {
      member_keys_ = quantized_keys::build(kv_view<float>(rows.data(), rows.data(), members_.size(), d_, d_));
    }
    scanned_clusters_ = clusters_;
  }

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
    // (2/3) ln n: 8 at n = 128K, which keeps the index within 5 % of a d = 128 fp16 head's
    // KV bytes (docs/methods/mog.md, "memory"); ln n (12) measured no more accurate there.
    return cfg_.subclusters ? cfg_.subclusters
                            : std::max<index_t>(1, static_cast<index_t>(std::lround(2.0 / 3.0 * std::log(double(n)))));
  }

  // k clusters of the rows of keys, each split into up to s subclusters; positions are row
  // numbers. With `mahalanobis`, also each row's leave-one-out squared Mahalanobis distance
  // (diagonal) to its cluster: the worst-case z-score of its score over query directions;
  // the largest float for members of clusters too small to judge (isolated keys).
  std::vector<cluster_members> two_level(const row_matrix& keys, index_t k, index_t s, const parallel_for_fn& parallel_for,
                                         std::vector<float>* mahalanobis) const {
    const index_t n = static_cast<index_t>(keys.rows());
    const kmeans_result top = kmeans(keys, {std::max<index_t>(1, k), cfg_.iterations, 8, cfg_.seed}, parallel_for);
    const index_t kept = static_cast<index_t>(top.centroids.rows());
    std::vector<std::vector<std::uint32_t>> in_cluster(kept);
    for (index_t i = 0; i < n; ++i) in_cluster[top.labels[i]].push_back(static_cast<std::uint32_t>(i));
    std::vector<cluster_members> parts(kept);
    std::vector<spread_of_cluster> spreads(mahalanobis ? kept : 0);
    parallel_for(kept, [&](index_t c) {
      const auto& rows = in_cluster[c];
      row_matrix x(static_cast<Eigen::Index>(rows.size()), keys.cols());
      for (index_t j = 0; j < rows.size(); ++j) x.row(static_cast<Eigen::Index>(j)) = keys.row(rows[j]);
      if (mahalanobis && rows.size() < min_outlier_group)  // isolated keys: no spread to judge them by, and
        for (auto r : rows) (*mahalanobis)[r] = std::numeric_limits<float>::max();  // cheaper exact than as a group
      if (mahalanobis && rows.size() >= min_outlier_group) {
        auto& sp = spreads[c];
        sp.mean = x.cast<double>().colwise().mean().transpose().array();
        sp.var = (x.cast<double>().rowwise() - sp.mean.transpose().matrix()).array().square().colwise().mean().transpose();
        sp.floor = 1e-6 * sp.var.mean() + 1e-30;
        sp.m = static_cast<double>(rows.size());
        for (index_t j = 0; j < rows.size(); ++j) {
          const Eigen::ArrayXd z2 = sp.whitened(x.row(static_cast<Eigen::Index>(j))).square();
          (*mahalanobis)[rows[j]] = static_cast<float>(outlier_statistic(z2.data()));
        }
        // Passes stop early once one keeps as many members as the pass before (the count,
        // not the set, is compared: a cheap proxy; the default runs one pass anyway).
        for (index_t pass = 0, kept = rows.size(); pass < cfg_.outlier_clip_passes; ++pass) {
          const index_t now = clipped_statistics(x, rows, sp, *mahalanobis);
          if (now == kept) break;
          kept = now;
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
    if (mahalanobis && cfg_.outlier_directions > 0)
      concentrated_deviations(keys, in_cluster, spreads, parallel_for, *mahalanobis);
    return parts;
  }

  // A cluster's mean and diagonal variance, for the leave-one-out outlier tests.
  struct spread_of_cluster {
    Eigen::ArrayXd mean, var;
    double floor = 0.0, m = 0.0;
    // The key's deviation from the cluster mean in units of the leave-one-out standard
    // deviation (a lone far point must not hide by inflating the variance it is judged by);
    // its squared norm is the leave-one-out squared Mahalanobis distance.
    template <class Row>
    Eigen::ArrayXd whitened(const Row& key) const {
      const Eigen::ArrayXd dev = key.template cast<double>().transpose().array() - mean;
      const double f = m / (m - 1);
      const Eigen::ArrayXd var_loo = f * (var - dev.square() / (m - 1)).max(0.0);
      return f * dev / (var_loo + floor).sqrt();
    }
  };

  // Sigma clipping: the cluster's moments again without the members past the threshold,
  // and every member's statistic against them (the candidates' as non-members). Several
  // far keys in one cluster inflate its variance along their shared deviation and hide
  // each other from the leave-one-out test.
  // Returns the members kept (all of them when none is far, or when too few would be left).
  index_t clipped_statistics(const row_matrix& x, const std::vector<std::uint32_t>& rows, spread_of_cluster& sp,
                             std::vector<float>& statistic) const {
    const double threshold = outlier_threshold();
    std::vector<char> far(rows.size(), 0);
    index_t kept = 0;
    for (index_t j = 0; j < rows.size(); ++j) {
      far[j] = static_cast<double>(statistic[rows[j]]) > threshold;
      kept += !far[j];
    }
    if (kept == rows.size() || kept < min_outlier_group) return rows.size();
    Eigen::ArrayXd mean = Eigen::ArrayXd::Zero(x.cols()), sq = Eigen::ArrayXd::Zero(x.cols());
    for (index_t j = 0; j < rows.size(); ++j)
      if (!far[j]) mean += x.row(static_cast<Eigen::Index>(j)).cast<double>().transpose().array();
    mean /= static_cast<double>(kept);
    for (index_t j = 0; j < rows.size(); ++j)
      if (!far[j]) sq += (x.row(static_cast<Eigen::Index>(j)).cast<double>().transpose().array() - mean).square();
    sp.mean = mean;
    sp.var = sq / static_cast<double>(kept);
    sp.floor = 1e-6 * sp.var.mean() + 1e-30;
    sp.m = static_cast<double>(kept);
    for (index_t j = 0; j < rows.size(); ++j) {
      const auto row = x.row(static_cast<Eigen::Index>(j));
      Eigen::ArrayXd z2;
      if (far[j]) {
        const double f = sp.m / (sp.m - 1);  // the unbiased variance of the members it is not one of
        z2 = (row.cast<double>().transpose().array() - sp.mean).square() / (f * sp.var + sp.floor);
      } else {
        z2 = sp.whitened(row).square();
      }
      statistic[rows[j]] = static_cast<float>(outlier_statistic(z2.data()));
    }
    return kept;
  }

  // The second outlier test: deviations concentrated in a few directions. The all-dimension
  // distance sums d chi-square terms, so a key 7 sigma out along one direction shared by a
  // class of keys (a salient token) hides among the noise of the other dimensions. Here the
  // whitened deviations of all clusters' members are pooled, their p principal directions
  // found (from a sample), and each key's squared projection on them, scaled by the median
  // of the members (robust to the outliers themselves), is a chi-square(p) statistic. It is
  // mapped to the chi-square(d) value of the same tail probability (Wilson-Hilferty), so that
  // one threshold and one farthest-first ranking serve both tests; the larger counts.
  // Opt-in: measured mixed (docs/log/mog.md, "A test for concentrated deviations").
  void concentrated_deviations(const row_matrix& keys, const std::vector<std::vector<std::uint32_t>>& in_cluster,
                               const std::vector<spread_of_cluster>& spreads, const parallel_for_fn& parallel_for,
                               std::vector<float>& mahalanobis) const {
    const auto d = static_cast<Eigen::Index>(keys.cols());
    const auto p = static_cast<Eigen::Index>(std::min<index_t>(cfg_.outlier_directions, static_cast<index_t>(d)));
    std::vector<std::pair<index_t, index_t>> tested;  // (cluster, member)
    for (index_t c = 0; c < in_cluster.size(); ++c)
      if (in_cluster[c].size() >= min_outlier_group)
        for (index_t j = 0; j < in_cluster[c].size(); ++j) tested.emplace_back(c, j);
    if (tested.size() < 4 * static_cast<index_t>(d) || p >= d) return;  // too few to find directions in
    constexpr index_t sample = 8192;
    const index_t stride = std::max<index_t>(1, tested.size() / sample);
    Eigen::MatrixXd r(d, static_cast<Eigen::Index>((tested.size() + stride - 1) / stride));
    for (index_t i = 0, col = 0; i < tested.size(); i += stride, ++col) {
      const auto [c, j] = tested[i];
      r.col(static_cast<Eigen::Index>(col)) = spreads[c].whitened(keys.row(in_cluster[c][j])).matrix();
    }
    const Eigen::MatrixXd cov = r * r.transpose() / static_cast<double>(r.cols());
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(cov);
    const Eigen::MatrixXd dirs = eig.eigenvectors().rightCols(p);  // eigenvalues ascend
    Eigen::MatrixXd proj(p, static_cast<Eigen::Index>(tested.size()));
    parallel_for(tested.size(), [&](index_t i) {
      const auto [c, j] = tested[i];
      proj.col(static_cast<Eigen::Index>(i)) = dirs.transpose() * spreads[c].whitened(keys.row(in_cluster[c][j])).matrix();
    });
    Eigen::VectorXd scale(p);
    std::vector<double> sq(tested.size());
    for (Eigen::Index k = 0; k < p; ++k) {
      for (index_t i = 0; i < tested.size(); ++i) sq[i] = proj(k, static_cast<Eigen::Index>(i)) * proj(k, static_cast<Eigen::Index>(i));
      std::nth_element(sq.begin(), sq.begin() + static_cast<std::ptrdiff_t>(sq.size() / 2), sq.end());
      scale(k) = std::max(sq[sq.size() / 2] / 0.454936, 1e-30);  // the median of chi-square(1)
    }
    const double dd = static_cast<double>(d), pp = static_cast<double>(p);
    for (index_t i = 0; i < tested.size(); ++i) {
      const double t = (proj.col(static_cast<Eigen::Index>(i)).array().square() / scale.array()).sum();
      float& slot = mahalanobis[in_cluster[tested[i].first][tested[i].second]];
      slot = std::max(slot, static_cast<float>(detail::chi_square_at_z(detail::chi_square_z(t, pp), dd)));
    }
  }

  // Two-level k-means of the rows of keys, then outliers (row numbers, increasing) taken out:
  // with the query sample's per-row attention, its sample_outlier_share of the cap most
  // attended first, then the farthest by the distance tests up to the cap.
  std::vector<cluster_members> partition(const row_matrix& keys, const parallel_for_fn& parallel_for,
                                         std::vector<std::uint32_t>& outliers, const std::vector<float>* attention = nullptr) const {
    const index_t n = static_cast<index_t>(keys.rows());
    const index_t want_c = cfg_.clusters ? cfg_.clusters : static_cast<index_t>(std::lround(std::sqrt(double(n))));
    const auto cap = static_cast<index_t>(cfg_.outlier_fraction * static_cast<double>(n));
    std::vector<float> statistic(n, 0.f);
    std::vector<cluster_members> parts = two_level(keys, want_c, subclusters_per_cluster(n), parallel_for, &statistic);
    if (attention) {  // the most attended rank above every distance (isolated keys have the largest finite float)
      const auto take = std::min<index_t>(n, static_cast<index_t>(std::lround(cfg_.sample_outlier_share * static_cast<double>(cap))));
      std::vector<std::uint32_t> rows(n);
      std::iota(rows.begin(), rows.end(), 0u);
      std::nth_element(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(take), rows.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return (*attention)[a] > (*attention)[b]; });
      for (index_t j = 0; j < take; ++j) statistic[rows[j]] = std::numeric_limits<float>::infinity();
    }
    outliers = split_outliers(parts, statistic, outlier_threshold(), cap);
    return parts;
  }

  // Each row's softmax weight under every query of the sample (scale 1/sqrt(d)), summed over
  // the sample: two passes over blocks of rows (log-sum-exp per query, then the weights), so
  // that no [rows, sample] matrix is held.
  template <class Rows>
  std::vector<float> sample_attention(const Rows& keys) const {
    const Eigen::Index d = static_cast<Eigen::Index>(d_), n = keys.rows(), block = 4096;
    const Eigen::Map<const row_matrix> q(cfg_.query_sample.data(), static_cast<Eigen::Index>(cfg_.query_sample.size() / d_), d);
    const float scale = 1.f / std::sqrt(static_cast<float>(d_));
    Eigen::ArrayXd top = Eigen::ArrayXd::Constant(q.rows(), -std::numeric_limits<double>::infinity()), sum = Eigen::ArrayXd::Zero(q.rows());
    for (Eigen::Index b = 0; b < n; b += block) {
      const Eigen::MatrixXf z = (keys.middleRows(b, std::min(block, n - b)) * q.transpose()) * scale;
      for (Eigen::Index r = 0; r < q.rows(); ++r) {
        const double m = std::max(top[r], static_cast<double>(z.col(r).maxCoeff()));
        sum[r] = sum[r] * std::exp(top[r] - m) + (z.col(r).cast<double>().array() - m).exp().sum();
        top[r] = m;
      }
    }
    const Eigen::ArrayXd lse = top + sum.log();
    std::vector<float> out(static_cast<std::size_t>(n), 0.f);
    for (Eigen::Index b = 0; b < n; b += block) {
      const Eigen::MatrixXf z = (keys.middleRows(b, std::min(block, n - b)) * q.transpose()) * scale;
      for (Eigen::Index i = 0; i < z.rows(); ++i)
        out[static_cast<std::size_t>(b + i)] = static_cast<float>((z.row(i).cast<double>().array().transpose() - lse).exp().sum());
    }
    return out;
  }

  // Squared Mahalanobis distance beyond which a key is an outlier: a chi-square tail.
  double outlier_threshold() const {
    return static_cast<double>(d_) + cfg_.outlier_sigma * std::sqrt(2.0 * static_cast<double>(d_));
  }

  // Rows whose statistic passes the threshold, the largest first and at most cap of them,
  // taken out of parts; returned in increasing order.
  std::vector<std::uint32_t> split_outliers(std::vector<cluster_members>& parts, const std::vector<float>& mahalanobis,
                                            double threshold, index_t cap) const {
    std::vector<std::uint32_t> outliers;
    for (index_t i = 0; i < mahalanobis.size(); ++i)
      if (mahalanobis[i] > threshold) outliers.push_back(static_cast<std::uint32_t>(i));
    if (outliers.size() > cap) {
      std::nth_element(outliers.begin(), outliers.begin() + static_cast<std::ptrdiff_t>(cap), outliers.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return mahalanobis[a] > mahalanobis[b]; });
      outliers.resize(cap);
    }
    if (outliers.empty()) return outliers;
    std::vector<char> is_outlier(mahalanobis.size(), 0);
    for (auto i : outliers) is_outlier[i] = 1;
    remove_rows(parts, is_outlier);
    std::sort(outliers.begin(), outliers.end());
    return outliers;
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

  void clear_layout() {
    clusters_ = subclusters_ = 0;
    sub_begin_.assign(1, 0);
    member_begin_.assign(1, 0);
    members_.clear();
    outliers_.clear();
  }
  void clear_summaries() {
    summary_.clear();
    scales_.clear();
    counts_.clear();
    log_counts_.clear();
    variance_fit_.clear();
    cross_cov_.clear();
  }
  std::vector<index_t> clusters_from(index_t c_first) const {
    std::vector<index_t> list(clusters_ - c_first);
    std::iota(list.begin(), list.end(), c_first);
    return list;
  }
  index_t row_width() const { return 2 * d_ + dv_; }
  std::vector<float> decoded(index_t g, index_t part, index_t width) const {
    std::vector<float> out(width);
    detail::decode_halves(summary_.data() + g * row_width() + part * d_, scales_[3 * g + part], width, out.data());
    return out;
  }

  // Probe queries for the variance fit, times the default query scale 1/sqrt(d): rows of the
  // query sample when the engine gives one, else keys of the clustered middle; either spread
  // evenly (every topic of a long context gets some).
  void choose_probes(const row_matrix& keys) {
    const bool queries = !cfg_.query_sample.empty();
    const index_t first = queries ? 0 : sinks_;
    const index_t span = queries ? cfg_.query_sample.size() / d_ : (n_ > sinks_ ? n_ - sinks_ : 0);
    const index_t count = span > 0 && n_ > sinks_ ? std::min(cfg_.variance_fit_probes, span) : 0;
    probes_.resize(static_cast<Eigen::Index>(count), static_cast<Eigen::Index>(d_));
    const float scale = 1.f / std::sqrt(static_cast<float>(d_));
    for (index_t p = 0; p < count; ++p) {
      const index_t row = first + (2 * p + 1) * span / (2 * count);
      if (queries)
        for (index_t t = 0; t < d_; ++t) probes_(static_cast<Eigen::Index>(p), static_cast<Eigen::Index>(t)) = cfg_.query_sample[row * d_ + t] * scale;
      else
        probes_.row(static_cast<Eigen::Index>(p)) = keys.row(static_cast<Eigen::Index>(row)) * scale;
    }
  }
  // log sum_i exp(probe . k_i) of the given keys, for every probe.
  Eigen::VectorXd probe_log_masses(const row_matrix& rows) const {
    const Eigen::MatrixXf scores = rows * probes_.transpose();  // [rows, probes]
    Eigen::VectorXd out(probes_.rows());
    for (Eigen::Index p = 0; p < scores.cols(); ++p) {
      const double top = scores.col(p).maxCoeff();
      out[p] = top + std::log((scores.col(p).cast<double>().array() - top).exp().sum());
    }
    return out;
  }
  // The factor c minimising sum_p (true - c * gaussian)^2 over the probes, where true is the
  // group's log-mass above log n + probe.mu and gaussian its variance term; in [0, 1].
  double fit_variance(const Eigen::VectorXd& log_mass, index_t count, const Eigen::VectorXd& mean,
                      const Eigen::VectorXd& m2) const {
    double num = 0.0, den = 0.0;
    const Eigen::ArrayXd var = m2.array() / static_cast<double>(count);
    for (Eigen::Index p = 0; p < log_mass.size(); ++p) {
      const Eigen::ArrayXd q = probes_.row(p).transpose().cast<double>().array();
      const double above = log_mass[p] - std::log(static_cast<double>(count)) - (q * mean.array()).sum();
      const double gaussian = 0.5 * (q.square() * var).sum();
      num += above * gaussian;
      den += gaussian * gaussian;
    }
    return den > 0.0 ? std::clamp(num / den, 0.0, 1.0) : 1.0;
  }

  // Exact moments (two passes in double, from the cache) of the listed clusters and their
  // subclusters, plus the optional value-key covariance; the summary arrays must already
  // have room for every group (regroup).
  template <KvView KV>
  void compute_moments(const KV& kv, const std::vector<index_t>& which, const parallel_for_fn& parallel_for) {
    const auto d = static_cast<Eigen::Index>(d_), dv = static_cast<Eigen::Index>(dv_);
    parallel_for(which.size(), [&](index_t w) {
      const index_t c = which[w];
      Eigen::VectorXd key(d), c_mean = Eigen::VectorXd::Zero(d), c_m2 = Eigen::VectorXd::Zero(d), c_vsum = Eigen::VectorXd::Zero(dv);
      auto read_key = [&](index_t i) {
        const auto* k = kv.key_row(i);
        for (Eigen::Index t = 0; t < d; ++t) key[t] = to_float(k[t]);
      };
      index_t total = 0;
      std::vector<std::pair<index_t, Eigen::VectorXd>> sub_means;
      const auto probes = probes_.rows();
      Eigen::VectorXd c_log_mass = Eigen::VectorXd::Constant(probes, -std::numeric_limits<double>::infinity());
      row_matrix rows_read;  // the subcluster's keys, for the probes' scores
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s) {
        const auto rows = members(s);
        Eigen::VectorXd mean = Eigen::VectorXd::Zero(d), m2 = Eigen::VectorXd::Zero(d), vsum = Eigen::VectorXd::Zero(dv);
        for (auto i : rows) {
          read_key(i);
          mean += key;
        }
        mean /= static_cast<double>(rows.size());
        if (probes) rows_read.resize(static_cast<Eigen::Index>(rows.size()), d);
        for (index_t j = 0; j < rows.size(); ++j) {
          const auto i = rows[j];
          read_key(i);
          if (probes) rows_read.row(static_cast<Eigen::Index>(j)) = key.cast<float>().transpose();
          m2 += (key - mean).array().square().matrix();
          const auto* v = kv.value_row(i);
          for (Eigen::Index t = 0; t < dv; ++t) vsum[t] += to_float(v[t]);
        }
        Eigen::VectorXd log_mass(probes);
        if (probes) {
          log_mass = probe_log_masses(rows_read);
          for (Eigen::Index p = 0; p < probes; ++p) c_log_mass[p] = detail::log_add(c_log_mass[p], log_mass[p]);
        }
        set_group(clusters_ + s, rows.size(), mean, m2, vsum, fit_variance(log_mass, rows.size(), mean, m2));
        c_m2 += m2;
        c_vsum += vsum;
        c_mean += static_cast<double>(rows.size()) * mean;
        total += rows.size();
        sub_means.emplace_back(rows.size(), std::move(mean));
      }
      c_mean /= static_cast<double>(total);
      // Pooled second moment: within-subcluster spread plus the spread of subcluster means.
      for (const auto& [count, mean] : sub_means) c_m2 += static_cast<double>(count) * (mean - c_mean).array().square().matrix();
      set_group(c, total, c_mean, c_m2, c_vsum, fit_variance(c_log_mass, total, c_mean, c_m2));
      if (!cfg_.cross_covariance) return;
      const Eigen::VectorXd nu = c_vsum / static_cast<double>(total);
      Eigen::MatrixXd kc(static_cast<Eigen::Index>(total), d), vc(static_cast<Eigen::Index>(total), dv);
      Eigen::Index r = 0;
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s)
        for (auto i : members(s)) {
          read_key(i);
          kc.row(r) = (key - c_mean).transpose();
          const auto* v = kv.value_row(i);
          for (Eigen::Index t = 0; t < dv; ++t) vc(r, t) = to_float(v[t]) - nu[t];
          ++r;
        }
      const Eigen::MatrixXd cov = vc.transpose() * kc / static_cast<double>(total);  // [dv, d]
      float* out = cross_cov_.data() + c * cross_covariance_width();
      if (cfg_.cross_covariance_rank == 0) {
        for (Eigen::Index a = 0; a < dv; ++a)
          for (Eigen::Index t = 0; t < d; ++t) out[a * d + t] = static_cast<float>(cov(a, t));
      } else {
        store_low_rank(cov, cfg_.cross_covariance_rank, out);
      }
    });
  }

  // The best rank-r factors of cov [dv, d] as B [r, d] (orthonormal rows spanning its top right
  // singular vectors) and A^T = (cov B^T)^T [r, dv]: cov ~ A B. Subspace iteration on cov^T cov
  // with 6 extra columns from a fixed start, then the best r of them (Rayleigh-Ritz): a full
  // eigensolver per cluster would cost ~1 ms at d = 128.
  static void store_low_rank(const Eigen::MatrixXd& cov, index_t rank, float* out) {
    const Eigen::Index d = cov.cols(), dv = cov.rows(), r = static_cast<Eigen::Index>(rank), k = std::min<Eigen::Index>(d, r + 6);
    const Eigen::MatrixXd gram = cov.transpose() * cov;
    Eigen::MatrixXd b(d, k);
    for (Eigen::Index t = 0; t < d; ++t)  // a fixed start with no special direction
      for (Eigen::Index j = 0; j < k; ++j) b(t, j) = std::cos(0.7 * static_cast<double>(t * (j + 1)) + static_cast<double>(j));
    for (int pass = 0; pass < 12; ++pass) {
      b = gram * b;
      b = Eigen::HouseholderQR<Eigen::MatrixXd>(b).householderQ() * Eigen::MatrixXd::Identity(d, k);
    }
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> ritz(b.transpose() * gram * b);  // eigenvalues increasing
    b = b * ritz.eigenvectors().rightCols(r);
    const Eigen::MatrixXd a = cov * b;  // [dv, r]
    for (Eigen::Index j = 0; j < r; ++j) {
      for (Eigen::Index t = 0; t < d; ++t) out[j * d + t] = static_cast<float>(b(t, j));
      for (Eigen::Index i = 0; i < dv; ++i) out[r * d + j * dv + i] = static_cast<float>(a(i, j));
    }
  }

  // Resizes the summary arrays to the current counts, keeping the rows of the first
  // keep_clusters clusters and keep_subclusters subclusters; the arrays hold cluster_rows
  // cluster rows before the subcluster rows.
  void regroup(index_t keep_clusters, index_t keep_subclusters, index_t cluster_rows) {
    auto grow = [&](auto& v, index_t width) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      std::vector<T> out(groups() * width, T{});
      std::copy_n(v.begin(), keep_clusters * width, out.begin());
      std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(cluster_rows * width), keep_subclusters * width,
                  out.begin() + static_cast<std::ptrdiff_t>(clusters_ * width));
      v = std::move(out);
    };
    grow(summary_, row_width());
    grow(scales_, 3);
    grow(log_counts_, 1);
    grow(variance_fit_, 1);
    grow(counts_, 1);
    if (cfg_.cross_covariance) cross_cov_.resize(clusters_ * cross_covariance_width(), 0.f);  // rows of kept clusters stay
  }

  void set_group(index_t g, index_t count, const Eigen::VectorXd& mean, const Eigen::VectorXd& m2,
                 const Eigen::VectorXd& value_sum, double variance_fit) {
    counts_[g] = static_cast<std::uint32_t>(count);
    variance_fit_[g] = static_cast<float>(variance_fit);
    log_counts_[g] = static_cast<float>(std::log(static_cast<double>(count)));
    half* row = summary_.data() + g * row_width();
    const Eigen::VectorXd var = m2 / static_cast<double>(count), nu = value_sum / static_cast<double>(count);
    scales_[3 * g] = detail::encode_halves(mean.data(), d_, row);
    scales_[3 * g + 1] = detail::encode_halves(var.data(), d_, row + d_);
    scales_[3 * g + 2] = detail::encode_halves(nu.data(), dv_, row + 2 * d_);
  }

  // New tokens [first, first + keys.rows()) join their nearest cluster when they lie within
  // the chi-square tail of its spread, then the nearest subcluster of it; the moments of
  // the clusters that took tokens are recomputed from the cache (fp16 summaries cannot
  // take running updates). The others form new clusters of their own (a new topic must not
  // swell an old cluster that happens to be nearest). Outliers among both, as at build.
  template <KvView KV>
  void join_tokens(const KV& kv, const row_matrix& keys, index_t first, const parallel_for_fn& parallel_for) {
    const index_t count = static_cast<index_t>(keys.rows());
    const row_matrix placed = in_metric(keys);  // the metric the clusters were built in
    // Only clusters of the appended segment take tokens: the built ones stay as built.
    const index_t seg = built_clusters_, seg_sub = built_subclusters_;
    std::vector<std::uint32_t> cluster_of(count, 0);
    std::vector<float> sq_dist(count, std::numeric_limits<float>::infinity());
    row_matrix sub_centres;
    if (clusters_ > seg) {
      const row_matrix centres = in_metric(mean_rows(seg, clusters_ - seg));
      sub_centres = in_metric(mean_rows(clusters_ + seg_sub, subclusters_ - seg_sub));
      detail::kmeans_assign(placed, centres, cluster_of, sq_dist, parallel_for);
      for (auto& c : cluster_of) c += static_cast<std::uint32_t>(seg);
    }

    const double join_factor = 1.0 + cfg_.join_sigma * std::sqrt(2.0 / static_cast<double>(d_));
    std::vector<std::int64_t> sub_of(count, -1);
    std::vector<std::uint32_t> novel, new_outliers;
    std::vector<index_t> tested;  // joined rows whose cluster is large enough to judge them by
    std::vector<char> dirty(clusters_, 0);
    for (index_t r = 0; r < count; ++r) {
      const index_t c = cluster_of[r];
      if (!(sq_dist[r] <= join_factor * spread_in_metric(c))) {  // also: no segment cluster yet
        novel.push_back(static_cast<std::uint32_t>(r));
        continue;
      }
      if (counts_[c] >= min_outlier_group) tested.push_back(r);
      index_t best = sub_begin_[c];
      float best_d2 = std::numeric_limits<float>::infinity();
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s) {
        const float d2 = (placed.row(static_cast<Eigen::Index>(r)) - sub_centres.row(static_cast<Eigen::Index>(s - seg_sub))).squaredNorm();
        if (d2 < best_d2) {
          best_d2 = d2;
          best = s;
        }
      }
      sub_of[r] = static_cast<std::int64_t>(best);
      dirty[c] = 1;
      appended_sq_dist_ += sq_dist[r];
      ++joined_;
    }
    // New clusters of about the current mean size from the tokens no cluster took.
    std::vector<cluster_members> parts;
    std::vector<float> loo(novel.size(), 0.f);  // leave-one-out distances within the new clusters
    if (!novel.empty()) {
      row_matrix fresh(static_cast<Eigen::Index>(novel.size()), static_cast<Eigen::Index>(d_));
      for (index_t j = 0; j < novel.size(); ++j) fresh.row(static_cast<Eigen::Index>(j)) = placed.row(novel[j]);
      const index_t typical = std::max<index_t>(1, (n_ - sinks_ - outliers_.size()) / std::max<index_t>(clusters_, 1));
      parts = two_level(fresh, (novel.size() + typical - 1) / typical, subclusters_per_cluster(n_), serial_for, &loo);
    }

    // Outliers among the new tokens (Euclidean metric only: the variance in a query metric
    // is not kept), the farthest first, within the same share of the clustered tokens as
    // at build. Candidates: joined tokens far from their cluster, members of new clusters
    // far by the build's leave-one-out test, and every member of a new cluster too small to
    // have a spread of its own (an isolated key, e.g. a needle; as a group of a few it would
    // cost more summary bytes than its exact read).
    if (metric_.size() == 0) {
      const auto cap = static_cast<index_t>(cfg_.outlier_fraction * static_cast<double>(first + count - sinks_));
      std::vector<std::pair<double, index_t>> candidates;  // (distance, row; novel rows are count + j)
      const std::vector<double> z2 = joined_distances(keys, cluster_of, tested);
      for (index_t j = 0; j < tested.size(); ++j)
        if (z2[j] > outlier_threshold()) candidates.emplace_back(z2[j], tested[j]);
      for (index_t j = 0; j < novel.size(); ++j)
        if (loo[j] > outlier_threshold()) candidates.emplace_back(loo[j], count + j);
      std::sort(candidates.begin(), candidates.end(), std::greater<>());
      std::vector<char> novel_out(novel.size(), 0);
      for (const auto& [distance, r] : candidates) {
        if (outliers_.size() + new_outliers.size() >= cap) break;
        if (r < count) {
          new_outliers.push_back(static_cast<std::uint32_t>(first + r));
          sub_of[r] = -1;
          --joined_;
        } else {
          new_outliers.push_back(static_cast<std::uint32_t>(first + novel[r - count]));
          novel_out[r - count] = 1;
        }
      }
      remove_rows(parts, novel_out);
    }
    for (auto& cl : parts)
      for (auto& sub : cl)
        for (auto& p : sub) p = novel[p];  // batch row numbers

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

    std::vector<index_t> recompute;
    for (index_t c = 0; c < clusters_; ++c)
      if (dirty[c]) recompute.push_back(c);
    const index_t c_first = clusters_, s_first = subclusters_;
    if (!parts.empty()) {
      add_clusters(parts, first);
      regroup(c_first, s_first, c_first);
      for (index_t c = c_first; c < clusters_; ++c) recompute.push_back(c);
    }
    compute_moments(kv, recompute, parallel_for);
    std::sort(new_outliers.begin(), new_outliers.end());  // all beyond the old ones
    outliers_.insert(outliers_.end(), new_outliers.begin(), new_outliers.end());
    n_ = first + count;
    appended_ += count;
  }

  // Re-partitions the appended tokens [tokens at build, tokens()) among themselves as a
  // build would: two-level k-means into clusters of the built mean size, outliers by the
  // build's leave-one-out test within the same share. The built clusters are untouched
  // (appended tokens only ever join clusters of this segment). Joining alone leaves new
  // tokens judged against clusters fitted to earlier flushes: heavy tokens hide in them and
  // the outlier share goes to the wrong tokens (docs/methods/mog.md, "append"). Run at
  // geometric intervals, so its cost is amortised O(1) per token.
  template <KvView KV>
  void repartition_appended(const KV& kv, const parallel_for_fn& parallel_for) {
    const index_t begin = n_at_build_, m = n_ - n_at_build_, rows = clusters_;
    std::vector<std::uint32_t> outliers;
    for (auto p : outliers_)
      if (p < begin) outliers.push_back(p);
    const double typical = static_cast<double>(n_at_build_ - sinks_ - outliers.size()) /
                           static_cast<double>(std::max<index_t>(built_clusters_, 1));
    const auto k = static_cast<index_t>(std::ceil(static_cast<double>(m) / std::max(typical, 1.0)));
    std::vector<float> mahalanobis(m, 0.f);
    auto fresh = two_level(in_metric(read_keys(kv, begin, n_)), k, subclusters_per_cluster(n_), parallel_for, &mahalanobis);
    for (auto p : split_outliers(fresh, mahalanobis, outlier_threshold(), static_cast<index_t>(cfg_.outlier_fraction * static_cast<double>(m))))
      outliers.push_back(static_cast<std::uint32_t>(begin + p));
    truncate_layout(built_clusters_);
    outliers_ = std::move(outliers);  // built ones first, then appended: increasing
    add_clusters(fresh, begin);
    regroup(built_clusters_, built_subclusters_, rows);
    compute_moments(kv, clusters_from(built_clusters_), parallel_for);
    segment_size_ = m;
    joined_ = 0;
    appended_sq_dist_ = 0.0;
  }

  // Keeps clusters [0, keep) of the layout (and their subclusters and members).
  void truncate_layout(index_t keep) {
    const index_t subs = sub_begin_[keep];
    members_.resize(member_begin_[subs]);
    member_begin_.resize(subs + 1);
    sub_begin_.resize(keep + 1);
    clusters_ = keep;
    subclusters_ = subs;
  }

  // Clusters of fewer keys have no spread to judge a key by (nor, new, to stand as a group).
  static constexpr index_t min_outlier_group = 8;

  // What the outlier threshold is compared with, from a key's d squared whitened deviations:
  // their sum (the squared Mahalanobis distance), or the band test's equivalent if larger.
  double outlier_statistic(const double* z2) const {
    double sum = 0.0;
    for (index_t t = 0; t < d_; ++t) sum += z2[t];
    if (cfg_.outlier_bands == 0 || metric_.size()) return sum;
    // Below the larger of the sum and the threshold a band value changes no decision.
    return std::max(sum, detail::band_deviation(z2, d_, cfg_.outlier_bands, std::max(sum, outlier_threshold())));
  }

  // Squared Mahalanobis distances (diagonal) of the joined rows of keys to their clusters,
  // or the band test's equivalent (outlier_statistic).
  std::vector<double> joined_distances(const row_matrix& keys, const std::vector<std::uint32_t>& cluster_of,
                                       const std::vector<index_t>& rows) const {
    std::vector<double> out(rows.size()), z2(d_);
    std::vector<float> moments(2 * d_);
    for (index_t j = 0; j < rows.size(); ++j) {
      decode_moments(cluster_of[rows[j]], moments.data());
      double mean_var = 0.0;
      for (index_t t = 0; t < d_; ++t) mean_var += moments[d_ + t];
      const double floor = 1e-6 * mean_var / static_cast<double>(d_) + 1e-30;
      for (index_t t = 0; t < d_; ++t) {
        const double dev = static_cast<double>(keys(static_cast<Eigen::Index>(rows[j]), static_cast<Eigen::Index>(t))) - moments[t];
        z2[t] = dev * dev / (moments[d_ + t] + floor);
      }
      out[j] = outlier_statistic(z2.data());
    }
    return out;
  }

  // Takes the marked rows out of parts (dropping subclusters and clusters left empty).
  static void remove_rows(std::vector<cluster_members>& parts, const std::vector<char>& marked) {
    if (std::find(marked.begin(), marked.end(), 1) == marked.end()) return;
    std::vector<cluster_members> kept;
    for (auto& cl : parts) {
      cluster_members subs;
      for (auto& sub : cl) {
        std::erase_if(sub, [&](std::uint32_t i) { return marked[i] != 0; });
        if (!sub.empty()) subs.push_back(std::move(sub));
      }
      if (!subs.empty()) kept.push_back(std::move(subs));
    }
    parts = std::move(kept);
  }

  // Decoded key means of groups [first, first + count), one per row.
  row_matrix mean_rows(index_t first, index_t count) const {
    row_matrix out(static_cast<Eigen::Index>(count), static_cast<Eigen::Index>(d_));
    for (index_t g = 0; g < count; ++g)
      detail::decode_halves(summary_.data() + (first + g) * row_width(), scales_[3 * (first + g)], d_,
                            out.row(static_cast<Eigen::Index>(g)).data());
    return out;
  }

  // A cluster's mean squared distance of members to its mean, in the clustering metric:
  // tr(L^T Sigma L) with the diagonal Sigma; clusters of one borrow the build-wide mean.
  float spread_in_metric(index_t c) const {
    return counts_[c] < 2 ? static_cast<float>(built_mean_sq_dist_) : metric_spread(c);
  }
  float metric_spread(index_t c) const {
    const std::vector<float> v = variance(c);
    const Eigen::Map<const Eigen::VectorXf> var(v.data(), static_cast<Eigen::Index>(d_));
    if (!metric_.size()) return var.sum();
    return (metric_.array().square().colwise() * var.array()).sum();
  }

  // Clusters (or subclusters) of the appended segment that joined tokens have swollen past
  // split_factor x the mean size at build are re-clustered on their own members (two-level
  // k-means); the moments of the segment are recomputed from the cache.
  template <KvView KV>
  void split_oversized(const KV& kv) {
    const auto clustered = static_cast<double>(n_at_build_ - sinks_ - outliers_.size());
    const double typical = clustered / static_cast<double>(std::max<index_t>(built_clusters_, 1));
    const double typical_sub = clustered / static_cast<double>(std::max<index_t>(built_subclusters_, 1));
    auto swollen_group = [&](index_t c) {
      if (static_cast<double>(counts_[c]) > cfg_.split_factor * typical) return true;
      for (index_t s = sub_begin_[c]; s < sub_begin_[c + 1]; ++s)
        if (static_cast<double>(counts_[clusters_ + s]) > cfg_.split_factor * typical_sub) return true;
      return false;
    };
    bool any = false;
    for (index_t c = built_clusters_; c < clusters_ && !any; ++c) any = swollen_group(c);
    if (!any) return;
    std::vector<cluster_members> parts;
    for (index_t c = built_clusters_; c < clusters_; ++c) {
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
      for (index_t j = 0; j < all.size(); ++j)
        for (index_t t = 0; t < d_; ++t)
          x(static_cast<Eigen::Index>(j), static_cast<Eigen::Index>(t)) = to_float(kv.key_row(all[j])[t]);
      auto pieces = two_level(in_metric(x), static_cast<index_t>(std::ceil(static_cast<double>(all.size()) / typical)),
                              subclusters_per_cluster(n_), serial_for, nullptr);
      for (auto& piece : pieces) {
        for (auto& sub : piece)
          for (auto& p : sub) p = all[p];
        parts.push_back(std::move(piece));
      }
    }
    const index_t rows = clusters_;
    truncate_layout(built_clusters_);
    add_clusters(parts, 0);
    regroup(built_clusters_, built_subclusters_, rows);
    compute_moments(kv, clusters_from(built_clusters_), serial_for);
  }

  mog_config cfg_{};
  index_t d_ = 0, dv_ = 0, n_ = 0, sinks_ = 0, clusters_ = 0, subclusters_ = 0;
  std::vector<half> summary_;             // [groups, 2d + dv]: key mean | key variance | value mean, each / its scale
  std::vector<float> scales_;             // [groups, 3]: powers of two
  std::vector<float> log_counts_;         // [groups]
  std::vector<std::uint32_t> counts_;     // [groups]
  std::vector<std::uint32_t> sub_begin_;  // [clusters + 1]
  std::vector<std::uint32_t> member_begin_;  // [subclusters + 1]
  std::vector<std::uint32_t> members_;    // [clustered tokens] positions, subcluster by subcluster
  std::vector<std::uint32_t> outliers_;   // positions of exact outlier tokens, increasing
  std::vector<float> cross_cov_;          // [clusters, dv, d] when configured
  std::vector<float> variance_fit_;       // [groups]: factor of the variance term (1: the Gaussian's)
  row_matrix probes_;                     // [variance_fit_probes, d]: probe queries, scale included
  quantized_keys member_keys_;            // mog_config::token_scan: 4-bit keys of the built clusters' members
  residual_codes member_codes_;           // or their 2-bit standardised codes (mog_config::token_scan_code)
  index_t scanned_clusters_ = 0;          // clusters [0, this) have their members in member_keys_ or member_codes_
  row_matrix metric_;                     // [d, d] L of the query metric, empty for Euclidean
  index_t n_at_build_ = 0, appended_ = 0, joined_ = 0, built_clusters_ = 0, built_subclusters_ = 0;
  index_t segment_size_ = 0;  // appended tokens at the last re-partition of the appended segment
  double built_mean_sq_dist_ = 0.0, appended_sq_dist_ = 0.0;
  std::uint64_t generation_ = 0;
  double build_seconds_ = 0.0;
};

}  // namespace floe
