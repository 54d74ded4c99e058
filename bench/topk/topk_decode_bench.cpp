// Decode-step speed of topk_anchors (+none, +feature_map), exp_threshold and anchor_reuse
// against dense decode, in the same run, on floe::exec::simd: N tokens (default 128K), d = dv = 128, fp16 KV, GQA
// group g = 4, 8 KV heads (512 MiB of KV at 128K, more than the last-level cache).
// One iteration = one decode step of every KV head; KV heads run on FLOE_BENCH_THREADS
// threads (default 1), each head's step on one thread, for dense and topk alike.
// Environment: FLOE_BENCH_N, FLOE_BENCH_KV_HEADS, FLOE_BENCH_GQA, FLOE_BENCH_THREADS,
// FLOE_BENCH_HUGE_PAGES (default 1: the KV cache on transparent huge pages),
// FLOE_BENCH_COLD_MIB (default 1024: between steps, outside the timing, a buffer of this
// many MiB is read so that the step starts with no KV, index or selection in the caches,
// as in an engine that steps every layer in turn; 0 keeps them warm).
// model_step times a whole model's step over FLOE_BENCH_LAYERS layers (default 30) of
// FLOE_BENCH_MODEL_N tokens (default 32K) each: dense against anchor_reuse.
// docs/methods/retrieval-completion.md, "speed"; docs/methods/anchor-reuse.md, "Speed".
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <memory>
#include <random>
#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "floe/residual/cluster_map.hpp"
#include "floe/residual/feature_map.hpp"
#include "floe/residual/horvitz_thompson.hpp"
#include "floe/residual/none.hpp"
#include "floe/residual/scan_completion.hpp"
#include "floe/select/anchor_reuse.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/exp_threshold.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "../support/huge_page_allocator.hpp"
#include "../support/cold_caches.hpp"

namespace {
using floe::index_t;

index_t env_or(const char* name, index_t fallback) {
  const char* v = std::getenv(name);
  return v ? static_cast<index_t>(std::strtoull(v, nullptr, 10)) : fallback;
}

// The KV cache of every head and the queries of one step, built once.
struct workload {
  index_t n = env_or("FLOE_BENCH_N", 131072), d = 128, dv = 128, g = env_or("FLOE_BENCH_GQA", 4),
          heads = env_or("FLOE_BENCH_KV_HEADS", 8);
  std::vector<std::vector<floe::half, floe::bench::huge_page_allocator<floe::half>>> keys, values;
  std::vector<float> queries;

