// The Llama decoder (SmolLM2) on Eigen: RMSNorm, RoPE, grouped-query attention, SwiGLU
// MLP, tied or separate output embedding. Weights are dequantised to float once at load.
// Attention is a callback so that prefill (dense, causal, Eigen) and decode (through
// floe) share every other line of the forward pass.
#pragma once

#include <Eigen/Dense>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "floe/core/error.hpp"
#include "gguf.hpp"

namespace smollm {

using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct llama_config {
  int n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_vocab = 0, n_ctx_train = 0;
  float rope_base = 10000.f, rms_eps = 1e-5f;
  std::string name;

  static llama_config from_gguf(const gguf_file& f) {
    const std::string arch = f.get_string("general.architecture");
    floe::require(arch == "llama", "gguf", "general.architecture is '", arch, "'; only 'llama' is supported");
    llama_config c;
    c.name = f.has("general.name") ? f.get_string("general.name") : arch;
    c.n_layer = static_cast<int>(f.get_int("llama.block_count"));
    c.n_embd = static_cast<int>(f.get_int("llama.embedding_length"));
    c.n_ff = static_cast<int>(f.get_int("llama.feed_forward_length"));
    c.n_head = static_cast<int>(f.get_int("llama.attention.head_count"));
    c.n_head_kv = f.has("llama.attention.head_count_kv") ? static_cast<int>(f.get_int("llama.attention.head_count_kv"))
                                                         : c.n_head;
    c.n_ctx_train = static_cast<int>(f.get_int("llama.context_length"));
    if (f.has("llama.rope.freq_base")) c.rope_base = static_cast<float>(f.get_float("llama.rope.freq_base"));
    c.rms_eps = static_cast<float>(f.get_float("llama.attention.layer_norm_rms_epsilon"));
    floe::require(c.n_head > 0 && c.n_head_kv > 0 && c.n_head % c.n_head_kv == 0 && c.n_embd % c.n_head == 0, "gguf",
                  "inconsistent head counts: ", c.n_head, " query heads, ", c.n_head_kv, " KV heads, width ", c.n_embd);
    c.head_dim = c.n_embd / c.n_head;
    floe::require(c.head_dim % 2 == 0, "gguf", "head dimension ", c.head_dim, " is odd; RoPE needs pairs");
    c.n_vocab = static_cast<int>(f.tensor("token_embd.weight").dims[1]);
    return c;
  }
  int group() const { return n_head / n_head_kv; }
};

// Keys (post-RoPE) and values of every layer, [layer][kv head][position][head_dim].
struct kv_cache {
  int n_layer = 0, n_head_kv = 0, head_dim = 0, capacity = 0, n = 0;
  std::vector<float> keys, values;

  kv_cache(const llama_config& c, int cap)
      : n_layer(c.n_layer), n_head_kv(c.n_head_kv), head_dim(c.head_dim), capacity(cap),
        keys(static_cast<std::size_t>(c.n_layer) * c.n_head_kv * cap * c.head_dim),
        values(keys.size()) {}
  std::size_t offset(int layer, int head, int pos = 0) const {
    return ((static_cast<std::size_t>(layer) * n_head_kv + head) * capacity + pos) * head_dim;
  }
  float* key(int layer, int head, int pos = 0) { return keys.data() + offset(layer, head, pos); }
  float* value(int layer, int head, int pos = 0) { return values.data() + offset(layer, head, pos); }
  const float* key(int layer, int head, int pos = 0) const { return keys.data() + offset(layer, head, pos); }
  const float* value(int layer, int head, int pos = 0) const { return values.data() + offset(layer, head, pos); }
};

class llama_model {
 public:
  explicit llama_model(const gguf_file& f) : config_(llama_config::from_gguf(f)) {
    const int e = config_.n_embd, kv = config_.n_head_kv * config_.head_dim;
    embedding_ = load(f, "token_embd.weight", config_.n_vocab, e);
    output_norm_ = load_vector(f, "output_norm.weight", e);
    if (f.find_tensor("output.weight")) output_ = load(f, "output.weight", config_.n_vocab, e);
    for (int l = 0; l < config_.n_layer; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      layer_weights w;
      w.attn_norm = load_vector(f, p + "attn_norm.weight", e);
      w.ffn_norm = load_vector(f, p + "ffn_norm.weight", e);
      w.wq = load(f, p + "attn_q.weight", e, e);
      w.wk = load(f, p + "attn_k.weight", kv, e);
      w.wv = load(f, p + "attn_v.weight", kv, e);
      w.wo = load(f, p + "attn_output.weight", e, e);
      w.gate = load(f, p + "ffn_gate.weight", config_.n_ff, e);
      w.up = load(f, p + "ffn_up.weight", config_.n_ff, e);
      w.down = load(f, p + "ffn_down.weight", e, config_.n_ff);
      layers_.push_back(std::move(w));
    }
    // RoPE inverse frequencies base^(-2i/d), in double so that positions near 8K stay exact.
    for (int i = 0; i < config_.head_dim / 2; ++i)
      inv_freq_.push_back(std::pow(static_cast<double>(config_.rope_base), -2.0 * i / config_.head_dim));
  }

  const llama_config& config() const { return config_; }

