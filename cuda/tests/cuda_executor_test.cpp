// floe::exec::cuda against the scalar reference (double accumulation) on fresh random
// inputs: attend over whole caches, gathered ranges and single tokens, score, batch decode
// on device memory (dense, gathered, and over group_top_k's device token lists) with every
// output element written, and bad input refused before any write.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "cuda_test_support.hpp"
#include "support/argument_of.hpp"
#include "exec/simd_test_support.hpp"
#include "floe/exec/cuda.hpp"
#include "floe/exec/scalar.hpp"

using floe::index_t;
using floe::token_range;
namespace ft = floe::testing;

namespace {

using where = ft::cuda_array<float>::where;
using index_array = ft::cuda_array<std::int32_t>;
constexpr auto on_device = index_array::device;

// A few ranges inside [0, n): the head, scattered 64-token runs and single tokens.
std::vector<token_range> scattered(index_t n) {
  std::vector<token_range> out;
  if (n < 10) return {{0, n}};
  out.push_back({0, 3});
  for (index_t b = n / 7; b + 70 < n; b += n / 5 + 1) out.push_back({b, b + 64});
  if (out.back().end + 2 < n) out.push_back({n - 1, n});
  return out;
}

// Every third token, as single-token ranges (a top-k selection; read through a token list).
std::vector<token_range> singles(index_t n) {
  std::vector<token_range> out;
  for (index_t i = 1; i < n; i += 3) out.push_back({i, i + 1});
  if (out.empty()) out.push_back({0, n});
  return out;
}

// kv: the device copy; ref: the same cache in host memory, for the scalar reference.
template <class T, class KV>
void check_attend(const KV& kv, const KV& ref, index_t heads, std::mt19937_64& g, const floe::exec::cuda& ex) {
  const auto qd = ft::random_floats(g, heads * kv.d());
  const auto q = floe::query_group::make(qd.data(), heads, kv.d());
  for (const auto& ranges : {std::vector<token_range>{{0, kv.n()}}, scattered(kv.n()), singles(kv.n())}) {
    floe::partial_set<float> got(heads, kv.dv());
    floe::partial_set<double> want(heads, kv.dv());
    ex.attend(kv, q, ranges, got);
    floe::exec::scalar{}.attend(ref, q, ranges, want);
    REQUIRE(ft::max_relative_error(got, want) <= 1e-5);
  }
  // score: one head over a middle range
  const token_range r{kv.n() / 3, kv.n()};
  std::vector<float> z(r.size(), std::nanf("")), zr(r.size());
  const index_t head = heads - 1;
  ex.score(kv, q, head, r, z.data());
  floe::exec::scalar{}.score(ref, q, head, r, zr.data());
  for (index_t i = 0; i < r.size(); ++i) REQUIRE(std::abs(z[i] - zr[i]) <= 1e-5f * (1.f + std::abs(zr[i])));
}

template <class T>
void attend_sweep(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::exec::cuda chunked({0, 512}), tiny({0, 7});  // tiny: many chunks to merge
  const index_t dims[] = {64, 80, 128, 256}, groups[] = {1, 4, 8, 12};
  index_t turn = 0;
  for (index_t n : {1, 7, 63, 64, 65, 1000, 100003}) {
    for (index_t d : dims) {
      const index_t heads = groups[turn % 4], pad = turn % 2 ? 3 : 0, block = (turn / 2) % 3 == 1 ? 16 : (turn / 2) % 3 == 2 ? 256 : 0;
      ++turn;
      INFO("n " << n << " d " << d << " g " << heads << " pad " << pad << " block " << block);
      const ft::random_kv<T> host(g, n, d, d, pad, block);
      const ft::cuda_kv<T> dev(host, ft::cuda_array<T>::device);
      const auto& ex = n < 2000 && turn % 3 == 0 ? tiny : chunked;
      if (block) check_attend<T>(dev.paged_view(), host.paged_view(), heads, g, ex);
      else check_attend<T>(dev.view(), host.view(), heads, g, ex);
    }
  }
}

}  // namespace

TEST_CASE("cuda attend and score equal the scalar reference (float)", "[cuda]") { attend_sweep<float>(1); }
TEST_CASE("cuda attend and score equal the scalar reference (half)", "[cuda]") { attend_sweep<floe::half>(2); }
TEST_CASE("cuda attend and score equal the scalar reference (bfloat16)", "[cuda]") { attend_sweep<floe::bfloat16>(3); }

