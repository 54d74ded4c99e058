// In one process, caches cold, alternating: dense and MoG (token scan) whole decode steps on a
// serial executor and on a 2-thread pool executor (the worker woken first). args: g, bits, budget per mille
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "floe/core/huge_page_allocator.hpp"
using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
using dense = estimator<select::dense, residual::none>;
static std::vector<float> evict(256u << 20);
static float sink = 0;
void cold() { float s = 0; for (size_t i = 0; i < evict.size(); i += 16) s += evict[i]; sink += s; }
int main(int argc, char** argv) {
  const index_t g = std::atoi(argv[1]); const int bits = std::atoi(argv[2]); const int pm = std::atoi(argv[3]);
  for (size_t i = 0; i < evict.size(); ++i) evict[i] = float(i & 7);
  testing::synthetic_kv_config cfg; cfg.n = 131072; cfg.kv_heads = 1; cfg.group = g; cfg.queries = 8;
  const auto head = testing::generate_synthetic_head(cfg, 0);
  const index_t d = cfg.d, n = cfg.n;
  std::vector<half, huge_page_allocator<half>> k, v; for (float x : head.keys) k.push_back(half::from_float(x)); for (float x : head.values) v.push_back(half::from_float(x));
  kv_view<half> kv(k.data(), v.data(), n, d, d);
  const auto sel0 = select::mog_clusters::with_budget(budget::fraction(pm / 1000.0), n);
  const mog est(sel0.with_token_scan(bits == 2 ? mog_config::scan_code::residual_2bit : mog_config::scan_code::keys_4bit), {});
  const auto st = est.build(kv);
  const dense de; const auto dst = de.build(kv);
  thread_pool pool(2);
  const exec::simd one, two(pool);
  std::vector<float> out(g * d); stats s;
  std::vector<double> t[4];  // dense 1, dense 2, mog 1, mog 2
  for (int i = 0; i < 160; ++i) {
    const int w = (i + i / 4) % 4;
    query_group q{head.queries.data() + (i % 8) * d, g, d, 8 * d, 1.f / std::sqrt(float(d))};
    cold();
    pool.hook()(2, [](index_t) {});
    const auto t0 = std::chrono::steady_clock::now();
    const exec::simd& e = (w % 2) ? two : one;
    if (w < 2) de.decode(dst, kv, q, e, output_group<float>{out.data(), g, d, 0}, s);
    else est.decode(st, kv, q, e, output_group<float>{out.data(), g, d, 0}, s);
    t[w].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  const char* names[] = {"dense 1 thread ", "dense 2 threads", "mog   1 thread ", "mog   2 threads"};
  double med[4];
  for (int w = 0; w < 4; ++w) { std::sort(t[w].begin(), t[w].end()); med[w] = t[w][t[w].size() / 2];
    std::printf("g %ld %d-bit scan budget %d, %s: median %5.0f min %5.0f us\n", (long)g, bits, pm, names[w], med[w], t[w][0]); }
  std::printf("  x dense (medians): 1 thread %.2f, 2 threads %.2f\n", med[0] / med[2], med[1] / med[3]);
  return sink == 12345.f;
}