  workload() {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> normal(0.f, 1.f);
    keys.resize(heads);
    values.resize(heads);
    for (index_t h = 0; h < heads; ++h) {
      keys[h].resize(n * d);
      values[h].resize(n * dv);
      for (auto& x : keys[h]) x = floe::half::from_float(normal(rng));
      for (auto& x : values[h]) x = floe::half::from_float(normal(rng));
    }
    queries.resize(heads * g * d);
    for (auto& x : queries) x = 1.5f * normal(rng);
  }
  floe::kv_view<floe::half> kv(index_t h) const { return {keys[h].data(), values[h].data(), n, d, dv}; }
  floe::query_group q(index_t h) const { return floe::query_group::make(queries.data() + h * g * d, g, d); }
};

const workload& data() {
  static const workload w;
  return w;
}

floe::thread_pool& pool() {
  static floe::thread_pool p(env_or("FLOE_BENCH_THREADS", 1));
  return p;
}

// Runs decode steps over every KV head, head h with est_of(h); the states are built
// outside the timing.
template <class EstOf>
void run_heads(benchmark::State& bench, EstOf est_of) {
  const workload& w = data();
  const floe::exec::simd exec;
  using Est = decltype(est_of(index_t{0}));
  std::vector<Est> ests;
  std::vector<typename Est::state> states;
  for (index_t h = 0; h < w.heads; ++h) {
    ests.push_back(est_of(h));
    states.push_back(ests.back().build(w.kv(h)));
  }
  std::vector<float> out(w.heads * w.g * w.dv);
  std::vector<floe::stats> io(w.heads);
  for (auto _ : bench) {
    floe::bench::start_cold(bench);
    pool().parallel_for(w.heads, [&](index_t h) {
      ests[h].decode(states[h], w.kv(h), w.q(h), exec,
                     floe::output_group<float>{out.data() + h * w.g * w.dv, w.g, w.dv, 0}, io[h]);
    });
    benchmark::DoNotOptimize(out.data());
  }
  floe::stats all;
  for (const auto& s : io) all += s;
  const double steps = static_cast<double>(bench.iterations());
  bench.counters["MiB_read_per_step"] = static_cast<double>(all.bytes_read()) / steps / (1 << 20);
  bench.counters["exact_tokens_per_head"] = static_cast<double>(all.tokens_read) / steps / static_cast<double>(w.heads);
  bench.counters["index_MiB_per_head"] = static_cast<double>(states[0].bytes()) / (1 << 20);
  bench.SetLabel(std::string(exec.name) + " arch " + std::to_string(static_cast<int>(exec.arch())) + ", " +
                 std::to_string(pool().size()) + " thread(s)");
}

template <class Est>
void run(benchmark::State& bench, const Est& est) {
  run_heads(bench, [&](index_t) { return est; });
}

// topk_anchors reading 5 % of the cache exactly: 4 sinks, a 64-token window, the rest Top-K;
// 4-bit keys in blocks of `block_dims` elements.
floe::select::topk_anchors<floe::select::quantized_scan> five_percent(index_t n, index_t block_dims = 32) {
  const index_t total = n / 20;
  floe::select::topk_anchors<floe::select::quantized_scan> s{4, 64, floe::budget::tokens(total - 68), {}};
  s.scorer.block_dims = block_dims;
  return s;
}

void dense(benchmark::State& s) { run(s, floe::estimator<floe::select::dense, floe::residual::none>{}); }

void topk_quantized_none(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  run(s, floe::estimator<sel, floe::residual::none>(five_percent(data().n), {}));
}

// Arg 0: M; arg 1 (where given): 1 caches each token's features (no key projection at decode).
floe::residual::feature_map<> feature_map_of(const benchmark::State& s) {
  floe::residual::feature_map<> fm;
  fm.map.features = static_cast<index_t>(s.range(0));
  fm.cache_token_features = s.range(1) != 0;
  return fm;
}

void topk_quantized_feature_map(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  run(s, floe::estimator<sel, floe::residual::feature_map<>>(five_percent(data().n), feature_map_of(s)));
}
// The same chosen by estimate (no re-rank): the topk_anchors+feature_map with
// quantized_scan at its cheapest selection. Arg 2: the 4-bit block (elements).
void topk_quantized_by_estimate_feature_map(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  auto chooser = five_percent(data().n, s.range(2));
  chooser.scorer.rerank_factor = 1.0;
  run(s, floe::estimator<sel, floe::residual::feature_map<>>(chooser, feature_map_of(s)));
}
// The k best by estimate (blocks of arg 1 elements) completed by the cluster map of arg 0
// clusters.
void topk_quantized_by_estimate_clusters(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  auto chooser = five_percent(data().n, s.range(1));
  chooser.scorer.rerank_factor = 1.0;
  run(s, floe::estimator<sel, floe::residual::cluster_map>(chooser, {static_cast<index_t>(s.range(0))}));
}
// The same with no re-rank: the k best by 4-bit estimate, no exact keys read to choose.
// Arg: the 4-bit block (elements).
void topk_quantized_none_by_estimate(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  auto chooser = five_percent(data().n, s.range(0));
  chooser.scorer.rerank_factor = 1.0;
  run(s, floe::estimator<sel, floe::residual::none>(chooser, {}));
}

void topk_quantized_scan_completion(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  run(s, floe::estimator<sel, floe::residual::scan_completion>(five_percent(data().n), {}));
}
// The k best by estimate completed from the same estimates: value tier = arg 0 / 100,
// value sketch of arg 1 directions.
void topk_quantized_by_estimate_scan_completion(benchmark::State& s) {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  auto chooser = five_percent(data().n);
  chooser.scorer.rerank_factor = 1.0;
  run(s, floe::estimator<sel, floe::residual::scan_completion>(
             chooser, {static_cast<double>(s.range(0)) / 100, static_cast<index_t>(s.range(1))}));
}
// The phases of one topk_anchors<quantized_scan>+feature_map step, timed apart over the
// same heads: choosing (4-bit scan, bounds, re-rank), attending the chosen tokens, and
// the feature-map estimate.
struct phases {
  using sel = floe::select::topk_anchors<floe::select::quantized_scan>;
  sel selector = five_percent(data().n);
  floe::residual::feature_map<> residual{{64}}, cached{{64}, 0.f, true};
  std::vector<sel::index> sidx, sidx64;  // 4-bit keys in blocks of 32 (the default) and of 64
  std::vector<floe::feature_map_summary> ridx, ridx_cached;
  std::vector<sel::selection> chosen;
  phases() {
    const workload& w = data();
    floe::stats io;
    for (index_t h = 0; h < w.heads; ++h) {
      sidx.push_back(selector.build(w.kv(h)));
      sidx64.push_back(floe::quantized_keys::build(w.kv(h), 64));
      ridx.push_back(residual.build(w.kv(h), selector, sidx.back()));
      ridx_cached.push_back(cached.build(w.kv(h), selector, sidx.back()));
      chosen.emplace_back();
      selector.select(sidx[h], w.kv(h), w.q(h), floe::exec::simd{}, chosen[h], io);
    }
  }
};
const phases& phase_data() {
  static const phases p;
  return p;
}

void phase_select(benchmark::State& s) {
  const auto& p = phase_data();
  const workload& w = data();
  std::vector<phases::sel::selection> out(w.heads);
  std::vector<floe::stats> io(w.heads);
  for (auto _ : s) {
    floe::bench::start_cold(s);
    pool().parallel_for(w.heads, [&](index_t h) { p.selector.select(p.sidx[h], w.kv(h), w.q(h), floe::exec::simd{}, out[h], io[h]); });
  }
}

// Choosing by estimate (rerank_factor = 1, the cheapest selection), and its first
// part alone: the 4-bit scan of the middle with each head's maximum, no bounds. Arg: the
// 4-bit block (32 or 64 elements).
void phase_select_by_estimate(benchmark::State& s) {
  const auto& p = phase_data();
  const workload& w = data();
  const auto& sidx = s.range(0) == 64 ? p.sidx64 : p.sidx;
  auto chooser = p.selector;
  chooser.scorer.rerank_factor = 1.0;
  chooser.scorer.block_dims = s.range(0);
  std::vector<phases::sel::selection> out(w.heads);
  std::vector<floe::stats> io(w.heads);
  for (auto _ : s) {
    floe::bench::start_cold(s);
    pool().parallel_for(w.heads, [&](index_t h) { chooser.select(sidx[h], w.kv(h), w.q(h), floe::exec::simd{}, out[h], io[h]); });
  }
}

void phase_scan(benchmark::State& s) {
  const auto& p = phase_data();
  const workload& w = data();
  const auto& sidx = s.range(0) == 64 ? p.sidx64 : p.sidx;
  std::vector<std::vector<float>> estimates(w.heads), maxima(w.heads, std::vector<float>(w.g));
  for (auto _ : s) {
    floe::bench::start_cold(s);
    pool().parallel_for(w.heads, [&](index_t h) {
      const floe::token_range mid = p.selector.middle(w.n, sidx[h]);
      estimates[h].resize(w.g * mid.size());
      sidx[h].scan(sidx[h].prepare(w.q(h)), mid.begin, mid.end, estimates[h].data(), nullptr, mid.size(),
                     floe::scan_kernel::automatic, maxima[h].data());
      benchmark::DoNotOptimize(maxima[h].data());
    });
  }
}

void phase_attend(benchmark::State& s) {
  const auto& p = phase_data();
  const workload& w = data();
  const floe::exec::simd exec;
  for (auto _ : s) {
    floe::bench::start_cold(s);
    pool().parallel_for(w.heads, [&](index_t h) {
      floe::partial_set<float> parts(w.g, w.dv);
      exec.attend(w.kv(h), w.q(h), p.chosen[h].ranges, parts);
      benchmark::DoNotOptimize(parts.l(0));
    });
  }
}

// Arg 1 caches each token's features.
void phase_feature_map(benchmark::State& s) {
  const auto& p = phase_data();
  const workload& w = data();
  const bool cached = s.range(0) != 0;
  std::vector<floe::stats> io(w.heads);
  for (auto _ : s) {
    floe::bench::start_cold(s);
    pool().parallel_for(w.heads, [&](index_t h) {
      floe::partial_set<float> parts(w.g, w.dv);
      (cached ? p.cached : p.residual)
          .estimate((cached ? p.ridx_cached : p.ridx)[h], w.kv(h), w.q(h), p.chosen[h], floe::exec::simd{}, parts, io[h]);
      benchmark::DoNotOptimize(parts.l(0));
    });
  }
}

// Fixed costs of a step, apart: ranking::top_k as choosing by estimate calls it (k = 5 %
// of 127K normal keys, seed 1, warm), and constructing an executor (CPU detection).
void ranking_top_k(benchmark::State& s) {
  const index_t n = 126976, k = n / 20;
  std::vector<float> keys(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (float& x : keys) x = normal(rng);
  for (auto _ : s) benchmark::DoNotOptimize(floe::select::ranking::top_k(keys.data(), n, k).data());
}
void construct_executor(benchmark::State& s) {
  for (auto _ : s) {
    const floe::exec::simd exec;
    benchmark::DoNotOptimize(&exec);
  }
}
}  // namespace

BENCHMARK(ranking_top_k)->Unit(benchmark::kMicrosecond);
BENCHMARK(construct_executor)->Unit(benchmark::kMicrosecond);
BENCHMARK(phase_select)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(phase_select_by_estimate)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(phase_scan)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(phase_attend)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(phase_feature_map)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(dense)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_none)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_none_by_estimate)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_scan_completion)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_by_estimate_scan_completion)
    ->Args({50, 0})->Args({200, 0})->Args({50, 8})->Args({200, 8})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_feature_map)
    ->Args({32, 0})->Args({64, 0})->Args({128, 0})->Args({256, 0})->Args({64, 1})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_by_estimate_feature_map)->Args({64, 0, 32})->Args({64, 1, 32})->Args({64, 1, 64})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(topk_quantized_by_estimate_clusters)->Args({64, 64})->Args({256, 64})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(dense)->Unit(benchmark::kMillisecond)->UseRealTime();  // again: drift check