namespace {
// 16-bit rows of d = dv = 64 or 128 run on tensor cores, the fp32 query split into 16-bit
// terms after a per-head power-of-two scaling: queries far outside fp16's range (1e6:
// one-hot weights) or deep in its subnormals (1e-7: near-uniform weights) keep fp32's
// result, for attend and for the scores that rank tokens.
template <class T>
void extreme_queries(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::exec::cuda ex({0, 256});
  for (const index_t d : {64, 128})
    for (const float sigma : {1e-7f, 1e6f}) {
      INFO("d " << d << " query sigma " << sigma);
      const ft::random_kv<T> host(g, 3000, d, d);
      const ft::cuda_kv<T> dev(host, ft::cuda_array<T>::device);
      const auto qd = ft::random_floats(g, 4 * d, sigma);
      const auto q = floe::query_group::make(qd.data(), 4, d);
      floe::partial_set<float> got(4, d);
      floe::partial_set<double> want(4, d);
      ex.attend(dev.view(), q, std::vector<token_range>{{0, 3000}}, got);
      floe::exec::scalar{}.attend(host.view(), q, std::vector<token_range>{{0, 3000}}, want);
      REQUIRE(ft::max_relative_error(got, want) <= 1e-5);
      // The score kernel splits and scales the query the same way: every head's scores,
      // within 1e-5 of s * sum_t |q_t k_t| (a dot product's rounding scales with its terms).
      std::vector<float> z(3000), zr(3000);
      const auto keys = host.view();
      for (index_t head = 0; head < 4; ++head) {
        std::fill(z.begin(), z.end(), std::nanf(""));
        ex.score(dev.view(), q, head, {0, 3000}, z.data());
        floe::exec::scalar{}.score(keys, q, head, {0, 3000}, zr.data());
        const float* qh = q.row(head);
        for (index_t i = 0; i < 3000; ++i) {
          double terms = 0;
          for (index_t t = 0; t < d; ++t) terms += std::abs(double(qh[t]) * floe::to_float(keys.key_row(i)[t]));
          INFO("head " << head << " token " << i << " score " << z[i] << " reference " << zr[i] << " terms " << terms * q.scale);
          REQUIRE(std::abs(double(z[i]) - zr[i]) <= 1e-5 * terms * q.scale);
        }
      }
    }
}
}  // namespace

TEST_CASE("cuda attend and score keep fp32 precision for very large and very small queries (half)", "[cuda]") {
  extreme_queries<floe::half>(4);
}
TEST_CASE("cuda attend and score keep fp32 precision for very large and very small queries (bfloat16)", "[cuda]") {
  extreme_queries<floe::bfloat16>(5);
}

namespace {

// A batch on the device: sequences of different lengths, Hkv heads each, padded query
// and output rows; outputs poisoned with NaN and their padding with a sentinel.
template <class T>
struct device_batch {
  static constexpr float sentinel = -12345.f;
  floe::gqa_shape shape;
  index_t q_stride, out_stride;
  std::vector<std::unique_ptr<ft::random_kv<T>>> host;
  std::vector<std::unique_ptr<ft::cuda_kv<T>>> dev;
  std::vector<std::vector<floe::kv_view<T>>> views;
  std::vector<std::vector<float>> queries;
  std::vector<std::unique_ptr<ft::cuda_array<float>>> dq, dout;

