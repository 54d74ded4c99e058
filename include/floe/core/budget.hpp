// How many tokens a selector may read exactly: a count, a fraction of n, or an estimated
// attention mass (top-p) with floor and cap.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"

namespace floe {

struct budget {
  enum class unit { tokens, fraction, mass };
  unit kind = unit::fraction;
  double value = 1.0;
  index_t floor = 0;                                      // mass budgets: at least this many tokens
  index_t cap = std::numeric_limits<index_t>::max();      // mass budgets: at most this many

  static budget tokens(index_t k) { return {unit::tokens, static_cast<double>(k)}; }
  static budget fraction(double f) { return {unit::fraction, f}; }
  static budget top_p(double p, index_t floor = 0, index_t cap = std::numeric_limits<index_t>::max()) {
    return {unit::mass, p, floor, cap};
  }

  // The token count for a cache of n tokens (for mass budgets: the cap, clamped to n).
  index_t resolve(index_t n) const {
    switch (kind) {
      case unit::tokens:
        require(value <= static_cast<double>(n), "budget", "asks for ", static_cast<index_t>(value),
                " tokens of a cache of n = ", n);
        return static_cast<index_t>(value);
      case unit::fraction:
        require(std::isfinite(value) && value >= 0.0 && value <= 1.0, "budget",
                "fraction must lie in [0, 1], got ", value);
        return std::min<index_t>(n, static_cast<index_t>(std::ceil(value * static_cast<double>(n))));
      case unit::mass:
        require(std::isfinite(value) && value > 0.0 && value <= 1.0, "budget",
                "top-p mass must lie in (0, 1], got ", value);
        require(floor <= cap, "budget", "floor ", floor, " exceeds cap ", cap);
        return std::min(n, cap);
    }
    return n;
  }
};

}  // namespace floe
