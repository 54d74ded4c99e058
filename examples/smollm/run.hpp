// Running the model over text: chunked prefill with a progress bar, and teacher-forced
// or greedy decode steps through a floe decode method.
#pragma once

#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <span>
#include <vector>

#include "attention.hpp"
#include "model.hpp"

namespace smollm {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU seconds of this process: on a shared machine, single-threaded speed is tokens per
// CPU second (wall-clock time also counts waiting for the core).
inline double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

// Prefills `tokens` into the cache in chunks, drawing a progress bar on stderr when
// `progress`. Returns the logits of the last token (all tokens' when all_logits). With
// `recent`, keeps each layer's last query rows there.
inline matrix prefill(const llama_model& model, std::span<const int> tokens, kv_cache& cache,
                      bool all_logits = false, int chunk = 256, bool progress = true, recent_queries* recent = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  matrix logits, part;
  const auto attend = [&](int l, const matrix& q, const kv_cache& c, int pos0, matrix& out) {
    if (recent) recent->keep(l, q);
    prefill_attention(model.config(), l, q, c, pos0, out);
  };
  for (std::size_t done = 0; done < tokens.size();) {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(chunk), tokens.size() - done);
    part = model.forward(tokens.subspan(done, n), cache, attend, all_logits);
    if (all_logits) {
      logits.conservativeResize(static_cast<Eigen::Index>(done + n), part.cols());
      logits.bottomRows(part.rows()) = part;
    } else {
      logits = part;
    }
    done += n;
    if (!progress) continue;
    const int width = 40, filled = static_cast<int>(width * done / tokens.size());
    std::fprintf(stderr, "\rprefill [%.*s%*s] %zu/%zu tokens, %.1f s", filled,
                 "########################################", width - filled, "", done, tokens.size(),
                 seconds_since(t0));
  }
  if (progress) std::fprintf(stderr, "\n");
  return logits;
}

// One decode step: runs `token` at position cache.n with attention through `method`.
// `on_query(layer, q)` sees every layer's post-RoPE query row (for dumps).
template <class OnQuery>
matrix decode_step(const llama_model& model, int token, kv_cache& cache, decode_attention& method, floe::stats& io,
                   OnQuery&& on_query) {
  const auto attend = [&](int l, const matrix& q, const kv_cache& c, int pos, matrix& out) {
    on_query(l, q);
    method.decode(model.config(), l, q, c, pos, out, io);
  };
  const int one[1] = {token};
  return model.forward(std::span<const int>(one, 1), cache, attend);
}
inline matrix decode_step(const llama_model& model, int token, kv_cache& cache, decode_attention& method,
                          floe::stats& io) {
  return decode_step(model, token, cache, method, io, [](int, const matrix&) {});
}

// -log softmax(logits)[target], in double.
inline double negative_log_likelihood(const matrix& logits, int target) {
  const auto row = logits.row(0).cast<double>();
  const double m = row.maxCoeff();
  return m + std::log((row.array() - m).exp().sum()) - row(target);
}

inline int argmax(const matrix& logits) {
  Eigen::Index best;
  logits.row(0).maxCoeff(&best);
  return static_cast<int>(best);
}

}  // namespace smollm
