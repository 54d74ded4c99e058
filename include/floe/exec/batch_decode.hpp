// The batch entry points shared by the batch executors (exec::simd, exec::cuda): dense
// and gathered decode of a batch of sequences, over the executor's own
// run_batch(batch, shape, scale, ranges_of), where ranges_of(group, kv) gives the token
// ranges group s * Hkv + h attends to.
#pragma once

#include <span>
#include <vector>

#include "floe/core/batch.hpp"
#include "floe/core/concepts.hpp"

namespace floe::exec {

template <class Executor>
class batch_decoder {
 public:
  // Dense decode of a batch: every query head of every sequence attends to all its
  // tokens. Validates everything first.
  template <KvView KV>
  void decode(std::span<const sequence<KV>> batch, gqa_shape shape, float scale) const {
    self().run_batch(batch, shape, scale, [](index_t, const KV& kv) { return std::vector<token_range>{{0, kv.n()}}; });
  }

  // Gathered decode: group s * Hkv + h attends to exact[s * Hkv + h] only (sorted,
  // disjoint ranges; empty gives zeros).
  template <KvView KV>
  void decode_gathered(std::span<const sequence<KV>> batch, gqa_shape shape, float scale,
                       std::span<const std::vector<token_range>> exact) const {
    shape.validate();
    require(exact.size() == batch.size() * shape.kv_heads, "exact", exact.size(), " range lists for ",
            batch.size(), " sequences of ", shape.kv_heads, " KV heads");
    self().run_batch(batch, shape, scale, [&](index_t group, const KV&) { return exact[group]; });
  }

 private:
  const Executor& self() const { return static_cast<const Executor&>(*this); }
};

}  // namespace floe::exec
