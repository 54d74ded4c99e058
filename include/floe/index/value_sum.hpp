// The sum of the value rows of a region of the cache (the middle between sink and tail
// window), in double, kept as tokens leave the tail window. With it, the mean value of
// the tokens a step did not read is the sum minus the rows it did read, over the count.
#pragma once

#include <cstdint>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/selection.hpp"

namespace floe {

class value_sum {
 public:
  value_sum() = default;

  // Sums region [b, e) of kv; append() later takes tokens up to n - window.
  template <KvView KV>
  static value_sum build(const KV& kv, token_range region, index_t window) {
    require(region.begin <= region.end && region.end <= kv.n(), "region", "[", region.begin, ", ", region.end,
            ") is not inside the cache of n = ", kv.n());
    value_sum s;
    s.window_ = window;
    s.dv_ = kv.dv();
    s.sum_.assign(kv.dv(), 0.0);
    s.region_ = {region.begin, region.begin};
    s.add_rows(kv, region.end);
    return s;
  }

  // Takes in the tokens that left the tail window since: [end, kv.n() - window).
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.dv() == dv_, "kv", "value sum built for dv = ", dv_, "; the view has dv = ", kv.dv());
    require_view_covers(kv.n(), region_.end, "the value sum");
    if (kv.n() > region_.end + window_) add_rows(kv, kv.n() - window_);
  }

  token_range region() const { return region_; }
  const std::vector<double>& sum() const { return sum_; }
  std::uint64_t bytes() const { return sum_.size() * sizeof(double); }

 private:
  template <KvView KV>
  void add_rows(const KV& kv, index_t end) {
    for (index_t i = region_.end; i < end; ++i) {
      const auto* v = kv.value_row(i);
      for (index_t j = 0; j < dv_; ++j) sum_[j] += static_cast<double>(to_float(v[j]));
    }
    region_.end = end;
  }

  index_t window_ = 0, dv_ = 0;
  token_range region_;
  std::vector<double> sum_;
};

}  // namespace floe
