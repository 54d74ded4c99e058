// MoG decode speed against dense decode on floe::exec::simd, in the same run, on the
// synthetic cache (fp16, d = dv = 128): N = 8K ... 512K, one query head per KV head and
// GQA-4, at a 5 % budget and at a fixed 2048-token budget; the per-token-range layout
// against the adopted clustered layout; index build time and memory with 1 and 2 threads;
// append time per token.
// Every decode benchmark runs warm and cold (`_cold`). Cold: between steps, outside
// the timing, a buffer of FLOE_BENCH_COLD_MIB MiB (default 1024; 0 makes cold the same as
// warm) is read, so that a step starts with neither the KV nor the index nor the chosen
// subclusters in the caches (the 260-300 MiB L3 would otherwise hold all of them between
// steps, as it cannot in an engine that steps every layer and head in turn), as
// bench/topk/topk_decode_bench.cpp does. The KV caches (both layouts) sit on transparent
// huge pages, as engines allocate them (FLOE_BENCH_HUGE_PAGES=0: 4 KiB pages).
// mog_phase_cold times the selector, the exact part and the residual of one step apart.
// FLOE_BENCH_THREADS (default 1): threads of the executor every step runs on (dense splits
// over N; MoG splits its exact part and its token scan). FLOE_BENCH_STAGE_ROWS=0 / 1 turns
// simd_options::stage_short_runs off / on (default: the library's).
// docs/methods/mog.md has the command and the figures.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "../support/cold_caches.hpp"
#include "../support/huge_page_allocator.hpp"