// exp_threshold + Horvitz-Thompson with at most 5 % of the cache sampled: arg 0, with the
// exact weights; 1, stopping at the first level certified to 10 % within that cap; 2,
// sampled with the 4-bit estimates' weights.
void exp_threshold_ht(benchmark::State& s) {
  const index_t cap = data().n / 20;
  auto sel = s.range(0) == 1 ? floe::select::exp_threshold::certified(0.1, cap) : floe::select::exp_threshold::with_budget(cap);
  sel.exact_weights = s.range(0) != 2;
  run(s, floe::estimator<floe::select::exp_threshold, floe::residual::horvitz_thompson>(sel, {}));
}
BENCHMARK(exp_threshold_ht)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(dense)->Unit(benchmark::kMillisecond)->UseRealTime();  // and again after it

// anchor_reuse (Kascade) attending 5 % of the cache: arg 0, an anchor layer's step (scores
// every key, top k of the group's weights); arg 1, a reuse layer's step (attends the set an
// anchor step chose before the timing). A model's step costs m anchor and L - m reuse steps.
void anchor_reuse(benchmark::State& s) {
  const index_t k = data().n / 20, heads = data().heads;
  const auto store = std::make_shared<floe::select::anchor_store>(floe::select::anchor_plan::from_anchors(2, heads, {0}));
  const floe::select::anchor_reuse proto{k, store};
  using est = floe::estimator<floe::select::anchor_reuse, floe::residual::none>;
  if (s.range(0) == 1) {  // fill the store: one anchor step on every head
    std::vector<float> out(data().g * data().dv);
    floe::stats io;
    for (index_t h = 0; h < heads; ++h) {
      const est anchor(proto.at(0, h), {});
      anchor.decode(anchor.build(data().kv(h)), data().kv(h), data().q(h), floe::exec::simd{},
                    floe::output_group<float>{out.data(), data().g, data().dv, 0}, io);
    }
  }
  const index_t layer = static_cast<index_t>(s.range(0));
  run_heads(s, [&](index_t h) { return est(proto.at(layer, h), {}); });
}
BENCHMARK(anchor_reuse)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(dense)->Unit(benchmark::kMillisecond)->UseRealTime();  // and again after it

