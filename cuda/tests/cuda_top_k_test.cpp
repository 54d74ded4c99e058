// exec::cuda::group_top_k (the group's top k on the device) against the group's softmax
// weights computed in double on the host from the scalar reference's scores, on fresh
// random inputs: k distinct tokens, none lighter than a token left out (up to float
// rounding), ties to the lower index, and the oracle_topk estimator on it equal to its
// run on the scalar executor; bad input refused by name.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_support.hpp"
#include "support/argument_of.hpp"
#include "floe/exec/cuda.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/select/oracle_topk.hpp"

using floe::index_t;
using floe::token_range;
namespace ft = floe::testing;

namespace {

// w_i = sum_h softmax_h(z)_i, in double from the reference's scores.
template <class KV>
std::vector<double> reference_weights(const KV& ref, const floe::query_group& q) {
  const index_t n = ref.n();
  std::vector<double> w(n, 0.0);
  std::vector<float> z(n);
  for (index_t h = 0; h < q.heads; ++h) {
    floe::exec::scalar{}.score(ref, q, h, token_range{0, n}, z.data());
    const double top = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (float x : z) sum += std::exp(x - top);
    for (index_t i = 0; i < n; ++i) w[i] += std::exp(z[i] - top) / sum;
  }
  return w;
}

std::vector<index_t> indices_of(const floe::selection& sel, index_t n) {
  floe::validate_ranges(sel.ranges, n);  // ascending, disjoint, inside the cache
  std::vector<index_t> out;
  for (const auto& r : sel.ranges)
    for (index_t i = r.begin; i < r.end; ++i) out.push_back(i);
  return out;
}

// The device's choice is a top k of the reference weights: nothing left out weighs more
// than the lightest chosen token, beyond float rounding.
template <class KV>
void check_top_k(const KV& dev, const KV& ref, index_t heads, std::mt19937_64& g, const floe::exec::cuda& ex) {
  const index_t n = dev.n();
  const auto qd = ft::random_floats(g, heads * dev.d(), 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, dev.d());
  const auto w = reference_weights(ref, q);
  for (index_t k : {index_t{1}, std::max<index_t>(1, n / 20), n > 1 ? n - 1 : n, n}) {
    INFO("k " << k);
    floe::selection sel;
    ex.group_top_k(dev, q, k, sel);
    const auto chosen = indices_of(sel, n);
    REQUIRE(static_cast<index_t>(chosen.size()) == k);
    std::vector<char> in(n, 0);
    double lightest_in = 1e300, heaviest_out = 0.0;
    for (index_t i : chosen) in[i] = 1, lightest_in = std::min(lightest_in, w[i]);
    for (index_t i = 0; i < n; ++i)
      if (!in[i]) heaviest_out = std::max(heaviest_out, w[i]);
    REQUIRE(heaviest_out <= lightest_in * (1 + 1e-4) + 1e-30);
  }
}

template <class T>
void top_k_sweep(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::exec::cuda ex;
  const index_t dims[] = {64, 128, 256}, groups[] = {1, 4, 8, 12};
  index_t turn = 0;
  for (index_t n : {1, 2, 7, 1000, 4099, 70001}) {
    for (index_t d : dims) {
      const index_t heads = groups[turn % 4], pad = turn % 2 ? 3 : 0, block = turn % 3 == 1 ? 16 : 0;
      ++turn;
      INFO("n " << n << " d " << d << " g " << heads << " pad " << pad << " block " << block);
      const ft::random_kv<T> host(g, n, d, d, pad, block);
      const ft::cuda_kv<T> dev(host, ft::cuda_array<T>::device);
      if (block) check_top_k(dev.paged_view(), host.paged_view(), heads, g, ex);
      else check_top_k(dev.view(), host.view(), heads, g, ex);
    }
  }
}

}  // namespace

TEST_CASE("cuda group_top_k is a top k of the reference weights (float)", "[cuda]") { top_k_sweep<float>(31); }
TEST_CASE("cuda group_top_k is a top k of the reference weights (half)", "[cuda]") { top_k_sweep<floe::half>(32); }
TEST_CASE("cuda group_top_k is a top k of the reference weights (bfloat16)", "[cuda]") { top_k_sweep<floe::bfloat16>(33); }

