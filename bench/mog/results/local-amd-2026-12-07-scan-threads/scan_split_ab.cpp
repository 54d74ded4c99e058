// In one process: the MoG token-scan select phase, caches cold, on a serial executor and on a
// 2-thread pool executor, alternating over 60 steps; median / min us. args: g, bits (4|2), budget per mille
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
static std::vector<float> evict(256u << 20);  // 1 GiB
static float sink = 0;
void cold() { float s = 0; for (size_t i = 0; i < evict.size(); i += 16) s += evict[i]; sink += s; }
int main(int argc, char** argv) {
  const index_t g = std::atoi(argv[1]); const int bits = std::atoi(argv[2]); const int pm = std::atoi(argv[3]);
  for (size_t i = 0; i < evict.size(); ++i) evict[i] = float(i & 7);
  testing::synthetic_kv_config cfg; cfg.n = 131072; cfg.kv_heads = 1; cfg.group = g; cfg.queries = 8;
  const auto head = testing::generate_synthetic_head(cfg, 0);
  const index_t d = cfg.d, n = cfg.n;
  std::vector<half> k, v; for (float x : head.keys) k.push_back(half::from_float(x)); for (float x : head.values) v.push_back(half::from_float(x));
  kv_view<half> kv(k.data(), v.data(), n, d, d);
  const auto sel0 = select::mog_clusters::with_budget(budget::fraction(pm / 1000.0), n);
  const mog est(sel0.with_token_scan(bits == 2 ? mog_config::scan_code::residual_2bit : mog_config::scan_code::keys_4bit), {});
  const auto st = est.build(kv);
  thread_pool pool(2);
  const exec::simd one, two(pool);
  select::mog_clusters::selection sel; stats s;
  std::vector<double> t[2];
  for (int i = 0; i < 120; ++i) {
    const int w = (i / 2 + i) % 2;  // ABBA order
    query_group q{head.queries.data() + (i % 8) * d, g, d, 8 * d, 1.f / std::sqrt(float(d))};
    cold();
    if (std::getenv("WAKE")) pool.hook()(2, [](index_t) {});  // the worker spins, as in a busy engine
    const auto t0 = std::chrono::steady_clock::now();
    if (w == 0) est.selector().select(st.selector_index, kv, q, one, sel, s);
    else est.selector().select(st.selector_index, kv, q, two, sel, s);
    t[w].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  for (int w = 0; w < 2; ++w) { std::sort(t[w].begin(), t[w].end());
    std::printf("g %ld bits %d budget %d, %s: median %.0f min %.0f us\n", (long)g, bits, pm, w ? "2 threads" : "1 thread ", t[w][t[w].size()/2], t[w][0]); }
  return sink == 12345.f;
}