  device_batch(std::mt19937_64& g, const std::vector<index_t>& lengths, floe::gqa_shape s, index_t d)
      : shape(s), q_stride(d + 3), out_stride(d + 2) {
    for (index_t n : lengths) {
      views.emplace_back();
      for (index_t h = 0; h < s.kv_heads; ++h) {
        host.push_back(std::make_unique<ft::random_kv<T>>(g, n, d, d, 1, 0));
        dev.push_back(std::make_unique<ft::cuda_kv<T>>(*host.back(), ft::cuda_array<T>::device));
        views.back().push_back(dev.back()->view());
      }
      queries.push_back(ft::random_floats(g, s.q_heads * q_stride));
      dq.push_back(std::make_unique<ft::cuda_array<float>>(queries.back(), where::device));
      std::vector<float> o(s.q_heads * out_stride, std::numeric_limits<float>::quiet_NaN());
      for (index_t r = 0; r < s.q_heads; ++r) o[r * out_stride + d] = o[r * out_stride + d + 1] = sentinel;
      dout.push_back(std::make_unique<ft::cuda_array<float>>(o, where::device));
    }
  }
  std::vector<floe::sequence<floe::kv_view<T>>> sequences() const {
    std::vector<floe::sequence<floe::kv_view<T>>> out;
    for (index_t s = 0; s < views.size(); ++s)
      out.push_back({views[s], dq[s]->data(), dout[s]->data(), q_stride, out_stride});
    return out;
  }
  // Checks sequence s's outputs against the scalar reference over `ranges_of(head)`.
  template <class RangesOf>
  void check(RangesOf&& ranges_of, float scale) const {
    const index_t g = shape.group();
    for (index_t s = 0; s < views.size(); ++s) {
      const auto got = dout[s]->to_host();
      for (index_t h = 0; h < shape.kv_heads; ++h) {
        const auto& hk = *host[s * shape.kv_heads + h];
        const floe::query_group q{queries[s].data() + h * g * q_stride, g, hk.d, q_stride, scale};
        floe::partial_set<double> want(g, hk.dv);
        const auto ranges = ranges_of(s * shape.kv_heads + h);
        if (!ranges.empty()) floe::exec::scalar{}.attend(hk.view(), q, ranges, want);
        std::vector<float> ref(g * hk.dv);
        want.finalize(floe::output_group<float>{ref.data(), g, hk.dv, 0});
        const float* row = got.data() + h * g * out_stride;
        REQUIRE(ft::max_relative_error(row, out_stride, ref.data(), hk.dv, g, hk.dv) <= 1e-5);
        for (index_t r = 0; r < g; ++r) {
          REQUIRE(row[r * out_stride + hk.dv] == sentinel);  // padding between rows untouched
          for (index_t j = 0; j < hk.dv; ++j) REQUIRE(std::isfinite(row[r * out_stride + j]));
        }
      }
    }
  }
};

template <class T>
void batch_case(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::exec::cuda ex;
  for (auto [shape, d] : {std::pair{floe::gqa_shape{12, 3}, index_t{128}}, {floe::gqa_shape{8, 1}, index_t{64}},
                          {floe::gqa_shape{9, 3}, index_t{80}}}) {
    INFO("Hq " << shape.q_heads << " Hkv " << shape.kv_heads << " d " << d);
    const float scale = 1.f / std::sqrt(float(d));
    device_batch<T> dense(g, {1000, 4097, 70}, shape, d);
    const auto seqs = dense.sequences();
    ex.decode<floe::kv_view<T>>(seqs, shape, scale);
    dense.check([&](index_t gi) { return std::vector<token_range>{{0, dense.host[gi]->n}}; }, scale);

    device_batch<T> gathered(g, {1000, 4097, 70}, shape, d);
    std::vector<std::vector<token_range>> exact;
    for (index_t gi = 0; gi < gathered.host.size(); ++gi)
      exact.push_back(gi == 1 ? std::vector<token_range>{}  // one empty: zeros
                      : gi % 3 == 2 ? singles(gathered.host[gi]->n)
                                    : scattered(gathered.host[gi]->n));
    const auto gseqs = gathered.sequences();
    ex.decode_gathered<floe::kv_view<T>>(gseqs, shape, scale, exact);
    gathered.check([&](index_t gi) { return exact[gi]; }, scale);
  }
}

}  // namespace