namespace {

using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;

// One KV head of the synthetic cache in fp16, its query rows (g heads x steps), and the
// same cache copied into the index's clustered order.
struct head_data {
  index_t n, d, g, steps;
  using kv_rows = std::vector<half, floe::bench::huge_page_allocator<half>>;  // as engines allocate caches
  kv_rows keys, values, keys_clustered, values_clustered;
  std::vector<float> queries;
  kv_view<half> view() const { return {keys.data(), values.data(), n, d, d}; }
  kv_view<half> clustered_view() const { return {keys_clustered.data(), values_clustered.data(), n, d, d}; }
  query_group query(index_t step) const { return {queries.data() + step * d, g, d, steps * d, 1.f / std::sqrt(float(d))}; }
};

const head_data& data(index_t n, index_t g) {
  static std::map<std::pair<index_t, index_t>, std::unique_ptr<head_data>> cache;
  static std::mutex m;
  std::lock_guard lock(m);
  auto& slot = cache[{n, g}];
  if (!slot) {
    testing::synthetic_kv_config cfg;
    cfg.n = n;
    cfg.kv_heads = 1;
    cfg.group = g;
    cfg.queries = 8;
    const auto head = testing::generate_synthetic_head(cfg, 0);
    slot = std::make_unique<head_data>();
    slot->n = n;
    slot->d = cfg.d;
    slot->g = g;
    slot->steps = cfg.queries;
    for (float x : head.keys) slot->keys.push_back(half::from_float(x));
    for (float x : head.values) slot->values.push_back(half::from_float(x));
    slot->queries = head.queries;
  }
  return *slot;
}

const exec::simd& executor() {
  static thread_pool pool([] {
    const char* v = std::getenv("FLOE_BENCH_THREADS");
    return v ? std::max<index_t>(1, std::strtol(v, nullptr, 10)) : index_t{1};
  }());
  static const exec::simd exec([] {
    exec::simd_options opt{simd_arch::automatic, pool.hook(), pool.size()};
    if (const char* v = std::getenv("FLOE_BENCH_STAGE_ROWS")) opt.stage_short_runs = std::strcmp(v, "0") != 0;
    return opt;
  }());
  return exec;
}

// Sets bytes and tokens counters per decode call (one GQA group).
void report(benchmark::State& state, const stats& s, index_t calls, const head_data& h) {
  const double c = static_cast<double>(calls);
  state.counters["bytes_read_frac"] =
      static_cast<double>(s.bytes_read()) / c / static_cast<double>(h.n * 2 * h.d * sizeof(half));
  state.counters["keys_read_frac"] = static_cast<double>(s.tokens_read) / c / static_cast<double>(h.n);
}

// cold: start every step with cold caches.
template <class Est, KvView KV>
void run(benchmark::State& state, const Est& est, const typename Est::state& st, const KV& kv, const head_data& h,
         bool cold) {
  const exec::simd& exec = executor();
  std::vector<float> out(h.g * h.d);
  stats s;
  index_t calls = 0;
  for (auto _ : state) {
    if (cold) floe::bench::start_cold(state);
    est.decode(st, kv, h.query(calls % h.steps), exec, output_group<float>{out.data(), h.g, h.d, 0}, s);
    benchmark::DoNotOptimize(out.data());
    ++calls;
  }
  report(state, s, calls, h);
  state.counters["threads"] = static_cast<double>(exec.concurrency());
  state.counters["cold_MiB"] = cold ? static_cast<double>(floe::bench::cold_mib()) : 0.0;
}

// args: n, g
template <bool cold>
void dense_decode(benchmark::State& state) {
  const auto& h = data(state.range(0), state.range(1));
  const estimator<select::dense, residual::none> est;
  run(state, est, est.build(h.view()), h.view(), h, cold);
}

// args: n, g, budget (tokens if > 1, else per mille of n); scan_bits 4 or 2: the token
// scan by 4-bit keys or 2-bit codes (mog_config::scan_code), 0: none.
mog make_mog(const head_data& h, std::int64_t budget_arg, std::int64_t scan_bits = 0) {
  const budget b = budget_arg > 1000 ? budget::tokens(static_cast<index_t>(budget_arg))
                                     : budget::fraction(static_cast<double>(budget_arg) / 1000.0);
  const auto sel = select::mog_clusters::with_budget(b, h.n);
  if (scan_bits == 0) return mog(sel, {});
  return mog(sel.with_token_scan(scan_bits == 2 ? mog_config::scan_code::residual_2bit : mog_config::scan_code::keys_4bit), {});
}

const mog::state& mog_state(const head_data& h, const mog& est, bool clustered) {
  static std::map<std::tuple<const head_data*, index_t, index_t, bool, bool, mog_config::scan_code>, std::unique_ptr<mog::state>> cache;
  static std::mutex m;
  std::lock_guard lock(m);
  const auto& cfg = est.selector().config;
  auto& slot = cache[{&h, cfg.window, cfg.sinks, clustered, cfg.token_scan, cfg.token_scan_code}];
  if (!slot) {
    slot = std::make_unique<mog::state>(est.build(h.view()));
    if (clustered) {  // copy the cache into the clustered order and adopt it
      auto& mh = const_cast<head_data&>(h);
      const auto order = slot->selector_index.clustered_order();
      mh.keys_clustered = h.keys;
      mh.values_clustered = h.values;
      for (index_t p = 0; p < order.size(); ++p) {
        std::copy_n(h.keys.begin() + order[p] * h.d, h.d, mh.keys_clustered.begin() + p * h.d);
        std::copy_n(h.values.begin() + order[p] * h.d, h.d, mh.values_clustered.begin() + p * h.d);
      }
      slot->selector_index.adopt_clustered_order();
    }
  }
  return *slot;
}

template <bool cold>
void mog_decode(benchmark::State& state) {
  const auto& h = data(state.range(0), state.range(1));
  const mog est = make_mog(h, state.range(2));
  const auto& st = mog_state(h, est, false);
  run(state, est, st, h.view(), h, cold);
  state.counters["index_bytes_frac"] = static_cast<double>(st.bytes()) / static_cast<double>(h.n * 2 * h.d * sizeof(half));
}

template <bool cold>
void mog_decode_clustered_layout(benchmark::State& state) {
  const auto& h = data(state.range(0), state.range(1));
  const mog est = make_mog(h, state.range(2));
  const auto& st = mog_state(h, est, true);
  run(state, est, st, h.clustered_view(), h, cold);
}

// args: n, g, budget, clustered (0/1), bits (4: 4-bit keys of the clustered tokens, refine 8;
// 2: 2-bit standardised codes, refine 16): mog_config::token_scan in either layout. The scan
// reads about as many bytes again as the exact part: budget 25 (2.5 %) reads about 5 %.
template <bool cold>
void mog_decode_token_scan(benchmark::State& state) {
  const auto& h = data(state.range(0), state.range(1));
  const mog est = make_mog(h, state.range(2), state.range(4));
  const bool clustered = state.range(3) != 0;
  const auto& st = mog_state(h, est, clustered);
  run(state, est, st, clustered ? h.clustered_view() : h.view(), h, cold);
  state.counters["index_bytes_frac"] = static_cast<double>(st.bytes()) / static_cast<double>(h.n * 2 * h.d * sizeof(half));
}

// args: n, g, clustered (0/1), phase (0 select, 1 attend, 2 residual), budget (as
// mog_decode's). The three parts of one cold step timed apart: each starts cold, the other
// parts' results come from a step outside the timing, so they add up to about one
// mog_decode_cold step. With a fixed token budget the exact part stays put as N grows and
// selection plus residual show the summaries' growth (sqrt(N) log N). scan_bits 4 / 2: the
// same with mog_config::token_scan by 4-bit keys (mog_phase_token_scan_cold) or 2-bit codes
// (mog_phase_token_scan2_cold).
template <int scan_bits>
void mog_phase_cold(benchmark::State& state) {
  const auto& h = data(state.range(0), state.range(1));
  const mog est = make_mog(h, state.range(4), scan_bits);
  const bool clustered = state.range(2) != 0;
  const auto& st = mog_state(h, est, clustered);
  const kv_view<half> kv = clustered ? h.clustered_view() : h.view();
  const exec::simd& exec = executor();
  select::mog_clusters::selection sel;
  stats s;
  index_t calls = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const query_group q = h.query(calls++ % h.steps);
    est.selector().select(st.selector_index, kv, q, exec, sel, s);
    partial_set<float> parts(q.heads, kv.dv());
    if (state.range(3) == 2) exec.attend(kv, q, sel.ranges, parts);
    state.ResumeTiming();
    floe::bench::start_cold(state);
    switch (state.range(3)) {
      case 0: est.selector().select(st.selector_index, kv, q, exec, sel, s); break;
      case 1: exec.attend(kv, q, sel.ranges, parts); break;
      default: est.residual().estimate(st.residual_index, kv, q, sel, exec, parts, s);
    }
    benchmark::DoNotOptimize(parts.l(0));
  }
  static constexpr const char* names[] = {"select", "attend", "residual"};
  state.SetLabel(names[state.range(3)]);
}

