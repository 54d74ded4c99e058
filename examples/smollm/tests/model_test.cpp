// The forward pass on a tiny random Llama the test writes as GGUF: decode steps through
// floe agree with the Eigen prefill, and RoPE depends only on relative position.
#include <catch2/catch.hpp>

#include <random>

#include "gguf_builder.hpp"
#include "methods.hpp"
#include "run.hpp"
#include "support/random_kv.hpp"

using namespace smollm;

namespace {

constexpr int layers = 2, width = 32, heads = 4, kv_heads = 2, ff = 48, vocab = 40;

std::vector<std::uint8_t> f32_bytes(const std::vector<float>& x) {
  std::vector<std::uint8_t> out(x.size() * 4);
  std::memcpy(out.data(), x.data(), out.size());
  return out;
}

std::vector<std::uint8_t> tiny_llama(std::mt19937_64& g, const std::string& arch = "llama") {
  testing::gguf_builder b;
  b.string("general.architecture", arch)
      .u32("llama.block_count", layers)
      .u32("llama.context_length", 64)
      .u32("llama.embedding_length", width)
      .u32("llama.feed_forward_length", ff)
      .u32("llama.attention.head_count", heads)
      .u32("llama.attention.head_count_kv", kv_heads)
      .f32("llama.rope.freq_base", 10000.f)
      .f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  auto weight = [&](const std::string& name, int rows, int cols, float sigma) {
    b.tensor(name, {static_cast<std::uint64_t>(cols), static_cast<std::uint64_t>(rows)}, 0,
             f32_bytes(floe::testing::random_floats(g, static_cast<std::size_t>(rows * cols), sigma)));
  };
  auto ones = [&](const std::string& name) {
    b.tensor(name, {width}, 0, f32_bytes(std::vector<float>(width, 1.f)));
  };
  // The embedding in Q8_0, as the real model has it.
  b.tensor("token_embd.weight", {width, vocab}, 8,
           testing::encode_q8_0(floe::testing::random_floats(g, vocab * width, 1.f)));
  ones("output_norm.weight");
  const int kv = kv_heads * width / heads;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    ones(p + "attn_norm.weight");
    ones(p + "ffn_norm.weight");
    weight(p + "attn_q.weight", width, width, 0.4f);
    weight(p + "attn_k.weight", kv, width, 0.4f);
    weight(p + "attn_v.weight", kv, width, 0.3f);
    weight(p + "attn_output.weight", width, width, 0.2f);
    weight(p + "ffn_gate.weight", ff, width, 0.2f);
    weight(p + "ffn_up.weight", ff, width, 0.2f);
    weight(p + "ffn_down.weight", width, ff, 0.2f);
  }
  return b.bytes();
}

double max_relative_difference(const matrix& a, const matrix& b) {
  double worst = 0;
  for (Eigen::Index t = 0; t < a.rows(); ++t)
    worst = std::max(worst, static_cast<double>((a.row(t) - b.row(t)).cwiseAbs().maxCoeff() /
                                                b.row(t).cwiseAbs().maxCoeff()));
  return worst;
}

}  // namespace

TEST_CASE("model: decode steps through floe reproduce the prefill logits", "[smollm][model]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(30);
  const gguf_file f = gguf_file::parse(tiny_llama(g));
  const llama_model model(f);
  CHECK(model.config().head_dim == width / heads);
  CHECK(model.config().group() == 2);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  std::vector<int> ids(20);
  for (int& id : ids) id = token(g);

  kv_cache all(model.config(), 20);
  const matrix reference = prefill(model, ids, all, /*all_logits=*/true, /*chunk=*/7, /*progress=*/false);
  REQUIRE(reference.rows() == 20);
  REQUIRE(reference.cols() == vocab);

  // Dense through floe must agree; a sparse method must read only its budget.
  const std::pair<const char*, const char*> runs[] = {{"dense", "scalar"}, {"dense", "simd"}, {"streaming", "simd"}};
  for (const auto& [name, exec] : runs) {
    INFO(name << " on " << exec);
    kv_cache cache(model.config(), 20);
    matrix stepped(20, vocab);
    stepped.topRows(3) = prefill(model, std::span<const int>(ids.data(), 3), cache, true, 256, false);
    auto method = make_attention(name, 1.0, exec);  // streaming: the 3 prefill tokens' worth
    method->build(model.config(), cache);
    floe::stats io;
    for (int t = 3; t < 20; ++t) stepped.row(t) = decode_step(model, ids[static_cast<std::size_t>(t)], cache, *method, io);
    const std::uint64_t heads = layers * kv_heads;
    CHECK(io.tokens_total == heads * (4 + 20) * 17 / 2);  // n = 4 .. 20 over the 17 steps
    if (std::string(name) == "dense") {
      CHECK(max_relative_difference(stepped, reference) < 1e-5);
      CHECK(io.tokens_read == io.tokens_total);
    } else {
      CHECK(io.tokens_read == heads * 17 * 3);
      CHECK(max_relative_difference(stepped.topRows(3), reference.topRows(3)) < 1e-5);
    }
  }
}

TEST_CASE("model: RoPE keeps norms and makes scores depend on relative position only", "[smollm][model]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(31);
  const gguf_file f = gguf_file::parse(tiny_llama(g));
  const llama_model model(f);
  const auto q0 = floe::testing::random_floats(g, width), k0 = floe::testing::random_floats(g, width);
  auto rotated = [&](const std::vector<float>& x, int pos) {
    matrix m = Eigen::Map<const matrix>(x.data(), 1, width);
    model.rope(m, pos);
    return m;
  };
  CHECK(rotated(q0, 0).isApprox(Eigen::Map<const matrix>(q0.data(), 1, width)));
  CHECK(std::fabs(rotated(q0, 37).norm() - rotated(q0, 0).norm()) < 1e-4f * rotated(q0, 0).norm());
  const int hd = width / heads;
  for (int shift : {0, 5, 1000}) {
    INFO("shift " << shift);
    const matrix a = rotated(q0, 9 + shift), b = rotated(k0, 2 + shift), c = rotated(q0, 9), d = rotated(k0, 2);
    for (int h = 0; h < heads; ++h)
      CHECK(a.row(0).segment(h * hd, hd).dot(b.row(0).segment(h * hd, hd)) ==
            Approx(c.row(0).segment(h * hd, hd).dot(d.row(0).segment(h * hd, hd))).epsilon(1e-4).margin(1e-4));
  }
}

TEST_CASE("model: wrong architecture, shapes and budgets are rejected by name", "[smollm][model]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(32);
  CHECK_THROWS_AS(llama_model(gguf_file::parse(tiny_llama(g, "gpt2"))), floe::invalid_argument);
  const gguf_file f = gguf_file::parse(tiny_llama(g));
  const llama_model model(f);
  kv_cache cache(model.config(), 4);
  const std::vector<int> too_many(5, 1), bad_id{vocab};
  CHECK_THROWS_AS(prefill(model, too_many, cache, false, 256, false), floe::invalid_argument);
  CHECK_THROWS_AS(prefill(model, bad_id, cache, false, 256, false), floe::invalid_argument);
  try {
    make_attention("nonsense", 0.1);
    FAIL("an unknown method was accepted");
  } catch (const floe::invalid_argument& e) {
    CHECK(e.argument() == "attn");
    CHECK(std::string(e.what()).find("streaming") != std::string::npos);  // lists the known ones
  }
  CHECK_THROWS_AS(make_attention("streaming", 0.0), floe::invalid_argument);
  CHECK_THROWS_AS(make_attention("dense", 0.5, "cuda"), floe::invalid_argument);
}