// decode_indexed over group_top_k's device output: the indices equal those of the host
// entry point, and the outputs the scalar reference over those tokens; one list empty.
template <class T>
void indexed_case(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::exec::cuda ex;
  const floe::gqa_shape shape{12, 3};
  const index_t d = 128, gq = shape.group();
  const float scale = 1.f / std::sqrt(float(d));
  device_batch<T> b(g, {3000, 1501, 200}, shape, d);
  const index_t groups = b.host.size();
  std::vector<std::vector<token_range>> chosen(groups);
  std::vector<std::int32_t> zeros(3000, 0);
  std::vector<std::unique_ptr<ft::cuda_array<std::int32_t>>> lists;
  std::vector<floe::exec::device_tokens> tokens;
  for (index_t gi = 0; gi < groups; ++gi) {
    const auto& hk = *b.host[gi];
    const index_t k = gi == 4 ? 0 : gi % 2 ? hk.n / 20 + 1 : hk.n / 3;  // group 4: an empty list
    const floe::query_group q{b.queries[gi / shape.kv_heads].data() + (gi % shape.kv_heads) * gq * b.q_stride, gq, d,
                              b.q_stride, scale};
    floe::selection sel;
    ex.group_top_k(b.views[gi / shape.kv_heads][gi % shape.kv_heads], q, k, sel);
    chosen[gi] = sel.ranges;
    lists.push_back(std::make_unique<index_array>(zeros, on_device));
    ex.group_top_k(b.views[gi / shape.kv_heads][gi % shape.kv_heads], q, k, lists.back()->data());
    const auto from_device = lists.back()->to_host();
    std::vector<std::int32_t> on_host;
    for (const auto& r : sel.ranges)
      for (index_t i = r.begin; i < r.end; ++i) on_host.push_back(static_cast<std::int32_t>(i));
    REQUIRE(std::vector<std::int32_t>(from_device.begin(), from_device.begin() + k) == on_host);
    tokens.push_back({lists.back()->data(), k});
  }
  // All KV heads of a sequence in one call give what one call per head gave.
  for (index_t s = 0; s < b.views.size(); ++s) {
    const index_t k = b.host[s * shape.kv_heads]->n / 7;
    std::vector<floe::query_group> qs;
    for (index_t h = 0; h < shape.kv_heads; ++h)
      qs.push_back({b.queries[s].data() + h * gq * b.q_stride, gq, d, b.q_stride, scale});
    const index_array together(std::vector<std::int32_t>(shape.kv_heads * k, -1), on_device), alone(zeros, on_device);
    ex.group_top_k(std::span<const floe::kv_view<T>>(b.views[s]), std::span<const floe::query_group>(qs), k,
                   together.data());
    const auto all = together.to_host();
    for (index_t h = 0; h < shape.kv_heads; ++h) {
      ex.group_top_k(b.views[s][h], qs[h], k, alone.data());
      const auto one = alone.to_host();
      REQUIRE(std::equal(one.begin(), one.begin() + k, all.begin() + h * k));
    }
  }
  const auto seqs = b.sequences();
  ex.decode_indexed<T>(seqs, shape, scale, tokens);
  b.check([&](index_t gi) { return chosen[gi]; }, scale);

  // Device queries, the whole batch in one call, give what host queries give per sequence:
  // sequences of different n, of equal n (ranked together), and one with k = n.
  auto same_as_host_queries = [&](const device_batch<T>& batch, index_t k) {
    const index_t lists_total = batch.host.size();
    const index_array together(std::vector<std::int32_t>(lists_total * k, -1), on_device);
    ex.group_top_k<floe::kv_view<T>>(batch.sequences(), shape, scale, k, together.data());
    const auto all = together.to_host();
    for (index_t s = 0; s < batch.views.size(); ++s) {
      std::vector<floe::query_group> qs;
      for (index_t h = 0; h < shape.kv_heads; ++h)
        qs.push_back({batch.queries[s].data() + h * gq * batch.q_stride, gq, d, batch.q_stride, scale});
      const index_array one(std::vector<std::int32_t>(shape.kv_heads * k, -2), on_device);
      ex.group_top_k(std::span<const floe::kv_view<T>>(batch.views[s]), std::span<const floe::query_group>(qs), k,
                     one.data());
      const auto want = one.to_host();
      INFO("sequence " << s << " k " << k);
      REQUIRE(std::equal(want.begin(), want.end(), all.begin() + s * shape.kv_heads * k));
    }
  };
  same_as_host_queries(b, 200);  // n = 3000, 1501, 200
  device_batch<T> equal(g, {700, 700, 333, 700}, shape, d);
  same_as_host_queries(equal, 100);
}

TEST_CASE("cuda decode_indexed over group_top_k's device indices equals the scalar reference", "[cuda]") {
  indexed_case<floe::half>(14);
  indexed_case<float>(15);
}

