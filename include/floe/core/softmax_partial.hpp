// Softmax partials (m, l, a): running max m, l = sum exp(z_i - m), a = sum exp(z_i - m) v_i.
// Merging is associative and commutative, stays finite at scores of +-1e4, and the
// empty set (l = 0) is its identity. See docs/overview.md, "softmax partials".
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/query.hpp"

namespace floe {

// Merges (m2, l2, a2) into (m, l, a) in place. Empty means !(l > 0).
template <class Acc>
FLOE_HOST_DEVICE inline void merge_partial(Acc& m, Acc& l, Acc* a, Acc m2, Acc l2, const Acc* a2, index_t dv) {
  if (!(l2 > Acc(0))) return;
  if (!(l > Acc(0))) {
    m = m2;
    l = l2;
    for (index_t j = 0; j < dv; ++j) a[j] = a2[j];
    return;
  }
  const Acc top = m > m2 ? m : m2;
  const Acc alpha = std::exp(m - top), beta = std::exp(m2 - top);
  l = l * alpha + l2 * beta;
  for (index_t j = 0; j < dv; ++j) a[j] = a[j] * alpha + a2[j] * beta;
  m = top;
}

// row = a / l; an empty partial (!(l > 0)) attends to nothing and yields zeros.
template <class Acc, class Out>
inline void write_normalized(const Acc* a, Acc l, index_t dv, Out* row) {
  if (!(l > Acc(0))) {
    for (index_t j = 0; j < dv; ++j) row[j] = Out(0);
    return;
  }
  for (index_t j = 0; j < dv; ++j) row[j] = static_cast<Out>(a[j] / l);
}

// One query head's partial, owning its accumulator.
template <class Acc>
struct softmax_partial {
  Acc m = -std::numeric_limits<Acc>::infinity();
  Acc l = 0;
  std::vector<Acc> a;

  explicit softmax_partial(index_t dv = 0) : a(dv, Acc(0)) {}

  bool empty() const { return !(l > Acc(0)); }

  // A residual estimate with log-mass lambda and mean value nu is the partial (lambda, 1, nu);
  // a mass of zero (lambda = -inf) is the empty partial.
  static softmax_partial from_log_mass(Acc log_mass, const Acc* mean_value, index_t dv) {
    softmax_partial p(dv);
    if (!(log_mass > -std::numeric_limits<Acc>::infinity())) return p;
    p.m = log_mass;
    p.l = Acc(1);
    for (index_t j = 0; j < dv; ++j) p.a[j] = mean_value[j];
    return p;
  }

  softmax_partial& merge(const softmax_partial& o) {
    require(o.a.size() == a.size(), "partial.dv", "merging partials of dv ", a.size(), " and ", o.a.size());
    merge_partial(m, l, a.data(), o.m, o.l, o.a.data(), a.size());
    return *this;
  }
  friend softmax_partial merged(softmax_partial p, const softmax_partial& q) { return p.merge(q); }

  // o = a / l; the empty set attends to nothing and yields zeros.
  template <class Out>
  void finalize(Out* out) const {
    write_normalized(a.data(), l, a.size(), out);
  }
};

// The partials of the g query heads of one GQA group, in flat storage.
template <class Acc>
class partial_set {
 public:
  using accumulator = Acc;

  partial_set(index_t heads, index_t dv)
      : heads_(heads), dv_(dv), m_(heads), l_(heads), a_(heads * dv) { reset(); }

  void reset() {
    std::fill(m_.begin(), m_.end(), -std::numeric_limits<Acc>::infinity());
    std::fill(l_.begin(), l_.end(), Acc(0));
    std::fill(a_.begin(), a_.end(), Acc(0));
  }

  index_t heads() const { return heads_; }
  index_t dv() const { return dv_; }
  Acc& m(index_t h) { return m_[h]; }
  Acc& l(index_t h) { return l_[h]; }
  Acc* a(index_t h) { return a_.data() + h * dv_; }
  Acc m(index_t h) const { return m_[h]; }
  Acc l(index_t h) const { return l_[h]; }
  const Acc* a(index_t h) const { return a_.data() + h * dv_; }
  bool empty(index_t h) const { return !(l_[h] > Acc(0)); }

  void merge(index_t h, Acc m2, Acc l2, const Acc* a2) { merge_partial(m_[h], l_[h], a(h), m2, l2, a2, dv_); }
  void merge(index_t h, const softmax_partial<Acc>& p) { merge(h, p.m, p.l, p.a.data()); }
  void merge(const partial_set& o) {
    for (index_t h = 0; h < heads_; ++h) merge(h, o.m(h), o.l(h), o.a(h));
  }

  softmax_partial<Acc> head(index_t h) const {
    softmax_partial<Acc> p(dv_);
    p.m = m_[h];
    p.l = l_[h];
    std::copy(a(h), a(h) + dv_, p.a.begin());
    return p;
  }

  // Writes a / l for every head (zeros for an empty head).
  template <class Out>
  void finalize(const output_group<Out>& out) const {
    for (index_t h = 0; h < heads_; ++h) write_normalized(a(h), l_[h], dv_, out.row(h));
  }

 private:
  index_t heads_, dv_;
  std::vector<Acc> m_, l_, a_;
};

}  // namespace floe
