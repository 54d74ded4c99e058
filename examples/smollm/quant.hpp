// ggml tensor types: their block geometry (so any GGUF file can be parsed) and the
// dequantisers this example needs: F32, F16, BF16, Q8_0 and Q4_1. Other types are
// parsed but rejected by name when their values are asked for.
// Block layouts from ggml's ggml-common.h: Q8_0 = {f16 d; i8 q[32]}, x = d*q;
// Q4_1 = {f16 d; f16 m; u8 q[16]}, x_j = d*(q[j] & 15) + m, x_{j+16} = d*(q[j] >> 4) + m.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "floe/core/error.hpp"
#include "floe/core/numeric_types.hpp"

namespace smollm {

enum class ggml_type : std::uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q8_1 = 9,
  q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, q8_k = 15,
  i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, bf16 = 30,
};

struct ggml_type_info {
  const char* name;
  std::uint32_t block;  // elements per block
  std::uint32_t bytes;  // bytes per block
};

// Geometry of a type, or nullptr for a type this reader does not know.
inline const ggml_type_info* type_info(ggml_type t) {
  static const ggml_type_info f32{"F32", 1, 4}, f16{"F16", 1, 2}, q4_0{"Q4_0", 32, 18}, q4_1{"Q4_1", 32, 20},
      q5_0{"Q5_0", 32, 22}, q5_1{"Q5_1", 32, 24}, q8_0{"Q8_0", 32, 34}, q8_1{"Q8_1", 32, 36},
      q2_k{"Q2_K", 256, 84}, q3_k{"Q3_K", 256, 110}, q4_k{"Q4_K", 256, 144}, q5_k{"Q5_K", 256, 176},
      q6_k{"Q6_K", 256, 210}, q8_k{"Q8_K", 256, 292}, i8{"I8", 1, 1}, i16{"I16", 1, 2}, i32{"I32", 1, 4},
      i64{"I64", 1, 8}, f64{"F64", 1, 8}, bf16{"BF16", 1, 2};
  switch (t) {
    case ggml_type::f32: return &f32;
    case ggml_type::f16: return &f16;
    case ggml_type::q4_0: return &q4_0;
    case ggml_type::q4_1: return &q4_1;
    case ggml_type::q5_0: return &q5_0;
    case ggml_type::q5_1: return &q5_1;
    case ggml_type::q8_0: return &q8_0;
    case ggml_type::q8_1: return &q8_1;
    case ggml_type::q2_k: return &q2_k;
    case ggml_type::q3_k: return &q3_k;
    case ggml_type::q4_k: return &q4_k;
    case ggml_type::q5_k: return &q5_k;
    case ggml_type::q6_k: return &q6_k;
    case ggml_type::q8_k: return &q8_k;
    case ggml_type::i8: return &i8;
    case ggml_type::i16: return &i16;
    case ggml_type::i32: return &i32;
    case ggml_type::i64: return &i64;
    case ggml_type::f64: return &f64;
    case ggml_type::bf16: return &bf16;
  }
  return nullptr;
}

// Bytes of `rows` rows of `row_length` elements; rows must hold whole blocks.
inline std::uint64_t tensor_bytes(ggml_type t, std::uint64_t row_length, std::uint64_t rows, const std::string& name) {
  const ggml_type_info* info = type_info(t);
  floe::require(info != nullptr, "gguf", "tensor '", name, "' has unknown ggml type ", static_cast<std::uint32_t>(t));
  floe::require(row_length % info->block == 0, "gguf", "tensor '", name, "' of type ", info->name, ": row length ",
                row_length, " is not a multiple of the block size ", info->block);
  const std::uint64_t row_bytes = row_length / info->block * info->bytes;
  floe::require(rows == 0 || row_bytes <= std::numeric_limits<std::uint64_t>::max() / rows, "gguf", "tensor '", name,
                "' is impossibly large");
  return row_bytes * rows;
}

namespace detail {
inline float f16_at(const std::uint8_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return floe::half::from_bits(bits).to_float();
}
}  // namespace detail

// Dequantises one row of n elements stored in `src` (exactly one row's bytes) into dst.
inline void dequantize_row(ggml_type t, std::span<const std::uint8_t> src, float* dst, std::uint64_t n,
                           const std::string& name) {
  const std::uint64_t expected = tensor_bytes(t, n, 1, name);
  floe::require(src.size() == expected, "gguf", "tensor '", name, "': row of ", src.size(), " bytes, ", expected,
                " expected");
  const std::uint8_t* p = src.data();
  switch (t) {
    case ggml_type::f32:
      std::memcpy(dst, p, n * sizeof(float));
      return;
    case ggml_type::f16:
      for (std::uint64_t i = 0; i < n; ++i) dst[i] = detail::f16_at(p + 2 * i);
      return;
    case ggml_type::bf16:
      for (std::uint64_t i = 0; i < n; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);
        dst[i] = floe::detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
      }
      return;
    case ggml_type::q8_0:
      for (std::uint64_t b = 0; b < n / 32; ++b, p += 34) {
        const float d = detail::f16_at(p);
        for (int j = 0; j < 32; ++j) dst[32 * b + j] = d * static_cast<float>(static_cast<std::int8_t>(p[2 + j]));
      }
      return;
    case ggml_type::q4_1:
      for (std::uint64_t b = 0; b < n / 32; ++b, p += 20) {
        const float d = detail::f16_at(p), m = detail::f16_at(p + 2);
        for (int j = 0; j < 16; ++j) {
          dst[32 * b + j] = d * static_cast<float>(p[4 + j] & 0x0F) + m;
          dst[32 * b + j + 16] = d * static_cast<float>(p[4 + j] >> 4) + m;
        }
      }
      return;
    default:
      floe::require(false, "gguf", "tensor '", name, "' has type ", type_info(t)->name,
                    ", which this example does not dequantise (F32, F16, BF16, Q8_0 and Q4_1 are supported)");
  }
}

}  // namespace smollm