TEST_CASE("cuda decode_indexed refuses a bad token list before reading through it", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(16);
  const floe::exec::cuda ex;
  const floe::gqa_shape shape{4, 2};
  device_batch<floe::half> b(g, {100, 50}, shape, 64);
  const auto seqs = b.sequences();
  const std::vector<std::int32_t> good{1, 5, 9}, past{2, 7, 50}, twice{3, 3}, negative{-1, 4};
  const index_array dgood(good, on_device), dpast(past, on_device), dtwice(twice, on_device),
      dnegative(negative, on_device);
  auto call = [&](floe::exec::device_tokens last) {
    const std::vector<floe::exec::device_tokens> lists{{dgood.data(), 3}, {dgood.data(), 3}, {dgood.data(), 3}, last};
    return ft::argument_of([&] { ex.decode_indexed<floe::half>(seqs, shape, 0.125f, lists); });
  };
  auto untouched = [&] {
    for (const auto& o : b.dout)
      for (float x : o->to_host()) REQUIRE((std::isnan(x) || x == b.sentinel));
  };
  // The second sequence has n = 50: index 50 is past it (position 2).
  try {
    const std::vector<floe::exec::device_tokens> lists{{dgood.data(), 3}, {dgood.data(), 3}, {dgood.data(), 3}, {dpast.data(), 3}};
    ex.decode_indexed<floe::half>(seqs, shape, 0.125f, lists);
    FAIL("nothing thrown");
  } catch (const floe::invalid_argument& e) {
    REQUIRE(e.argument() == "tokens");
    REQUIRE(std::string(e.what()).find("sequence 1, KV head 1: position 2") != std::string::npos);
  }
  untouched();
  REQUIRE(call({dtwice.data(), 2}) == "tokens");
  REQUIRE(call({dnegative.data(), 2}) == "tokens");
  REQUIRE(call({nullptr, 2}) == "tokens");
  REQUIRE(call({dgood.data(), 51}) == "tokens");  // more tokens than n
  untouched();
  const std::vector<floe::exec::device_tokens> three(3, {dgood.data(), 3});
  REQUIRE(ft::argument_of([&] { ex.decode_indexed<floe::half>(seqs, shape, 0.125f, three); }) == "tokens");
  // A good call still works after the refusals.
  REQUIRE(call({dgood.data(), 3}) == "(nothing thrown)");
}

TEST_CASE("cuda group_top_k over device queries refuses bad input before writing", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(17);
  const floe::exec::cuda ex;
  const floe::gqa_shape shape{12, 3};
  device_batch<floe::half> b(g, {100, 50}, shape, 64);
  const auto seqs = b.sequences();
  const index_array out(std::vector<std::int32_t>(6 * 40, -1), on_device);
  auto untouched = [&] {
    for (const std::int32_t i : out.to_host()) REQUIRE(i == -1);
  };
  auto call = [&](const auto& batch, floe::gqa_shape sh, float scale, index_t k, std::int32_t* indices) {
    return ft::argument_of([&] { ex.group_top_k<floe::kv_view<floe::half>>(batch, sh, scale, k, indices); });
  };
  // NaN in sequence 1, query head 5 (KV head 1's second), element 7: found on the device.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ft::cuda_check(cudaMemcpy(b.dq[1]->data() + 5 * b.q_stride + 7, &nan, sizeof nan, cudaMemcpyHostToDevice), "poison");
  auto rank = [&](const auto& batch, floe::gqa_shape sh) {
    return [&, sh] { ex.group_top_k<floe::kv_view<floe::half>>(batch, sh, 0.125f, 40, out.data()); };
  };
  REQUIRE(ft::refusal_of(rank(seqs, shape), "sequence 1, query head 5, element 7") == "sequence.queries");
  untouched();
  {  // 12 heads a group, 8 a pass: the second slice's head is named right
    device_batch<floe::half> wide(g, {60}, floe::gqa_shape{24, 2}, 64);
    const float inf = std::numeric_limits<float>::infinity();
    ft::cuda_check(cudaMemcpy(wide.dq[0]->data() + 22 * wide.q_stride + 3, &inf, sizeof inf, cudaMemcpyHostToDevice),
                   "poison");
    const auto wide_seqs = wide.sequences();
    REQUIRE(ft::refusal_of(rank(wide_seqs, wide.shape), "sequence 0, query head 22, element 3") == "sequence.queries");
    untouched();
  }
  const float one = 1.f;
  ft::cuda_check(cudaMemcpy(b.dq[1]->data() + 5 * b.q_stride + 7, &one, sizeof one, cudaMemcpyHostToDevice), "heal");
  {  // A NaN key (sequence 1, KV head 2, token 33, element 4): its scores have no order.
    floe::half* key = b.dev[1 * 3 + 2]->keys.data() + 33 * b.host[1 * 3 + 2]->key_stride + 4;
    const floe::half nan_key = floe::half::from_bits(0x7e00), kept = b.host[1 * 3 + 2]->keys[33 * b.host[1 * 3 + 2]->key_stride + 4];
    ft::cuda_check(cudaMemcpy(key, &nan_key, sizeof nan_key, cudaMemcpyHostToDevice), "poison key");
    REQUIRE(ft::refusal_of(rank(seqs, shape), "sequence 1, KV head 2, key 33 element 4 is NaN or Inf") ==
            "sequence.kv_heads");
    untouched();
    ft::cuda_check(cudaMemcpy(key, &kept, sizeof kept, cudaMemcpyHostToDevice), "heal key");
  }
  REQUIRE(call(seqs, shape, 0.125f, 51, out.data()) == "k");  // sequence 1 has n = 50
  REQUIRE(call(seqs, shape, 0.125f, 40, nullptr) == "indices");
  REQUIRE(call(seqs, shape, 0.f, 40, out.data()) == "scale");
  REQUIRE(call(seqs, floe::gqa_shape{8, 2}, 0.125f, 40, out.data()) == "sequence.kv_heads");
  auto changed = seqs;
  changed[0].query_stride = 63;
  REQUIRE(call(changed, shape, 0.125f, 40, out.data()) == "sequence.query_stride");
  changed = seqs;
  changed[1].queries = nullptr;
  REQUIRE(call(changed, shape, 0.125f, 40, out.data()) == "sequence.queries");
  std::vector<floe::kv_view<floe::half>> mixed = b.views[0];
  mixed[2] = b.views[1][2];  // n = 50 among n = 100
  changed = seqs;
  changed[0].kv_heads = mixed;
  REQUIRE(call(changed, shape, 0.125f, 40, out.data()) == "sequence.kv_heads");
  untouched();
  REQUIRE(call(seqs, shape, 0.125f, 40, out.data()) == "(nothing thrown)");
  for (const std::int32_t i : out.to_host()) REQUIRE((i >= 0 && i < 100));
}

