// The scalar reference executor: plain loops, double accumulation. It is floe's
// unit-level numerical reference (docs/api.md, "accuracy of the reference").
#pragma once

#include <cmath>
#include <span>
#include <string_view>

#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/core/selection.hpp"
#include "floe/core/softmax_partial.hpp"

namespace floe::exec {

struct scalar {
  using accumulator = double;
  static constexpr std::string_view name = "scalar";
  // A call over a few hundred tokens costs little more than its reads (no launch, no
  // synchronize), so residuals may interleave their own reads with the exact part.
  static constexpr bool small_calls_cheap = true;

  // z_i = scale * q_h . k_i for the tokens of r, written to z[0 .. r.size()).
  template <KvView KV>
  void score(const KV& kv, const query_group& q, index_t head, token_range r, float* z) const {
    for (index_t i = r.begin; i < r.end; ++i) z[i - r.begin] = static_cast<float>(score_one(kv, q, head, i));
  }

  // z[h * ld + i - r.begin] = scale * q_h . k_i for every head h of the group and i in r.
  template <KvView KV>
  void score_group(const KV& kv, const query_group& q, token_range r, float* z, index_t ld) const {
    for (index_t h = 0; h < q.heads; ++h) score(kv, q, h, r, z + h * ld);
  }

  // Merges the exact partial over `ranges` of every query head of the group into out.
  template <KvView KV>
  void attend(const KV& kv, const query_group& q, std::span<const token_range> ranges, partial_set<double>& out) const {
    const index_t dv = kv.dv();
    partial_set<double> part(q.heads, dv);
    for (index_t h = 0; h < q.heads; ++h) {
      double m = -std::numeric_limits<double>::infinity(), l = 0.0;
      double* a = part.a(h);
      for (const token_range& r : ranges) {
        for (index_t i = r.begin; i < r.end; ++i) {
          const double z = score_one(kv, q, h, i);
          double w;
          if (z > m) {  // rescale what we have to the new maximum
            const double c = std::exp(m - z);
            l *= c;
            for (index_t j = 0; j < dv; ++j) a[j] *= c;
            m = z;
            w = 1.0;
          } else {
            w = std::exp(z - m);
          }
          l += w;
          const auto* v = kv.value_row(i);
          for (index_t j = 0; j < dv; ++j) a[j] += w * static_cast<double>(to_float(v[j]));
        }
      }
      part.m(h) = m;
      part.l(h) = l;
    }
    out.merge(part);
  }

 private:
  template <KvView KV>
  static double score_one(const KV& kv, const query_group& q, index_t head, index_t i) {
    const float* qr = q.row(head);
    const auto* k = kv.key_row(i);
    double dot = 0.0;
    for (index_t t = 0; t < kv.d(); ++t) dot += static_cast<double>(qr[t]) * static_cast<double>(to_float(k[t]));
    return static_cast<double>(q.scale) * dot;
  }
};

}  // namespace floe::exec
