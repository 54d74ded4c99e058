// What one call read: every accuracy claim in floe is made at equal bytes read.
#pragma once

#include <cstdint>
#include <limits>

namespace floe {

struct stats {
  std::uint64_t tokens_total = 0;   // tokens in the cache (per KV head summed over heads)
  std::uint64_t tokens_read = 0;    // tokens attended exactly
  std::uint64_t key_bytes = 0;      // key bytes read: exact part plus any scan of keys
  std::uint64_t value_bytes = 0;    // value bytes read
  std::uint64_t summary_bytes = 0;  // index/summary bytes read (centroids, 4-bit keys, ...)
  std::uint64_t index_bytes = 0;    // memory held by the index (not per call reads)
  // Upper bound on the relative error of the output, for methods that certify one.
  double certificate = std::numeric_limits<double>::quiet_NaN();

  std::uint64_t bytes_read() const { return key_bytes + value_bytes + summary_bytes; }

  stats& operator+=(const stats& o) {
    tokens_total += o.tokens_total;
    tokens_read += o.tokens_read;
    key_bytes += o.key_bytes;
    value_bytes += o.value_bytes;
    summary_bytes += o.summary_bytes;
    index_bytes += o.index_bytes;
    if (o.certificate == o.certificate)
      certificate = certificate == certificate && certificate > o.certificate ? certificate : o.certificate;
    return *this;
  }
};

}  // namespace floe
