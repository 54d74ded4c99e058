// Exact scores of scattered tokens for every head of a GQA group: each key row is widened
// once and dotted with all g scaled queries (the re-rank of quantized_scan, the candidates
// of exp_threshold).
#pragma once

#include <cstdint>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/index/widen.hpp"

namespace floe::select::ranking {

// z[h * ld + j] = s q_h . k_{tokens[j]} for j < count. Returns the key bytes read.
template <KvView KV>
std::uint64_t gathered_scores(const KV& kv, const query_group& q, const index_t* tokens, index_t count, float* z,
                              index_t ld) {
  using lanes = xsimd::batch<float>;
  constexpr index_t L = lanes::size;
  const index_t d = kv.d(), padded = (d + L - 1) / L * L;
  thread_local std::vector<float> queries, row;
  queries.assign(q.heads * padded, 0.f);
  row.assign(padded, 0.f);
  for (index_t h = 0; h < q.heads; ++h)
    for (index_t t = 0; t < d; ++t) queries[h * padded + t] = q.scale * q.row(h)[t];
  constexpr index_t ahead = 8;  // rows in flight: the gather is latency-bound
  for (index_t j = 0; j < count; ++j) {
    if (j + ahead < count) floe::detail::prefetch_row(kv.key_row(tokens[j + ahead]), d);
    floe::detail::widen(kv.key_row(tokens[j]), row.data(), d);
    for (index_t h = 0; h < q.heads; ++h) {
      lanes acc(0.f);
      for (index_t t = 0; t < padded; t += L)
        acc = xsimd::fma(lanes::load_unaligned(queries.data() + h * padded + t), lanes::load_unaligned(row.data() + t), acc);
      z[h * ld + j] = xsimd::hadd(acc);
    }
  }
  return static_cast<std::uint64_t>(count) * d * sizeof(typename KV::element_type);
}

}  // namespace floe::select::ranking
