// Attention for the forward pass: dense causal attention on Eigen for prefill, and
// decode-step attention through floe, one floe::kv_view and one GQA query_group per
// (layer, KV head).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/stats.hpp"
#include "model.hpp"

namespace smollm {

// Causal softmax attention of rows q (positions pos0 ..) against cache positions
// [0, pos0 + rows), in blocks of query rows so that an 8K prefill fits in memory.
inline void prefill_attention(const llama_config& c, int layer, const matrix& q, const kv_cache& cache, int pos0,
                              matrix& out) {
  const int hd = c.head_dim, block = 256;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const auto T = q.rows();
  using strided = Eigen::Map<const matrix, 0, Eigen::OuterStride<>>;
  for (int h = 0; h < c.n_head; ++h) {
    const int g = h / c.group();
    for (Eigen::Index b0 = 0; b0 < T; b0 += block) {
      const Eigen::Index rows = std::min<Eigen::Index>(block, T - b0);
      const Eigen::Index keys = pos0 + b0 + rows;  // causal: the last row sees this many
      strided qh(q.data() + b0 * q.cols() + h * hd, rows, hd, Eigen::OuterStride<>(q.cols()));
      Eigen::Map<const matrix> k(cache.key(layer, g), keys, hd), v(cache.value(layer, g), keys, hd);
      matrix s = (qh * k.transpose()) * scale;
      for (Eigen::Index r = 0; r < rows; ++r) {
        const Eigen::Index visible = pos0 + b0 + r + 1;
        auto row = s.row(r).head(visible);
        const float m = row.maxCoeff();
        row = (row.array() - m).exp();
        row /= row.sum();
        s.row(r).tail(keys - visible).setZero();
      }
      out.block(b0, h * hd, rows, hd).noalias() = s * v;
    }
  }
}

// The last `rows` post-RoPE query rows of every layer seen by prefill ([rows, n_head * head_dim]
// each): the query sample a decode method may build its index with (mog:sample).
struct recent_queries {
  int rows = 32;
  std::vector<matrix> layer;
  void keep(int l, const matrix& q) {
    if (layer.size() <= static_cast<std::size_t>(l)) layer.resize(static_cast<std::size_t>(l) + 1);
    matrix& m = layer[static_cast<std::size_t>(l)];
    matrix both(m.rows() + q.rows(), q.cols());
    if (m.rows()) both.topRows(m.rows()) = m;
    both.bottomRows(q.rows()) = q;
    m = both.bottomRows(std::min<Eigen::Index>(rows, both.rows()));
  }
};

// The first n tokens of KV head g of a layer, as floe reads them.
inline floe::kv_view<float> layer_view(const kv_cache& cache, int layer, int g, int n) {
  return {cache.key(layer, g), cache.value(layer, g), static_cast<floe::index_t>(n),
          static_cast<floe::index_t>(cache.head_dim), static_cast<floe::index_t>(cache.head_dim)};
}

// One decode method for every (layer, KV head): a floe estimator and its per-head state.
class decode_attention {
 public:
  virtual ~decode_attention() = default;
  virtual std::string name() const = 0;
  // Called once after prefill, with the cache as it then is.
  virtual void build(const llama_config& c, const kv_cache& cache) = 0;
  // Attention of the single query row q (position pos, whose keys are in the cache) into out.
  virtual void decode(const llama_config& c, int layer, const matrix& q, const kv_cache& cache, int pos, matrix& out,
                      floe::stats& io) = 0;
};

// Adapts floe::estimator<S, R> or floe::any_estimator<E> (anything with their build and
// decode) running on executor Exec: one estimator for every (layer, KV head), or one made
// per (layer, KV head) for methods whose policy depends on the layer (anchor_reuse).
template <class Estimator, class Exec>
class estimator_attention final : public decode_attention {
 public:
  using per_slot = std::function<Estimator(int layer, int kv_head)>;

  estimator_attention(Estimator est, std::string label)
      : make_([est = std::move(est)](int, int) { return est; }), label_(std::move(label)) {}
  estimator_attention(per_slot make, std::string label) : make_(std::move(make)), label_(std::move(label)) {}

  std::string name() const override { return label_; }

  void build(const llama_config& c, const kv_cache& cache) override {
    ests_.clear();
    states_.clear();
    for (int l = 0; l < c.n_layer; ++l)
      for (int g = 0; g < c.n_head_kv; ++g) {
        ests_.push_back(make_(l, g));
        states_.push_back(ests_.back().build(layer_view(cache, l, g, cache.n)));
      }
  }

  void decode(const llama_config& c, int layer, const matrix& q, const kv_cache& cache, int pos, matrix& out,
              floe::stats& io) override {
    const auto hd = static_cast<floe::index_t>(c.head_dim), group = static_cast<floe::index_t>(c.group());
    for (int g = 0; g < c.n_head_kv; ++g) {
      const auto qg = floe::query_group::make(q.row(0).data() + g * group * hd, group, hd);
      const floe::output_group<float> og{out.row(0).data() + g * group * hd, group, hd, 0};
      const auto slot = static_cast<std::size_t>(layer * c.n_head_kv + g);
      const auto kv = layer_view(cache, layer, g, pos + 1);
      ests_[slot].append(states_[slot], kv);  // the cache grew by the tokens decoded so far
      ests_[slot].decode(states_[slot], kv, qg, exec_, og, io);
    }
  }

 private:
  per_slot make_;
  std::string label_;
  Exec exec_{};
  std::vector<Estimator> ests_;
  std::vector<typename Estimator::state> states_;
};

}  // namespace smollm