// A whole model's decode step: FLOE_BENCH_LAYERS layers (30, SmolLM2-135M's count) of their
// own caches of FLOE_BENCH_MODEL_N tokens (32K: 30 x 8 heads of fp16 is 3.75 GiB, so each
// layer's cache comes from DRAM, as in an engine), the layers in order, each layer's heads
// on the pool. Built on first use (a few seconds), only if a model_step case runs.
struct model_workload {
  index_t layers = env_or("FLOE_BENCH_LAYERS", 30), n = env_or("FLOE_BENCH_MODEL_N", 32768), d = 128, dv = 128,
          g = env_or("FLOE_BENCH_GQA", 4), heads = env_or("FLOE_BENCH_KV_HEADS", 8);
  std::vector<std::vector<floe::half, floe::bench::huge_page_allocator<floe::half>>> keys, values;  // [layer][head]
  std::vector<float> queries;                                                                       // [layer][head][g][d]

  model_workload() {
    // Normal samples from a table indexed by a cheap generator: billions of elements.
    std::mt19937_64 rng(43);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<floe::half> table(4096);
    for (auto& x : table) x = floe::half::from_float(normal(rng));
    std::uint64_t state = 0x9e3779b97f4a7c15ULL;
    const auto fill = [&](auto& v, index_t count) {
      v.resize(count);
      for (auto& x : v) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        x = table[state >> 52];
      }
    };
    keys.resize(layers * heads);
    values.resize(layers * heads);
    for (index_t s = 0; s < layers * heads; ++s) fill(keys[s], n * d), fill(values[s], n * dv);
    queries.resize(layers * heads * g * d);
    for (auto& x : queries) x = 1.5f * normal(rng);
  }
  floe::kv_view<floe::half> kv(index_t l, index_t h) const {
    return {keys[l * heads + h].data(), values[l * heads + h].data(), n, d, dv};
  }
  floe::query_group q(index_t l, index_t h) const {
    return floe::query_group::make(queries.data() + (l * heads + h) * g * d, g, d);
  }
};