// args: n, threads
void mog_build(benchmark::State& state) {
  const auto& h = data(state.range(0), 1);
  thread_pool pool(static_cast<index_t>(state.range(1)));
  const auto cfg = select::mog_clusters::with_budget(budget::fraction(0.05), h.n).config;
  std::uint64_t bytes = 0;
  for (auto _ : state) {
    const auto idx = mog_index::build(h.view(), cfg, pool.hook());
    bytes = idx.bytes();
    benchmark::DoNotOptimize(bytes);
  }
  state.counters["index_bytes_frac"] = static_cast<double>(bytes) / static_cast<double>(h.n * 2 * h.d * sizeof(half));
}

// args: n, appended tokens. Builds on the first n - appended tokens (not timed), then appends
// the rest one decode step at a time; the time is per appended token.
void mog_append(benchmark::State& state) {
  const auto& h = data(state.range(0), 1);
  const auto appended = static_cast<index_t>(state.range(1));
  const auto cfg = select::mog_clusters::with_budget(budget::fraction(0.05), h.n).config;
  for (auto _ : state) {
    state.PauseTiming();
    auto idx = mog_index::build(kv_view<half>(h.keys.data(), h.values.data(), h.n - appended, h.d, h.d), cfg);
    state.ResumeTiming();
    for (index_t n = h.n - appended + 1; n <= h.n; ++n) idx.append(kv_view<half>(h.keys.data(), h.values.data(), n, h.d, h.d));
    benchmark::DoNotOptimize(idx.tokens());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(1));
}

void shapes(benchmark::internal::Benchmark* b, bool with_budget) {
  for (std::int64_t n : {8192, 32768, 131072, 524288})
    for (std::int64_t g : {1, 4}) {
      if (!with_budget) b->Args({n, g});
      else
        for (std::int64_t budget : {50, 2048}) b->Args({n, g, budget});  // 5 % of n; 2048 tokens
    }
}

}  // namespace

// Warm runs take at least 0.5 s of timed work; cold ones a fixed 64 steps, since each step
// also reads the eviction buffer (about 0.1 s per GiB) outside the timing.
BENCHMARK(dense_decode<false>)->Name("dense_decode")->Apply([](auto* b) { shapes(b, false); })->Unit(benchmark::kMicrosecond)->MinTime(0.5);
BENCHMARK(dense_decode<true>)->Name("dense_decode_cold")->Apply([](auto* b) { shapes(b, false); })->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_decode<false>)->Name("mog_decode")->Apply([](auto* b) { shapes(b, true); })->Unit(benchmark::kMicrosecond)->MinTime(0.5);
BENCHMARK(mog_decode<true>)->Name("mog_decode_cold")->Apply([](auto* b) { shapes(b, true); })->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_decode_clustered_layout<false>)->Name("mog_decode_clustered_layout")->Apply([](auto* b) { shapes(b, true); })
    ->Unit(benchmark::kMicrosecond)->MinTime(0.5);
BENCHMARK(mog_decode_clustered_layout<true>)->Name("mog_decode_clustered_layout_cold")->Apply([](auto* b) { shapes(b, true); })
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_decode_token_scan<true>)->Name("mog_decode_token_scan_cold")->ArgsProduct({{131072}, {1, 4}, {25, 50}, {0, 1}, {4, 2}})
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_phase_cold<0>)->Name("mog_phase_cold")->ArgsProduct({{131072}, {1, 4}, {0, 1}, {0, 1, 2}, {50}})
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_phase_cold<4>)->Name("mog_phase_token_scan_cold")->ArgsProduct({{131072}, {1, 4}, {0, 1}, {0, 1, 2}, {25, 50}})
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_phase_cold<2>)->Name("mog_phase_token_scan2_cold")->ArgsProduct({{131072}, {1, 4}, {0, 1}, {0, 1, 2}, {25, 50}})
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_phase_cold<0>)->Name("mog_phase_cold")->ArgsProduct({{8192, 32768, 131072, 524288}, {1, 4}, {1}, {0, 1, 2}, {2048}})
    ->Unit(benchmark::kMicrosecond)->Iterations(64);
BENCHMARK(mog_build)->Args({131072, 1})->Args({131072, 2})->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK(mog_append)->Args({32768, 4096})->Args({131072, 16384})->Unit(benchmark::kMillisecond)->Iterations(1);

BENCHMARK_MAIN();
