// The GGUF reader on small files the test writes itself.
#include <catch2/catch.hpp>

#include <random>

#include "gguf.hpp"
#include "gguf_builder.hpp"
#include "support/random_kv.hpp"

using smollm::gguf_file;
using smollm::ggml_type;
using smollm::testing::gguf_builder;

namespace {

std::vector<std::uint8_t> f32_bytes(const std::vector<float>& x) {
  std::vector<std::uint8_t> out(x.size() * 4);
  std::memcpy(out.data(), x.data(), out.size());
  return out;
}

gguf_builder sample(std::mt19937_64& g) {
  gguf_builder b;
  b.string("general.architecture", "llama")
      .u32("llama.block_count", 30)
      .i32("answer", -42)
      .i8("small", -7)
      .u64("big", 1ull << 40)
      .f32("llama.rope.freq_base", 100000.f)
      .f64("precise", 0.1)
      .boolean("flag", true)
      .strings("tokenizer.ggml.tokens", {"a", "b", "ab", ""})
      .ints("tokenizer.ggml.token_type", {1, 1, 1, 3});
  b.tensor("weights", {4, 3}, 0, f32_bytes(floe::testing::random_floats(g, 12)));
  b.tensor("q8", {64, 2}, 8, smollm::testing::encode_q8_0(floe::testing::random_floats(g, 128)));
  b.tensor("q4", {32}, 3, smollm::testing::encode_q4_1(floe::testing::random_floats(g, 32)));
  return b;
}

}  // namespace

TEST_CASE("gguf: metadata of every scalar type, arrays and tensor infos read back", "[smollm][gguf]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(1);
  const gguf_file f = gguf_file::parse(sample(g).bytes());
  CHECK(f.version() == 3);
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count") == 30);
  CHECK(f.get_int("answer") == -42);
  CHECK(f.get_int("small") == -7);
  CHECK(f.get_int("big") == (1ll << 40));
  CHECK(f.get_float("llama.rope.freq_base") == 100000.0);
  CHECK(f.get_float("precise") == 0.1);
  CHECK(f.get_float("llama.block_count") == 30.0);  // integers read as numbers too
  CHECK(f.get_int("flag") == 1);
  CHECK(f.at("tokenizer.ggml.tokens").is_array);
  CHECK(f.at("tokenizer.ggml.tokens").strings == std::vector<std::string>{"a", "b", "ab", ""});
  CHECK(f.at("tokenizer.ggml.token_type").ints == std::vector<std::int64_t>{1, 1, 1, 3});

  REQUIRE(f.tensors().size() == 3);
  const auto& w = f.tensor("weights");
  CHECK(w.dims == std::vector<std::uint64_t>{4, 3});
  CHECK(w.type == ggml_type::f32);
  CHECK(w.rows() == 3);
  CHECK(w.bytes == 48);
  CHECK(f.tensor("q8").bytes == 2 * 2 * 34);
  CHECK(f.tensor("q4").bytes == 20);
  CHECK(f.tensor("q8").offset % 32 == 0);
  CHECK(f.find_tensor("nope") == nullptr);
}

TEST_CASE("gguf: tensor data comes back bit for bit, at any alignment", "[smollm][gguf]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(2);
  for (std::uint64_t alignment : {32u, 64u, 8u}) {
    gguf_builder b;
    b.alignment = alignment;
    if (alignment != 32) b.u32("general.alignment", static_cast<std::uint32_t>(alignment));
    const auto a = floe::testing::random_floats(g, 7), c = floe::testing::random_floats(g, 5);
    b.tensor("a", {7}, 0, f32_bytes(a)).tensor("c", {5}, 0, f32_bytes(c));
    const gguf_file f = gguf_file::parse(b.bytes());
    CHECK(f.dequantize(f.tensor("a")) == a);
    CHECK(f.dequantize(f.tensor("c")) == c);
    CHECK(f.tensor("c").offset % alignment == 0);
  }
}