  // Runs tokens at positions cache.n .. cache.n + T - 1, appending their keys and values
  // to the cache. attend(layer, q [T, n_head*head_dim] post-RoPE, cache, first position,
  // out [T, n_head*head_dim]) computes attention. Returns logits [T, vocab] when
  // all_logits, else [1, vocab] for the last token.
  template <class Attend>
  matrix forward(std::span<const int> tokens, kv_cache& cache, Attend&& attend, bool all_logits = false) const {
    const auto T = static_cast<Eigen::Index>(tokens.size());
    const int pos0 = cache.n;
    floe::require(T > 0, "tokens", "nothing to run");
    floe::require(pos0 + T <= cache.capacity, "ctx", pos0 + T, " positions exceed the KV cache capacity ",
                  cache.capacity);
    matrix x(T, config_.n_embd);
    for (Eigen::Index t = 0; t < T; ++t) {
      const int id = tokens[static_cast<std::size_t>(t)];
      floe::require(id >= 0 && id < config_.n_vocab, "tokens", "token id ", id, " is outside the vocabulary");
      x.row(t) = embedding_.row(id);
    }
    matrix h, q, k, v, att(T, config_.n_embd);
    for (int l = 0; l < config_.n_layer; ++l) {
      const layer_weights& w = layers_[static_cast<std::size_t>(l)];
      rms_norm(x, w.attn_norm, h);
      q.noalias() = h * w.wq.transpose();
      k.noalias() = h * w.wk.transpose();
      v.noalias() = h * w.wv.transpose();
      rope(q, pos0);
      rope(k, pos0);
      for (Eigen::Index t = 0; t < T; ++t)
        for (int g = 0; g < config_.n_head_kv; ++g) {
          const int hd = config_.head_dim;
          std::copy_n(k.row(t).data() + g * hd, hd, cache.key(l, g, pos0 + static_cast<int>(t)));
          std::copy_n(v.row(t).data() + g * hd, hd, cache.value(l, g, pos0 + static_cast<int>(t)));
        }
      attend(l, static_cast<const matrix&>(q), static_cast<const kv_cache&>(cache), pos0, att);
      x.noalias() += att * w.wo.transpose();
      rms_norm(x, w.ffn_norm, h);
      matrix gate = h * w.gate.transpose();
      const matrix up = h * w.up.transpose();
      gate = gate.array() / (1.f + (-gate.array()).exp()) * up.array();  // SiLU(gate) * up
      x.noalias() += gate * w.down.transpose();
    }
    cache.n = pos0 + static_cast<int>(T);
    const matrix& out_w = output_.size() ? output_ : embedding_;
    if (all_logits) {
      rms_norm(x, output_norm_, h);
      return h * out_w.transpose();
    }
    const matrix last = x.bottomRows(1);
    rms_norm(last, output_norm_, h);
    return h * out_w.transpose();
  }

  // Rotates each (2i, 2i+1) pair of every head of every row by (pos0 + row) * inv_freq[i]:
  // ggml's "normal" RoPE, which the GGUF converter's permutation of Q and K expects.
  void rope(matrix& m, int pos0) const {
    const int hd = config_.head_dim, heads = static_cast<int>(m.cols()) / hd;
    for (Eigen::Index t = 0; t < m.rows(); ++t)
      for (int i = 0; i < hd / 2; ++i) {
        const double angle = static_cast<double>(pos0 + t) * inv_freq_[static_cast<std::size_t>(i)];
        const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
        for (int h = 0; h < heads; ++h) {
          float& a = m(t, h * hd + 2 * i);
          float& b = m(t, h * hd + 2 * i + 1);
          const float a0 = a, b0 = b;
          a = a0 * c - b0 * s;
          b = a0 * s + b0 * c;
        }
      }
  }

 private:
  struct layer_weights {
    Eigen::RowVectorXf attn_norm, ffn_norm;
    matrix wq, wk, wv, wo, gate, up, down;
  };

  void rms_norm(const matrix& x, const Eigen::RowVectorXf& w, matrix& out) const {
    out.resize(x.rows(), x.cols());
    for (Eigen::Index t = 0; t < x.rows(); ++t) {
      const float ms = x.row(t).squaredNorm() / static_cast<float>(x.cols());
      out.row(t) = x.row(t).cwiseProduct(w) / std::sqrt(ms + config_.rms_eps);
    }
  }

  // A [rows, cols] weight; GGUF stores it as dims {cols, rows}, rows of `cols` elements.
  static matrix load(const gguf_file& f, const std::string& name, int rows, int cols) {
    const gguf_tensor& t = f.tensor(name);
    floe::require(t.dims.size() == 2 && t.dims[0] == static_cast<std::uint64_t>(cols) &&
                      t.dims[1] == static_cast<std::uint64_t>(rows),
                  "gguf", "tensor '", name, "' has the wrong shape for [", rows, ", ", cols, "]");
    const std::vector<float> data = f.dequantize(t);
    return Eigen::Map<const matrix>(data.data(), rows, cols);
  }
  static Eigen::RowVectorXf load_vector(const gguf_file& f, const std::string& name, int n) {
    const gguf_tensor& t = f.tensor(name);
    floe::require(t.elements() == static_cast<std::uint64_t>(n), "gguf", "tensor '", name, "' has ", t.elements(),
                  " elements, ", n, " expected");
    const std::vector<float> data = f.dequantize(t);
    return Eigen::Map<const Eigen::RowVectorXf>(data.data(), n);
  }

  llama_config config_;
  matrix embedding_, output_;
  Eigen::RowVectorXf output_norm_;
  std::vector<layer_weights> layers_;
  std::vector<double> inv_freq_;
};

}  // namespace smollm