TEST_CASE("cuda batch decode on device memory equals the scalar reference (float)", "[cuda]") { batch_case<float>(11); }
TEST_CASE("cuda batch decode on device memory equals the scalar reference (half)", "[cuda]") { batch_case<floe::half>(12); }
TEST_CASE("cuda batch decode on device memory equals the scalar reference (bfloat16)", "[cuda]") { batch_case<floe::bfloat16>(13); }

namespace {

// Batch decode over paged KV in device memory: the kernels read each view's block table
// on the device. Odd heads take the table of the head before them (a table shared by
// views, staged once); sequences have tables of their own.
template <class T>
void paged_batch_case(std::uint64_t salt) {
  INFO("seed " << ft::seed() << " type " << floe::element_name<T>());
  auto g = ft::rng(salt);
  const floe::gqa_shape shape{16, 4};  // heads 0 and 2: distinct tables of one length
  const index_t d = 128, gq = shape.group();
  const float scale = 1.f / std::sqrt(float(d));
  for (index_t block : {16, 256}) {
    INFO("block " << block);
    const std::vector<index_t> lengths{5000, 1, 333};
    std::vector<std::unique_ptr<ft::random_kv<T>>> host;
    std::vector<std::unique_ptr<ft::cuda_kv<T>>> dev;
    std::vector<std::vector<floe::paged_kv_view<T>>> views, refs;
    std::vector<std::vector<float>> queries;
    std::vector<std::unique_ptr<ft::cuda_array<float>>> dq, dout;
    std::vector<std::vector<token_range>> exact;
    for (index_t n : lengths) {
      views.emplace_back();
      refs.emplace_back();
      for (index_t h = 0; h < shape.kv_heads; ++h) {
        host.push_back(std::make_unique<ft::random_kv<T>>(g, n, d, d, 0, block));
        dev.push_back(std::make_unique<ft::cuda_kv<T>>(*host.back(), ft::cuda_array<T>::device));
        const auto& hk = *host.back();
        const auto& table = h % 2 ? host[host.size() - 2]->table : hk.table;
        const index_t pool = hk.keys.size() / hk.key_stride / block;
        views.back().push_back({dev.back()->keys.data(), dev.back()->values.data(), pool, block, table, n, d, d});
        refs.back().push_back({hk.keys.data(), hk.values.data(), pool, block, table, n, d, d});
        exact.push_back(scattered(n));
      }
      queries.push_back(ft::random_floats(g, shape.q_heads * d));
      dq.push_back(std::make_unique<ft::cuda_array<float>>(queries.back(), where::device));
      dout.push_back(std::make_unique<ft::cuda_array<float>>(
          std::vector<float>(shape.q_heads * d, std::numeric_limits<float>::quiet_NaN()), where::device));
    }
    std::vector<floe::sequence<floe::paged_kv_view<T>>> seqs;
    for (index_t s = 0; s < lengths.size(); ++s) seqs.push_back({views[s], dq[s]->data(), dout[s]->data()});
    const floe::exec::cuda ex, tiny({0, 7});
    for (bool gathered : {false, true}) {
      INFO("gathered " << gathered);
      if (gathered) tiny.decode_gathered<floe::paged_kv_view<T>>(seqs, shape, scale, exact);
      else ex.decode<floe::paged_kv_view<T>>(seqs, shape, scale);
      for (index_t s = 0; s < lengths.size(); ++s) {
        const auto got = dout[s]->to_host();
        for (index_t h = 0; h < shape.kv_heads; ++h) {
          const floe::query_group q{queries[s].data() + h * gq * d, gq, d, d, scale};
          floe::partial_set<double> want(gq, d);
          const auto ranges = gathered ? exact[s * shape.kv_heads + h] : std::vector<token_range>{{0, lengths[s]}};
          floe::exec::scalar{}.attend(refs[s][h], q, ranges, want);
          std::vector<float> ref(gq * d);
          want.finalize(floe::output_group<float>{ref.data(), gq, d, 0});
          REQUIRE(ft::max_relative_error(got.data() + h * gq * d, d, ref.data(), d, gq, d) <= 1e-5);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("cuda batch decode over paged device KV equals the scalar reference (half)", "[cuda]") {
  paged_batch_case<floe::half>(14);
}
TEST_CASE("cuda batch decode over paged device KV equals the scalar reference (float)", "[cuda]") {
  paged_batch_case<float>(15);
}

// One executor shared by several threads: each call has its own plan, page-locked
// staging and stream-ordered allocation on its thread's default stream, so concurrent
// calls each give their own batch's reference result.
TEST_CASE("cuda executor shared by four threads gives each its own result", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(41);
  const floe::exec::cuda ex;
  const floe::gqa_shape shape{8, 2};
  const index_t d = 128;
  const float scale = 1.f / std::sqrt(float(d));
  constexpr int threads = 4, rounds = 20;
  std::vector<std::unique_ptr<device_batch<floe::half>>> batches;
  for (int t = 0; t < threads; ++t)
    batches.push_back(std::make_unique<device_batch<floe::half>>(g, std::vector<index_t>{index_t(3000 + 1000 * t), 77}, shape, d));
  std::vector<std::thread> pool;
  std::vector<std::string> errors(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      try {
        const auto seqs = batches[t]->sequences();
        std::vector<float> first;
        for (int r = 0; r < rounds; ++r) {
          ex.decode<floe::kv_view<floe::half>>(seqs, shape, scale);
          const auto now = batches[t]->dout[0]->to_host();  // every round gives the same bytes
          if (r == 0) first = now;
          else if (std::memcmp(first.data(), now.data(), now.size() * sizeof(float)) != 0)
            throw std::runtime_error("round " + std::to_string(r) + " differs from round 0");
        }
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) {
    INFO("thread " << t);
    REQUIRE(errors[t].empty());
    batches[t]->check([&](index_t gi) { return std::vector<token_range>{{0, batches[t]->host[gi]->n}}; }, scale);
  }
}

// cuda_options::stream: the decode is queued behind the caller's own work on its stream.
// The KV reaches the device by asynchronous copies on that stream, held back 50 ms by a
// host function queued before them, over a cache poisoned with NaN: a decode on another
// stream would read the poison.
TEST_CASE("cuda decode runs on the caller's stream, after the caller's work there", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(31);
  using half = floe::half;
  const index_t n = 32768, d = 128;
  const floe::gqa_shape shape{4, 1};
  const float scale = 1.f / std::sqrt(float(d));
  const ft::random_kv<half> host(g, n, d, d);
  const ft::cuda_array<half> keys_pinned(host.keys, ft::cuda_array<half>::pinned_host);
  const ft::cuda_array<half> values_pinned(host.values, ft::cuda_array<half>::pinned_host);
  const std::vector<half> poison(host.keys.size(), floe::from_float<half>(std::nanf("")));
  const ft::cuda_array<half> keys(poison, ft::cuda_array<half>::device), values(poison, ft::cuda_array<half>::device);
  const auto qh = ft::random_floats(g, shape.q_heads * d);
  const ft::cuda_array<float> q(qh, where::device), out(std::vector<float>(shape.q_heads * d, 0.f), where::device);
  cudaStream_t stream = nullptr;
  ft::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::size_t bytes = host.keys.size() * sizeof(half);
  ft::cuda_check(cudaLaunchHostFunc(stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr),
                 "cudaLaunchHostFunc");
  ft::cuda_check(cudaMemcpyAsync(keys.data(), keys_pinned.data(), bytes, cudaMemcpyHostToDevice, stream), "copy keys");
  ft::cuda_check(cudaMemcpyAsync(values.data(), values_pinned.data(), bytes, cudaMemcpyHostToDevice, stream), "copy values");
  const std::vector<floe::kv_view<half>> heads{{keys.data(), values.data(), n, d, d}};
  const std::vector<floe::sequence<floe::kv_view<half>>> seqs{{heads, q.data(), out.data()}};
  floe::exec::cuda({0, 0, stream}).decode<floe::kv_view<half>>(seqs, shape, scale);
  ft::cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  floe::partial_set<double> want(shape.q_heads, d);
  floe::exec::scalar{}.attend(host.view(), floe::query_group{qh.data(), shape.q_heads, d, d, scale},
                              std::vector<token_range>{{0, n}}, want);
  std::vector<float> ref(shape.q_heads * d);
  want.finalize(floe::output_group<float>{ref.data(), shape.q_heads, d, 0});
  const auto got = out.to_host();
  REQUIRE(ft::max_relative_error(got.data(), d, ref.data(), d, shape.q_heads, d) <= 1e-5);
}

TEST_CASE("cuda executor refuses bad input by name before writing", "[cuda]") {
  INFO("seed " << ft::seed());
  auto g = ft::rng(21);
  REQUIRE(ft::argument_of([] { floe::exec::cuda({0, index_t{1} << 21}); }) == "chunk_tokens");
  REQUIRE(ft::argument_of([] { floe::exec::cuda({1 << 20, 512}); }) == "device");
  const floe::exec::cuda ex;

  const ft::random_kv<floe::half> wide(g, 10, 300, 64);
  const ft::cuda_kv<floe::half> wide_dev(wide, ft::cuda_array<floe::half>::device);
  auto q300 = ft::random_floats(g, 300);
  floe::partial_set<float> p1(1, 64);
  REQUIRE(ft::argument_of([&] { ex.attend(wide_dev.view(), floe::query_group::make(q300.data(), 1, 300), std::vector<token_range>{{0, 10}}, p1); }) == "d");

  // A view of 2^31 tokens (never read): refused by name, not truncated to 32 bits.
  const std::vector<float> q64_storage(64, 0.f);
  const floe::kv_view<float> huge(q64_storage.data(), q64_storage.data(), index_t{1} << 31, 64, 64);
  auto q64 = ft::random_floats(g, 64);
  REQUIRE(ft::argument_of([&] { ex.attend(huge, floe::query_group::make(q64.data(), 1, 64), std::vector<token_range>{{0, 1}}, p1); }) == "n");

  const ft::random_kv<float> host(g, 100, 64, 64);
  const ft::cuda_kv<float> dev(host, ft::cuda_array<float>::device);
  auto q = ft::random_floats(g, 64 * 4);
  floe::partial_set<float> p(4, 64);
  REQUIRE(ft::argument_of([&] { ex.attend(dev.view(), floe::query_group::make(q.data(), 4, 64), std::vector<token_range>{{90, 101}}, p); }) == "selection");
  q[5] = std::nanf("");
  REQUIRE(ft::argument_of([&] { ex.attend(dev.view(), floe::query_group::make(q.data(), 4, 64), std::vector<token_range>{{0, 100}}, p); }) == "query");
  REQUIRE(p.empty(0));  // nothing merged

  // A NaN in device queries: refused, and the device output keeps its poison.
  device_batch<float> b(g, {300}, floe::gqa_shape{4, 1}, 64);
  b.queries[0][2 * b.q_stride + 7] = std::nanf("");
  ft::cuda_array<float> bad_q(b.queries[0], where::device);
  auto seqs = b.sequences();
  seqs[0].queries = bad_q.data();
  const auto before = b.dout[0]->to_host();
  REQUIRE(ft::argument_of([&] { ex.decode<floe::kv_view<float>>(seqs, b.shape, 0.125f); }) == "sequence.queries");
  const auto after = b.dout[0]->to_host();
  REQUIRE(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0);
  // The same with nothing selected: no chunk is read, the queries are still checked.
  const std::vector<std::vector<token_range>> nothing(1);
  REQUIRE(ft::argument_of([&] { ex.decode_gathered<floe::kv_view<float>>(seqs, b.shape, 0.125f, nothing); }) == "sequence.queries");
  const auto after_empty = b.dout[0]->to_host();
  REQUIRE(std::memcmp(before.data(), after_empty.data(), before.size() * sizeof(float)) == 0);
  REQUIRE(ft::argument_of([&] { ex.decode<floe::kv_view<float>>(seqs, b.shape, 0.f); }) == "scale");
  REQUIRE(ft::argument_of([&] { ex.decode<floe::kv_view<float>>(seqs, floe::gqa_shape{6, 4}, 0.125f); }) == "q_heads");
}