TEST_CASE("gguf: every truncation of a valid file is rejected, never read past the end", "[smollm][gguf]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(3);
  const auto bytes = sample(g).bytes();
  REQUIRE_NOTHROW(gguf_file::parse(bytes));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    INFO("prefix of " << n << " bytes");
    CHECK_THROWS_AS(gguf_file::parse(std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + n)),
                    floe::invalid_argument);
  }
}

TEST_CASE("gguf: malformed headers get clear errors", "[smollm][gguf]") {
  INFO("seed " << floe::testing::seed());
  auto bad = [](std::vector<std::uint8_t> bytes, const std::string& needle) {
    try {
      gguf_file::parse(std::move(bytes));
      FAIL("no error; expected one mentioning '" << needle << "'");
    } catch (const floe::invalid_argument& e) {
      INFO(e.what());
      CHECK(e.argument() == "gguf");
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  auto good = gguf_builder().u32("x", 1).bytes();
  auto wrong_magic = good;
  wrong_magic[0] = 'X';
  bad(wrong_magic, "magic");

  gguf_builder v1;
  v1.version = 1;
  bad(v1.bytes(), "version 1");

  std::vector<std::uint8_t> unaligned_cfg = gguf_builder().u32("general.alignment", 24).bytes();
  bad(unaligned_cfg, "power of two");

  bad(gguf_builder().tensor("t", {33}, 8, std::vector<std::uint8_t>(34)).bytes(), "multiple of the block size");
  bad(gguf_builder().tensor("t", {4}, 99, std::vector<std::uint8_t>(16)).bytes(), "unknown ggml type 99");
  bad(gguf_builder().tensor("t", {8}, 0, std::vector<std::uint8_t>(16)).bytes(), "runs past the end");
  bad(gguf_builder().tensor("t", {1, 1, 1, 1, 1}, 0, std::vector<std::uint8_t>(4)).bytes(), "5 dimensions");

  // A value type that does not exist.
  std::vector<std::uint8_t> odd;
  gguf_builder::put(odd, std::uint32_t{0x46554747u});
  gguf_builder::put(odd, std::uint32_t{3});
  gguf_builder::put(odd, std::uint64_t{0});
  gguf_builder::put(odd, std::uint64_t{1});
  gguf_builder::put_string(odd, "key");
  gguf_builder::put(odd, std::uint32_t{77});
  bad(odd, "unknown value type 77");

  // An array claiming more elements than the file holds.
  std::vector<std::uint8_t> huge;
  gguf_builder::put(huge, std::uint32_t{0x46554747u});
  gguf_builder::put(huge, std::uint32_t{3});
  gguf_builder::put(huge, std::uint64_t{0});
  gguf_builder::put(huge, std::uint64_t{1});
  gguf_builder::put_string(huge, "arr");
  gguf_builder::put(huge, std::uint32_t{9});
  gguf_builder::put(huge, std::uint32_t{4});
  gguf_builder::put(huge, std::uint64_t{1} << 60);
  bad(huge, "does not fit");
}

TEST_CASE("gguf: typed accessors name the key that is missing or of the wrong kind", "[smollm][gguf]") {
  INFO("seed " << floe::testing::seed());
  const gguf_file f = gguf_file::parse(gguf_builder().string("s", "text").u32("n", 3).strings("a", {"x"}).bytes());
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const floe::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([&] { f.get_int("missing"); }).find("'missing' is missing") != std::string::npos);
  CHECK(message([&] { f.get_int("s"); }).find("'s' is not an integer") != std::string::npos);
  CHECK(message([&] { f.get_string("n"); }).find("'n' is not a string") != std::string::npos);
  CHECK(message([&] { f.get_float("a"); }).find("'a' is not a number") != std::string::npos);
  CHECK(message([&] { f.tensor("w"); }).find("tensor 'w' is missing") != std::string::npos);
}
