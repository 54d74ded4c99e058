// The decode-step inputs and outputs of one KV head: the g query heads of its GQA group
// and the g output rows they produce.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"

namespace floe {

// g query rows of length d (row stride `stride`), scores scaled by `scale`.
struct query_group {
  const float* data = nullptr;
  index_t heads = 1;   // g: query heads sharing this KV head
  index_t d = 0;
  index_t stride = 0;  // elements between query rows; 0 means d
  float scale = 0.f;   // must be > 0; make() sets the usual 1/sqrt(d)

  static query_group make(const float* data, index_t heads, index_t d, index_t stride = 0) {
    return {data, heads, d, stride, 1.f / std::sqrt(static_cast<float>(d ? d : 1))};
  }
  const float* row(index_t h) const { return data + h * row_stride(); }
  index_t row_stride() const { return stride ? stride : d; }
};

// g output rows of length dv.
template <class Out>
struct output_group {
  Out* data = nullptr;
  index_t heads = 1;
  index_t dv = 0;
  index_t stride = 0;  // 0 means dv

  Out* row(index_t h) const { return data + h * (stride ? stride : dv); }
};

// Checks a query group against a KV head of key dimension d: throws before anything is
// written, naming the argument.
inline void validate_query(const query_group& q, index_t kv_d) {
  require(q.data != nullptr, "query", "null pointer");
  require(q.heads > 0, "query.heads", "must be at least 1");
  require(q.d == kv_d, "query.d", "query dimension ", q.d, " does not match the key dimension d = ", kv_d);
  require(q.stride == 0 || q.stride >= q.d, "query.stride", "stride ", q.stride, " is smaller than d = ", q.d);
  require(std::isfinite(q.scale) && q.scale > 0.f, "scale", "must be finite and positive, got ", q.scale);
  for (index_t h = 0; h < q.heads; ++h) {
    // NaN and Inf are the floats whose exponent bits are all set: one branch-free pass per
    // row (an integer count, which vectorises), and the element named only when there is one.
    const float* row = q.row(h);
    const auto is_non_finite = [](float x) -> std::uint32_t {
      return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) == 0x7f800000u;
    };
    std::uint32_t non_finite = 0;
    index_t t = 0;
    for (; t + 8 <= q.d; t += 8)  // fixed blocks of 8 vectorise at -O2 too
      for (index_t i = 0; i < 8; ++i) non_finite += is_non_finite(row[t + i]);
    for (; t < q.d; ++t) non_finite += is_non_finite(row[t]);
    if (non_finite == 0) continue;
    for (index_t t = 0; t < q.d; ++t)
      require(std::isfinite(row[t]), "query", "element [", h, ", ", t, "] is ", row[t], " (NaN or Inf)");
  }
}

template <class Out>
void validate_output(const output_group<Out>& out, index_t heads, index_t kv_dv) {
  require(out.data != nullptr, "output", "null pointer");
  require(out.heads == heads, "output.heads", out.heads, " output rows for ", heads, " query heads");
  require(out.dv == kv_dv, "output.dv", "output dimension ", out.dv, " does not match the value dimension dv = ", kv_dv);
  require(out.stride == 0 || out.stride >= out.dv, "output.stride", "stride ", out.stride, " is smaller than dv = ", out.dv);
}

}  // namespace floe
