// Directed rounding of float to binary16: the largest half not above x, the smallest not
// below x. Summaries stored in half keep their bounds valid (a stored minimum never
// exceeds the true one, a stored maximum never falls short of it).
#pragma once

#include <cmath>
#include <cstdint>

#include "floe/core/numeric_types.hpp"

namespace floe::detail {

// The neighbouring half towards -inf (towards +inf when `up`), for finite h.
inline half half_step(half h, bool up) {
  const bool negative = (h.bits & 0x8000u) != 0;
  const std::uint16_t magnitude = h.bits & 0x7fffu;
  if (magnitude == 0) return half::from_bits(up ? 0x0001u : 0x8001u);  // +-0 -> smallest subnormal
  const bool grow = up != negative;  // moving away from zero
  return half::from_bits(static_cast<std::uint16_t>(grow ? h.bits + 1 : h.bits - 1));
}

inline half half_not_above(float x) {
  const half h = half::from_float(x);
  if (!(h.to_float() > x)) return h;
  return std::isinf(h.to_float()) ? half::from_bits(0x7bffu) : half_step(h, false);  // +inf -> 65504
}

inline half half_not_below(float x) {
  const half h = half::from_float(x);
  if (!(h.to_float() < x)) return h;
  return std::isinf(h.to_float()) ? half::from_bits(0xfbffu) : half_step(h, true);  // -inf -> -65504
}

}  // namespace floe::detail
