// A decode step over a batch of sequences of different lengths with GQA: Hq = g * Hkv
// query heads, query head h reads KV head h / g.
#pragma once

#include <span>
#include <vector>

#include "floe/core/concepts.hpp"
#include "floe/exec/parallel.hpp"

namespace floe {

struct gqa_shape {
  index_t q_heads = 1;
  index_t kv_heads = 1;
  index_t group() const { return q_heads / kv_heads; }
  void validate() const {
    require(kv_heads > 0, "kv_heads", "must be at least 1");
    require(q_heads > 0 && q_heads % kv_heads == 0, "q_heads", q_heads,
            " query heads are not a multiple of ", kv_heads, " KV heads");
  }
};

// One sequence of the batch: its Hkv KV heads, its Hq query rows and output rows.
template <KvView KV>
struct sequence {
  std::span<const KV> kv_heads;
  const float* queries = nullptr;  // [Hq, d]
  float* out = nullptr;            // [Hq, dv]
  index_t query_stride = 0;        // 0 means d
  index_t out_stride = 0;          // 0 means dv
};

// Runs `est` over every (sequence, KV head) of the batch. states[s * Hkv + h] is the
// state built for KV head h of sequence s. Every argument is validated before any output
// row is written.
template <class Est, KvView KV, Executor E>
stats decode_batch(const Est& est, std::span<const typename Est::state> states, std::span<const sequence<KV>> batch,
                   gqa_shape shape, float scale, const E& exec, const parallel_for_fn& parallel_for = serial_for) {
  shape.validate();
  require(states.size() == batch.size() * shape.kv_heads, "states", states.size(), " states for ",
          batch.size(), " sequences of ", shape.kv_heads, " KV heads");
  const index_t g = shape.group();
  auto group_of = [&](const sequence<KV>& s, index_t h) {
    const KV& kv = s.kv_heads[h];
    const index_t qs = s.query_stride ? s.query_stride : kv.d();
    const index_t os = s.out_stride ? s.out_stride : kv.dv();
    query_group q{s.queries + h * g * qs, g, kv.d(), qs, scale};
    output_group<float> o{s.out + h * g * os, g, kv.dv(), os};
    return std::pair{q, o};
  };
  for (const auto& s : batch) {
    require(s.kv_heads.size() == shape.kv_heads, "sequence.kv_heads", s.kv_heads.size(), " KV heads, expected ",
            shape.kv_heads);
    for (index_t h = 0; h < shape.kv_heads; ++h) {
      auto [q, o] = group_of(s, h);
      validate_query(q, s.kv_heads[h].d());
      validate_output(o, g, s.kv_heads[h].dv());
    }
  }
  std::vector<stats> per_task(states.size());
  parallel_for(states.size(), [&](index_t task) {
    const auto& s = batch[task / shape.kv_heads];
    const index_t h = task % shape.kv_heads;
    auto [q, o] = group_of(s, h);
    est.decode(states[task], s.kv_heads[h], q, exec, o, per_task[task]);
  });
  stats total;
  for (const auto& t : per_task) total += t;
  return total;
}

}  // namespace floe