TEST_CASE("cuda group_top_k gives ties to the lower index", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(34);
  const floe::exec::cuda ex;
  const index_t n = 5000, d = 128, heads = 4;
  ft::random_kv<floe::half> host(g, n, d, d);
  const auto qd = ft::random_floats(g, heads * d);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  // Every key the same: every weight equal, so the top k is [0, k).
  auto same = host;
  for (index_t i = 1; i < n; ++i) std::copy_n(same.keys.begin(), d, same.keys.begin() + i * d);
  {
    const ft::cuda_kv<floe::half> dev(same, ft::cuda_array<floe::half>::device);
    for (index_t k : {1, 77, 4999}) {
      floe::selection sel;
      ex.group_top_k(dev.view(), q, k, sel);
      REQUIRE(sel.ranges == std::vector<token_range>{{0, k}});
    }
  }
  // Keys in equal pairs (2i, 2i + 1): where a pair is split, the lower one is chosen.
  auto pairs = host;
  for (index_t i = 0; i + 1 < n; i += 2) std::copy_n(pairs.keys.begin() + i * d, d, pairs.keys.begin() + (i + 1) * d);
  const ft::cuda_kv<floe::half> dev(pairs, ft::cuda_array<floe::half>::device);
  for (index_t k : {1, 251, 2501}) {
    floe::selection sel;
    ex.group_top_k(dev.view(), q, k, sel);
    const auto chosen = indices_of(sel, n);
    REQUIRE(static_cast<index_t>(chosen.size()) == k);
    std::vector<char> in(n, 0);
    for (index_t i : chosen) in[i] = 1;
    index_t split = 0;
    for (index_t i = 0; i + 1 < n; i += 2) {
      REQUIRE(!(in[i + 1] && !in[i]));
      split += in[i] != in[i + 1];
    }
    REQUIRE(split == k % 2);  // an odd k splits exactly one pair
  }
}

TEST_CASE("oracle_topk on the cuda executor ranks on device memory as on the scalar reference", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(35);
  const floe::exec::cuda ex;
  const index_t n = 20000, d = 128, heads = 4;
  const ft::random_kv<floe::bfloat16> host(g, n, d, d, 0, 16);
  // Device memory: oracle_topk reads keys only through the executor.
  const ft::cuda_kv<floe::bfloat16> dev(host, ft::cuda_array<floe::bfloat16>::device);
  const auto qd = ft::random_floats(g, heads * d, 2.f);
  const auto q = floe::query_group::make(qd.data(), heads, d);
  const floe::select::oracle_topk topk{1000};
  floe::selection on_device, on_host;
  floe::stats io_device, io_host;
  topk.select({}, dev.paged_view(), q, ex, on_device, io_device);
  topk.select({}, host.paged_view(), q, floe::exec::scalar{}, on_host, io_host);
  // Both rank the same weights; they may part only at a near-tie of the 1000th weight.
  const auto w = reference_weights(host.paged_view(), q);
  const auto a = indices_of(on_device, n), b = indices_of(on_host, n);
  REQUIRE(a.size() == 1000);
  std::vector<index_t> only;
  std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only));
  auto sorted = w;
  std::nth_element(sorted.begin(), sorted.begin() + 999, sorted.end(), std::greater<double>());
  const double kth = sorted[999];
  for (index_t i : only) REQUIRE(std::abs(w[i] - kth) <= 1e-4 * kth);
  REQUIRE(only.size() <= 2);
  REQUIRE(io_device.key_bytes == io_host.key_bytes);
}

