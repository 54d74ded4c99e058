// The dequantisers against the block formulas, on blocks the test encodes itself.
#include <catch2/catch.hpp>

#include <cmath>

#include "gguf_builder.hpp"
#include "quant.hpp"
#include "support/random_kv.hpp"

using smollm::dequantize_row;
using smollm::ggml_type;
using namespace smollm::testing;

namespace {
float half_at(const std::vector<std::uint8_t>& b, std::size_t at) {
  std::uint16_t bits;
  std::memcpy(&bits, b.data() + at, 2);
  return floe::half::from_bits(bits).to_float();
}
std::vector<float> dequantize(ggml_type t, const std::vector<std::uint8_t>& bytes, std::size_t n) {
  std::vector<float> out(n);
  dequantize_row(t, bytes, out.data(), n, "test");
  return out;
}
}  // namespace

TEST_CASE("quant: Q8_0 is d * q per block of 32, within d/2 of the input", "[smollm][quant]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(10);
  const std::size_t n = 32 * 9;
  const auto x = floe::testing::random_floats(g, n, 3.f);
  const auto bytes = encode_q8_0(x);
  REQUIRE(bytes.size() == 9 * 34);
  const auto y = dequantize(ggml_type::q8_0, bytes, n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / 32;
    const float d = half_at(bytes, 34 * b);
    const auto q = static_cast<std::int8_t>(bytes[34 * b + 2 + i % 32]);
    INFO("element " << i);
    CHECK(y[i] == d * static_cast<float>(q));
    CHECK(std::fabs(y[i] - x[i]) <= 0.5f * d * 1.01f + 1e-6f);
  }
}

TEST_CASE("quant: Q4_1 is d * nibble + m, low nibbles first, within d/2 of the input", "[smollm][quant]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(11);
  const std::size_t n = 32 * 7;
  const auto x = floe::testing::random_floats(g, n, 2.f);
  const auto bytes = encode_q4_1(x);
  REQUIRE(bytes.size() == 7 * 20);
  const auto y = dequantize(ggml_type::q4_1, bytes, n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / 32, j = i % 32;
    const float d = half_at(bytes, 20 * b), m = half_at(bytes, 20 * b + 2);
    const std::uint8_t byte = bytes[20 * b + 4 + j % 16];
    const int q = j < 16 ? (byte & 15) : (byte >> 4);
    INFO("element " << i);
    CHECK(y[i] == d * static_cast<float>(q) + m);
    // f16 rounding of m and d moves the grid by a little more than d/2 at the ends.
    CHECK(std::fabs(y[i] - x[i]) <= 0.5f * d + 16 * std::fabs(d) * 1e-3f + std::fabs(m) * 1e-3f + 1e-6f);
  }
}

TEST_CASE("quant: a hand-made Q4_1 block and Q8_0 block", "[smollm][quant]") {
  INFO("seed " << floe::testing::seed());
  std::vector<std::uint8_t> q41;
  put_half(q41, 0.5f);   // d
  put_half(q41, -2.f);   // m
  for (int j = 0; j < 16; ++j) q41.push_back(static_cast<std::uint8_t>(j | ((15 - j) << 4)));
  const auto y = dequantize(ggml_type::q4_1, q41, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[static_cast<std::size_t>(j)] == 0.5f * static_cast<float>(j) - 2.f);
    CHECK(y[static_cast<std::size_t>(j + 16)] == 0.5f * static_cast<float>(15 - j) - 2.f);
  }
  std::vector<std::uint8_t> q80;
  put_half(q80, 0.25f);
  for (int j = 0; j < 32; ++j) q80.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(j - 16)));
  const auto z = dequantize(ggml_type::q8_0, q80, 32);
  for (int j = 0; j < 32; ++j) CHECK(z[static_cast<std::size_t>(j)] == 0.25f * static_cast<float>(j - 16));
}

TEST_CASE("quant: F32, F16 and BF16 rows", "[smollm][quant]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(12);
  const auto x = floe::testing::random_floats(g, 17);
  std::vector<std::uint8_t> f32(x.size() * 4), f16, bf16;
  std::memcpy(f32.data(), x.data(), f32.size());
  for (float v : x) {
    put_half(f16, v);
    gguf_builder::put(bf16, floe::bfloat16::from_float(v).bits);
  }
  CHECK(dequantize(ggml_type::f32, f32, x.size()) == x);
  const auto h = dequantize(ggml_type::f16, f16, x.size());
  const auto b = dequantize(ggml_type::bf16, bf16, x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    CHECK(h[i] == half_round(x[i]));
    CHECK(b[i] == floe::bfloat16::from_float(x[i]).to_float());
  }
}

TEST_CASE("quant: other types and wrong sizes are rejected by name", "[smollm][quant]") {
  INFO("seed " << floe::testing::seed());
  std::vector<float> out(256);
  try {
    dequantize_row(ggml_type::q4_k, std::vector<std::uint8_t>(144), out.data(), 256, "blk.0.ffn_up.weight");
    FAIL("Q4_K was dequantised");
  } catch (const floe::invalid_argument& e) {
    CHECK(std::string(e.what()).find("Q4_K") != std::string::npos);
    CHECK(std::string(e.what()).find("blk.0.ffn_up.weight") != std::string::npos);
  }
  CHECK_THROWS_AS(dequantize_row(ggml_type::q8_0, std::vector<std::uint8_t>(33), out.data(), 32, "t"),
                  floe::invalid_argument);
  CHECK_THROWS_AS(dequantize_row(ggml_type::q4_1, std::vector<std::uint8_t>(20), out.data(), 31, "t"),
                  floe::invalid_argument);
  CHECK_THROWS_AS(smollm::tensor_bytes(static_cast<ggml_type>(5), 32, 1, "t"), floe::invalid_argument);
  CHECK(smollm::tensor_bytes(ggml_type::q4_1, 576, 192, "t") == 192 * 360);
  CHECK(smollm::tensor_bytes(ggml_type::q8_0, 576, 49152, "t") == 49152ull * 612);
}
