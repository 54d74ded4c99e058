// The scalar reference against a naive two-pass softmax in long double.
#include <catch2/catch.hpp>
#include <cmath>

#include "floe/exec/scalar.hpp"
#include "support/random_kv.hpp"

namespace {
// Two passes: max score, then weights; everything in long double.
template <floe::KvView KV>
std::vector<long double> naive_attention(const KV& kv, const float* q, float scale) {
  const std::size_t n = kv.n(), d = kv.d(), dv = kv.dv();
  std::vector<long double> z(n);
  for (std::size_t i = 0; i < n; ++i) {
    long double dot = 0;
    for (std::size_t t = 0; t < d; ++t) dot += static_cast<long double>(q[t]) * floe::to_float(kv.key_row(i)[t]);
    z[i] = static_cast<long double>(scale) * dot;
  }
  const long double m = *std::max_element(z.begin(), z.end());
  long double l = 0;
  std::vector<long double> o(dv, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const long double w = std::exp(z[i] - m);
    l += w;
    for (std::size_t j = 0; j < dv; ++j) o[j] += w * floe::to_float(kv.value_row(i)[j]);
  }
  for (auto& x : o) x /= l;
  return o;
}

template <floe::KvView KV>
double reference_error(const KV& kv, std::mt19937_64& g, std::size_t heads, float key_scale) {
  const auto q = floe::testing::random_floats(g, heads * kv.d(), key_scale);
  const auto group = floe::query_group::make(q.data(), heads, kv.d());
  floe::partial_set<double> parts(heads, kv.dv());
  const floe::token_range all{0, kv.n()};
  floe::exec::scalar{}.attend(kv, group, std::span(&all, 1), parts);
  std::vector<double> out(heads * kv.dv(), std::nan(""));
  parts.finalize(floe::output_group<double>{out.data(), heads, kv.dv(), 0});
  double worst = 0;
  for (std::size_t h = 0; h < heads; ++h) {
    const auto want = naive_attention(kv, group.row(h), group.scale);
    long double num = 0, den = 0;
    for (std::size_t j = 0; j < kv.dv(); ++j) {
      const long double e = out[h * kv.dv() + j] - want[j];
      num += e * e;
      den += want[j] * want[j];
    }
    worst = std::max(worst, static_cast<double>(std::sqrt(num / den)));
  }
  return worst;
}

template <floe::KvElement T>
void check_type() {
  INFO("seed " << floe::testing::seed() << " type " << floe::element_name<T>());
  auto g = floe::testing::rng(21 + sizeof(T));
  struct shape {
    std::size_t n, d, dv, pad, block;
  };
  const shape shapes[] = {{1, 64, 64, 0, 0},    {7, 128, 128, 3, 0},    {1000, 256, 256, 0, 16},
                          {333, 64, 96, 5, 0},  {4099, 128, 128, 0, 256}, {100000, 64, 64, 0, 0}};
  for (const auto& s : shapes) {
    floe::testing::random_kv<T> data(g, s.n, s.d, s.dv, s.pad, s.block);
    INFO("n " << s.n << " d " << s.d << " dv " << s.dv << " pad " << s.pad << " block " << s.block);
    // Sharp (large query norm) and diffuse attention both.
    for (float qs : {0.5f, 4.f}) {
      const double err = data.paged() ? reference_error(data.paged_view(), g, 2, qs) : reference_error(data.view(), g, 2, qs);
      REQUIRE(err <= 1e-12);
    }
  }
}
}  // namespace

TEST_CASE("scalar reference equals a long-double two-pass softmax: float", "[reference]") { check_type<float>(); }
TEST_CASE("scalar reference equals a long-double two-pass softmax: half", "[reference]") { check_type<floe::half>(); }
TEST_CASE("scalar reference equals a long-double two-pass softmax: bfloat16", "[reference]") {
  check_type<floe::bfloat16>();
}

TEST_CASE("scalar reference over a selection equals attention over the selected tokens only", "[reference]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(29);
  floe::testing::random_kv<float> data(g, 500, 64, 64);
  const auto q = floe::testing::random_floats(g, 64);
  const auto group = floe::query_group::make(q.data(), 1, 64);
  const std::vector<floe::token_range> sel{{3, 10}, {100, 101}, {480, 500}};
  floe::partial_set<double> parts(1, 64);
  floe::exec::scalar{}.attend(data.view(), group, sel, parts);
  // The same tokens gathered into their own cache.
  std::vector<float> k, v;
  for (auto r : sel)
    for (std::size_t i = r.begin; i < r.end; ++i) {
      k.insert(k.end(), data.keys.begin() + i * 64, data.keys.begin() + (i + 1) * 64);
      v.insert(v.end(), data.values.begin() + i * 64, data.values.begin() + (i + 1) * 64);
    }
  const floe::kv_view<float> gathered(k.data(), v.data(), k.size() / 64, 64, 64);
  const auto want = naive_attention(gathered, q.data(), group.scale);
  std::vector<double> out(64);
  parts.finalize(floe::output_group<double>{out.data(), 1, 64, 0});
  for (std::size_t j = 0; j < 64; ++j) REQUIRE(out[j] == Approx(static_cast<double>(want[j])).epsilon(1e-12).margin(1e-14));
}
