// Per-page elementwise minimum and maximum of the keys of one (layer, KV head), as Quest
// keeps them: sum_t max(q_t min_t, q_t max_t) bounds every score in the page.
// Stored in half, rounded outwards, so the bound holds for every element type.
// docs/methods/retrieval-completion.md, "page_bounds".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/core/kv_view.hpp"
#include "floe/core/query.hpp"
#include "floe/index/directed_half.hpp"

namespace floe {

class page_bounds_index {
 public:
  page_bounds_index() = default;

  template <KvView KV>
  static page_bounds_index build(const KV& kv, index_t page_size) {
    require(page_size > 0, "page_size", "must be positive");
    page_bounds_index idx;
    idx.page_ = page_size;
    idx.d_ = kv.d();
    idx.append(kv);
    return idx;
  }

  // Takes in tokens [tokens(), kv.n()): widens the last page, then opens new ones. A view
  // shorter than the index (a cache cut back) drops the pages from its last one on, which
  // is bounded again from the view's tokens: the index equals a build on the view.
  template <KvView KV>
  void append(const KV& kv) {
    require(kv.d() == d_, "kv", "index built for d = ", d_, ", the view has d = ", kv.d());
    if (kv.n() < n_) {
      const index_t keep = kv.n() / page_;
      lo_.resize(keep * d_);
      hi_.resize(keep * d_);
      n_ = keep * page_;
    }
    const index_t pages = (kv.n() + page_ - 1) / page_;
    lo_.resize(pages * d_, half::from_bits(0x7c00u));  // +inf: empty
    hi_.resize(pages * d_, half::from_bits(0xfc00u));  // -inf: empty
    for (index_t i = n_; i < kv.n(); ++i) {
      const auto* k = kv.key_row(i);
      half* lo = lo_.data() + (i / page_) * d_;
      half* hi = hi_.data() + (i / page_) * d_;
      for (index_t t = 0; t < d_; ++t) {
        const float x = to_float(k[t]);
        require(!std::isnan(x), "keys", "key ", i, " element ", t, " is NaN");
        if (x < lo[t].to_float()) lo[t] = detail::half_not_above(x);
        if (x > hi[t].to_float()) hi[t] = detail::half_not_below(x);
      }
    }
    n_ = kv.n();
  }

  index_t tokens() const { return n_; }
  index_t page_size() const { return page_; }
  index_t pages() const { return (n_ + page_ - 1) / page_; }
  index_t bytes_per_page() const { return 2 * d_ * sizeof(half); }
  std::uint64_t bytes() const { return static_cast<std::uint64_t>(pages()) * bytes_per_page(); }

  // An upper bound on s q_h . k for every key of page p.
  float upper_bound(const query_group& q, index_t h, index_t p) const {
    const float* qr = q.row(h);
    const half* lo = lo_.data() + p * d_;
    const half* hi = hi_.data() + p * d_;
    double bound = 0.0, magnitude = 0.0;
    for (index_t t = 0; t < d_; ++t) {
      if (qr[t] == 0.f) continue;  // 0 * inf would be NaN
      const double a = static_cast<double>(qr[t]) * lo[t].to_float(), b = static_cast<double>(qr[t]) * hi[t].to_float();
      bound += std::max(a, b);
      magnitude += std::max(std::fabs(a), std::fabs(b));
    }
    // Raised past the float rounding of any executor's exact score.
    return static_cast<float>(static_cast<double>(q.scale) * (bound + 1e-5 * magnitude));
  }

 private:
  index_t n_ = 0, d_ = 0, page_ = 16;
  std::vector<half> lo_, hi_;  // [pages, d]
};

}  // namespace floe
