// The checks of the conformance suite, shared by every executor's conformance test
// (tests/conformance for the CPU executors, cuda/tests for the CUDA one).
#pragma once

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include "floe/floe.hpp"
#include "support/random_kv.hpp"
#include "support/reference.hpp"

namespace floe::conformance {
using floe::testing::dense_reference;
using floe::testing::relative_l2;

// One case: a GQA group of 4 query heads drawn for `kv`, the estimator `make` gives for
// it, and that estimator's state built on `kv`.
template <class Make, floe::KvView KV>
struct trial {
  static constexpr std::size_t heads = 4;
  std::vector<float> qd;
  floe::query_group q;
  std::invoke_result_t<const Make&, std::size_t> est;
  typename decltype(est)::state state;
  trial(const Make& make, const KV& kv, std::mt19937_64& g)
      : qd(floe::testing::random_floats(g, heads * kv.d(), 2.f)),
        q(floe::query_group::make(qd.data(), heads, kv.d())),
        est(make(kv.n())),
        state(est.build(kv)) {}
  // The output of one decode on `exec`, poisoned with NaN before.
  template <class Exec>
  std::vector<float> decode(const KV& kv, const Exec& exec, floe::stats& s) const {
    std::vector<float> out(heads * kv.dv(), std::nanf(""));
    est.decode(state, kv, q, exec, floe::output_group<float>{out.data(), heads, kv.dv(), 0}, s);
    return out;
  }
};

template <class Make, class Exec, floe::KvView KV>
void check_full_budget(const Make& make, const Exec& exec, const KV& kv, std::mt19937_64& g) {
  const trial<Make, KV> t(make, kv, g);
  const auto& est = t.est;
  const auto& state = t.state;
  const std::size_t heads = t.heads;
  INFO("estimator " << est.name() << " on " << Exec::name);
  floe::stats s;
  const std::vector<float> out = t.decode(kv, exec, s);
  const auto want = dense_reference(kv, t.q);
  // The reference accumulates in double, exec::simd and exec::cuda in float (issue 3's tolerance).
  const double tolerance = std::is_same_v<Exec, floe::exec::scalar> ? 1e-6 : 1e-5;
  for (std::size_t h = 0; h < heads; ++h)
    REQUIRE(relative_l2(out.data() + h * kv.dv(), want.data() + h * kv.dv(), kv.dv()) <= tolerance);
  REQUIRE(s.tokens_read == kv.n());
  REQUIRE(s.tokens_total == kv.n());
  REQUIRE(s.value_bytes == kv.n() * kv.dv() * sizeof(typename KV::element_type));
  REQUIRE(s.key_bytes >= kv.n() * kv.d() * sizeof(typename KV::element_type));

  // Bad input: a NaN query is refused and the output keeps its poison.
  auto bad = t.qd;
  bad[1] = std::nanf("");
  std::vector<float> untouched(heads * kv.dv(), -3.f);
  REQUIRE_THROWS_AS(est.decode(state, kv, floe::query_group::make(bad.data(), heads, kv.d()), exec,
                               floe::output_group<float>{untouched.data(), heads, kv.dv(), 0}, s),
                    floe::invalid_argument);
  REQUIRE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return x == -3.f; }));
}

// At a partial budget, `exec` must give what the scalar reference gives with the same
// estimator and state: the same output (to float accumulation) and the same reads. A
// selector that ranks by executor-computed scores may break a near-tie the other way;
// only then, when the two selections differ, may the outputs differ.
template <class Make, class Exec, floe::KvView KV>
void check_against_reference(const Make& make, const Exec& exec, const KV& kv, std::mt19937_64& g) {
  const trial<Make, KV> t(make, kv, g);
  const auto& est = t.est;
  const std::size_t heads = t.heads;
  INFO("estimator " << est.name() << " on " << Exec::name);
  floe::stats got_stats, want_stats;
  const std::vector<float> got = t.decode(kv, exec, got_stats), want = t.decode(kv, floe::exec::scalar{}, want_stats);
  REQUIRE(std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); }));
  const std::vector<double> reference(want.begin(), want.end());
  double worst = 0;
  for (std::size_t h = 0; h < heads; ++h)
    worst = std::max(worst, relative_l2(got.data() + h * kv.dv(), reference.data() + h * kv.dv(), kv.dv()));
  typename std::remove_cvref_t<decltype(est.selector())>::selection chosen, chosen_by_reference;
  floe::stats ignored;
  est.selector().select(t.state.selector_index, kv, t.q, exec, chosen, ignored);
  est.selector().select(t.state.selector_index, kv, t.q, floe::exec::scalar{}, chosen_by_reference, ignored);
  if (chosen.ranges != chosen_by_reference.ranges) {
    WARN("a near-tie was broken differently: relative error " << worst);
    return;
  }
  REQUIRE(worst <= 1e-5);
  REQUIRE(got_stats.tokens_read == want_stats.tokens_read);
  REQUIRE(got_stats.bytes_read() == want_stats.bytes_read());
  REQUIRE(got_stats.tokens_read < kv.n());  // the budget is partial: something was estimated or dropped
}

}  // namespace floe::conformance
