// Storage types for 16-bit KV caches: IEEE binary16 (`half`) and bfloat16, with exact
// round-to-nearest-even conversion from float (GCC 12 has no std::float16_t).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "floe/core/config.hpp"

namespace floe {

namespace detail {
FLOE_HOST_DEVICE inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FLOE_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

// IEEE 754 binary16. Holds bits only; arithmetic happens in float.
struct half {
  std::uint16_t bits = 0;

  static FLOE_HOST_DEVICE half from_bits(std::uint16_t b) { half h; h.bits = b; return h; }

  // Round to nearest, ties to even; overflow gives ±inf, NaN stays NaN (quiet).
  static FLOE_HOST_DEVICE half from_float(float f) {
    const std::uint32_t x = detail::float_bits(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    std::uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return from_bits(static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu)));
    if (a >= 0x477ff000u) return from_bits(static_cast<std::uint16_t>(sign | 0x7c00u));  // >= 65520 rounds to inf
    if (a < 0x38800000u) {
      // Subnormal half: adding 0.5f puts the 2^-24 quantum at float's last bit, so the
      // float adder does the round-to-nearest-even for us.
      const float t = detail::bits_float(a) + 0.5f;
      return from_bits(static_cast<std::uint16_t>(sign | (detail::float_bits(t) - 0x3f000000u)));
    }
    const std::uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;  // rebias exponent (127 -> 15) and round
    return from_bits(static_cast<std::uint16_t>(sign | (a >> 13)));
  }

  FLOE_HOST_DEVICE float to_float() const {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t exp = (bits >> 10) & 0x1fu;
    const std::uint32_t mant = bits & 0x3ffu;
    if (exp == 0x1f) return detail::bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
      const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
      return sign ? -v : v;
    }
    return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

// bfloat16: the upper half of a float.
struct bfloat16 {
  std::uint16_t bits = 0;

  static FLOE_HOST_DEVICE bfloat16 from_bits(std::uint16_t b) { bfloat16 h; h.bits = b; return h; }

  static FLOE_HOST_DEVICE bfloat16 from_float(float f) {
    const std::uint32_t x = detail::float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return from_bits(static_cast<std::uint16_t>((x >> 16) | 0x40u));
    return from_bits(static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16));
  }

  FLOE_HOST_DEVICE float to_float() const { return detail::bits_float(static_cast<std::uint32_t>(bits) << 16); }
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

// The element types a KV cache may hold.
template <class T>
concept KvElement = std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <KvElement T>
FLOE_HOST_DEVICE inline float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return x.to_float();
}

template <KvElement T>
FLOE_HOST_DEVICE inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T::from_float(x);
}

template <KvElement T>
constexpr std::string_view element_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, half>) return "f16";
  else return "bf16";
}

}  // namespace floe
