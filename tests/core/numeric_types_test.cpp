#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>

#include "floe/core/numeric_types.hpp"
#include "support/random_kv.hpp"

using floe::bfloat16;
using floe::half;

namespace {
// True when `got` is the representable value nearest to f, ties going to the even code.
template <class T>
bool is_nearest_even(float f, T got) {
  const double x = f;
  const double g = got.to_float();
  if (std::isinf(g)) {  // overflow: f must be at least half an ulp past the largest finite value
    const double max_finite = std::is_same_v<T, half> ? 65504.0 : 3.3895313892515355e38;
    const double half_ulp = std::is_same_v<T, half> ? 16.0 : std::ldexp(1.0, 127 - 8);
    return std::signbit(g) == std::signbit(x) && std::fabs(x) >= max_finite + half_ulp;
  }
  for (int step : {-1, 1}) {
    const std::uint16_t nb = static_cast<std::uint16_t>(got.bits + step);
    const double other = T::from_bits(nb).to_float();
    if (std::isnan(other) || std::isinf(other)) continue;
    if (((nb ^ got.bits) & 0x8000u) != 0) continue;  // crossed the sign: not a neighbour
    const double dg = std::fabs(g - x), doth = std::fabs(other - x);
    if (doth < dg) return false;
    if (doth == dg && (got.bits & 1u)) return false;
  }
  return true;
}
}  // namespace

TEST_CASE("half: every bit pattern round-trips through float", "[numeric]") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const half h = half::from_bits(static_cast<std::uint16_t>(b));
    const float f = h.to_float();
    const half back = half::from_float(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(back.to_float()));
    } else {
      INFO("bits " << b);
      REQUIRE(back.bits == h.bits);
    }
  }
}

TEST_CASE("bfloat16: every bit pattern round-trips through float", "[numeric]") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const bfloat16 h = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    const float f = h.to_float();
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bfloat16::from_float(f).to_float()));
    } else {
      INFO("bits " << b);
      REQUIRE(bfloat16::from_float(f).bits == h.bits);
    }
  }
}

TEST_CASE("half and bfloat16 round to nearest, ties to even", "[numeric]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(1);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = bits(g);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    // Also exercise the half range densely: rescale into [2^-26, 2^17).
    float fh = std::ldexp(std::fabs(f) / (std::fabs(f) + 1.f), static_cast<int>(u % 43) - 26);
    if (u & 1u) fh = -fh;
    INFO("f = " << f << " fh = " << fh);
    REQUIRE(is_nearest_even(f, bfloat16::from_float(f)));
    REQUIRE(is_nearest_even(fh, half::from_float(fh)));
  }
  // Exact ties: halfway between 1 and the next half (1 + 2^-11) goes to the even 1.0.
  REQUIRE(half::from_float(1.f + std::ldexp(1.f, -11)).bits == 0x3c00u);
  REQUIRE(half::from_float(1.f + 3 * std::ldexp(1.f, -11)).bits == 0x3c02u);
  REQUIRE(half::from_float(65520.f).bits == 0x7c00u);  // rounds to inf
  REQUIRE(half::from_float(65519.f).bits == 0x7bffu);
  REQUIRE(half::from_float(std::ldexp(1.f, -25)).bits == 0x0000u);  // tie to even zero
  REQUIRE(half::from_float(std::ldexp(1.5f, -25)).bits == 0x0001u);
  REQUIRE(bfloat16::from_float(1.f + std::ldexp(1.f, -8)).bits == 0x3f80u);
}