TEST_CASE("cuda group_top_k refuses bad input by name", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(36);
  const floe::exec::cuda ex;
  const ft::random_kv<float> host(g, 100, 64, 64);
  const ft::cuda_kv<float> dev(host, ft::cuda_array<float>::device);
  auto qd = ft::random_floats(g, 2 * 64);
  const auto q = floe::query_group::make(qd.data(), 2, 64);
  floe::selection sel;
  REQUIRE(ft::argument_of([&] { ex.group_top_k(dev.view(), q, 101, sel); }) == "k");
  qd[70] = std::nanf("");
  REQUIRE(ft::argument_of([&] { ex.group_top_k(dev.view(), q, 10, sel); }) == "query");
  REQUIRE(sel.ranges.empty());
  // All KV heads at once: views of another n, and a query list of another length.
  const ft::random_kv<float> shorter(g, 90, 64, 64);
  const ft::cuda_kv<float> dev_short(shorter, ft::cuda_array<float>::device);
  const std::vector<floe::kv_view<float>> mixed{dev.view(), dev_short.view()};
  qd[70] = 0.5f;
  const std::vector<floe::query_group> two{q, q};
  ft::cuda_array<std::int32_t> out(std::vector<std::int32_t>(40), ft::cuda_array<std::int32_t>::device);
  REQUIRE(ft::argument_of([&] { ex.group_top_k(std::span<const floe::kv_view<float>>(mixed), std::span<const floe::query_group>(two), 10, out.data()); }) == "kv_heads");
  REQUIRE(ft::argument_of([&] { ex.group_top_k(std::span<const floe::kv_view<float>>(mixed), std::span<const floe::query_group>(two).first(1), 10, out.data()); }) == "queries");
  REQUIRE(ft::argument_of([&] { ex.group_top_k(dev.view(), q, 10, static_cast<std::int32_t*>(nullptr)); }) == "indices");
  const auto q32 = floe::query_group::make(qd.data(), 1, 32);
  REQUIRE(ft::argument_of([&] { ex.group_top_k(dev.view(), q32, 10, sel); }) == "query.d");
}

// Keys whose scores are NaN or +Inf have no order: found in the score launch and refused
// with the key's token and element (read back from the device), nothing selected.
TEST_CASE("cuda group_top_k refuses NaN or Inf keys by token and element", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(37);
  const floe::exec::cuda ex;
  const ft::random_kv<float> host(g, 300, 64, 64);
  const ft::cuda_kv<float> dev(host, ft::cuda_array<float>::device);
  const ft::cuda_kv<float> other(host, ft::cuda_array<float>::device);
  auto qd = ft::random_floats(g, 2 * 64);
  qd[5] = 1.f;  // element 5 positive: an Inf there makes the score +Inf
  const auto q = floe::query_group::make(qd.data(), 2, 64);
  auto set_key = [&](const ft::cuda_kv<float>& kv, index_t i, index_t t, float x) {
    ft::cuda_check(cudaMemcpy(kv.keys.data() + i * host.key_stride + t, &x, sizeof x, cudaMemcpyHostToDevice), "poison");
  };
  const float inf = std::numeric_limits<float>::infinity();
  floe::selection sel;
  set_key(dev, 237, 5, inf);
  REQUIRE(ft::refusal_of([&] { ex.group_top_k(dev.view(), q, 10, sel); }, "key 237 element 5 is NaN or Inf") == "kv");
  REQUIRE(sel.ranges.empty());
  set_key(dev, 237, 5, std::nanf(""));
  set_key(dev, 12, 9, std::nanf(""));  // the lower token is named
  REQUIRE(ft::refusal_of([&] { ex.group_top_k(dev.view(), q, 10, sel); }, "key 12 element 9") == "kv");
  // Every KV head at once: the second view's key is named by its head; nothing written.
  set_key(dev, 237, 5, host.keys[237 * host.key_stride + 5]);
  set_key(dev, 12, 9, host.keys[12 * host.key_stride + 9]);
  set_key(other, 80, 62, std::nanf(""));
  const std::vector<floe::kv_view<float>> heads{dev.view(), other.view()};
  const std::vector<floe::query_group> two{q, q};
  ft::cuda_array<std::int32_t> out(std::vector<std::int32_t>(20, -1), ft::cuda_array<std::int32_t>::device);
  REQUIRE(ft::refusal_of([&] { ex.group_top_k(std::span<const floe::kv_view<float>>(heads), std::span<const floe::query_group>(two), 10, out.data()); },
                     "KV head 1, key 80 element 62") == "kv_heads");
  for (const std::int32_t i : out.to_host()) REQUIRE(i == -1);
  // Finite keys whose scores overflow float.
  set_key(dev, 40, 5, 3e38f);
  qd[5] = 1e3f;
  REQUIRE(ft::refusal_of([&] { ex.group_top_k(dev.view(), q, 10, sel); }, "the scores of key 40 overflow float") == "kv");
  REQUIRE(sel.ranges.empty());
  // Healed, the same calls select.
  set_key(dev, 40, 5, host.keys[40 * host.key_stride + 5]);
  REQUIRE(ft::refusal_of([&] { ex.group_top_k(dev.view(), q, 10, sel); }, "") == "(nothing thrown)");
  REQUIRE(sel.ranges.size() >= 1);
}