// Arg 0: dense in every layer. Arg m > 0: anchor_reuse at 5 % exact with layer 0 dense and
// the m anchors of SmolLM2's calibrated plan (docs/methods/anchor-reuse.md; m = 3 or 8),
// spread over the layers in proportion when FLOE_BENCH_LAYERS is not 30.
void model_step(benchmark::State& s) {
  static const model_workload w;
  const auto m = static_cast<index_t>(s.range(0));
  if (m > 0 && w.layers < 2) {
    s.SkipWithError("anchor_reuse here needs FLOE_BENCH_LAYERS >= 2 (layer 0 is dense)");
    return;
  }
  using est = floe::any_estimator<floe::exec::simd>;
  std::vector<est> ests;
  if (m == 0) {
    for (index_t i = 0; i < w.layers * w.heads; ++i)
      ests.push_back(est::from("dense", [](index_t) {
        return floe::estimator<floe::select::dense, floe::residual::none>{};
      }));
  } else {
    std::vector<index_t> anchors =
        m == 3 ? std::vector<index_t>{1, 3, 21} : std::vector<index_t>{1, 2, 3, 14, 17, 20, 21, 28};
    for (auto& a : anchors) a = std::max<index_t>(1, std::min<index_t>(w.layers - 1, a * w.layers / 30));
    anchors.erase(std::unique(anchors.begin(), anchors.end()), anchors.end());
    const auto plan = floe::select::anchor_plan::from_anchors(w.layers, w.heads, anchors, {0});
    const floe::select::anchor_reuse proto{w.n / 20, std::make_shared<floe::select::anchor_store>(plan)};
    for (index_t l = 0; l < w.layers; ++l)
      for (index_t h = 0; h < w.heads; ++h)
        ests.push_back(est::from("anchor_reuse", [slot = proto.at(l, h)](index_t) {
          return floe::estimator<floe::select::anchor_reuse, floe::residual::none>(slot, {});
        }));
  }
  std::vector<est::state> states;
  for (index_t l = 0; l < w.layers; ++l)
    for (index_t h = 0; h < w.heads; ++h) states.push_back(ests[l * w.heads + h].build(w.kv(l, h)));
  const floe::exec::simd exec;
  std::vector<float> out(w.heads * w.g * w.dv);
  std::vector<floe::stats> io(w.heads);
  for (auto _ : s)
    for (index_t l = 0; l < w.layers; ++l)
      pool().parallel_for(w.heads, [&](index_t h) {
        ests[l * w.heads + h].decode(states[l * w.heads + h], w.kv(l, h), w.q(l, h), exec,
                                     floe::output_group<float>{out.data() + h * w.g * w.dv, w.g, w.dv, 0}, io[h]);
      });
  floe::stats all;
  for (const auto& x : io) all += x;
  const double steps = static_cast<double>(s.iterations());
  s.counters["MiB_read_per_step"] = static_cast<double>(all.bytes_read()) / steps / (1 << 20);
  s.counters["KV_MiB"] = static_cast<double>(w.layers * w.heads * w.n * (w.d + w.dv) * 2) / (1 << 20);
  s.SetLabel(std::to_string(w.layers) + " layers, " + std::to_string(w.n) + " tokens, " +
             std::to_string(pool().size()) + " thread(s)");
}
BENCHMARK(model_step)->Arg(0)->Arg(8)->Arg(3)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
