// In one process, caches cold (a 1 GiB read before each step), on exec::simd serial and on a
// 2-thread pool, alternating. Args: mode, g, bits (4 | 2), budget per mille.
//   select: the MoG token-scan select phase, ABBA over 120 steps (KV on 4 KiB pages);
//           WAKE=1 runs an empty parallel_for right before each timed call (the worker spins,
//           as in a busy engine).
//   step:   whole steps of dense and of MoG with the token scan, each on 1 and 2 threads, 160
//           steps (40 each), KV on huge pages, the worker always woken first.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "floe/core/huge_page_allocator.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/exec/thread_pool.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
using dense = estimator<select::dense, residual::none>;
static std::vector<float> evict(256u << 20);  // 1 GiB
static float sink = 0;
void cold() { float s = 0; for (size_t i = 0; i < evict.size(); i += 16) s += evict[i]; sink += s; }
void report(const char* what, std::vector<double>& t, double* median = nullptr) {
  std::sort(t.begin(), t.end());
  if (median) *median = t[t.size() / 2];
  std::printf("%s: median %5.0f min %5.0f us\n", what, t[t.size() / 2], t[0]);
}
int main(int argc, char** argv) {
  if (argc != 5 || (std::strcmp(argv[1], "select") && std::strcmp(argv[1], "step"))) {
    std::fprintf(stderr, "usage: threads_ab select|step g bits budget_per_mille\n");
    return 2;
  }
  const bool step = !std::strcmp(argv[1], "step");
  const index_t g = std::atoi(argv[2]); const int bits = std::atoi(argv[3]); const int pm = std::atoi(argv[4]);
  for (size_t i = 0; i < evict.size(); ++i) evict[i] = float(i & 7);
  testing::synthetic_kv_config cfg; cfg.n = 131072; cfg.kv_heads = 1; cfg.group = g; cfg.queries = 8;
  const auto head = testing::generate_synthetic_head(cfg, 0);
  const index_t d = cfg.d, n = cfg.n;
  std::vector<half, huge_page_allocator<half>> k, v;  // huge pages only in step mode (as that run had)
  std::vector<half> k4, v4;
  for (float x : head.keys) (step ? k.push_back(half::from_float(x)) : k4.push_back(half::from_float(x)));
  for (float x : head.values) (step ? v.push_back(half::from_float(x)) : v4.push_back(half::from_float(x)));
  kv_view<half> kv(step ? k.data() : k4.data(), step ? v.data() : v4.data(), n, d, d);
  const auto sel0 = select::mog_clusters::with_budget(budget::fraction(pm / 1000.0), n);
  const mog est(sel0.with_token_scan(bits == 2 ? mog_config::scan_code::residual_2bit : mog_config::scan_code::keys_4bit), {});
  const auto st = est.build(kv);
  thread_pool pool(2);
  const exec::simd one, two(pool);
  const auto query = [&](int i) { return query_group{head.queries.data() + (i % 8) * d, g, d, 8 * d, 1.f / std::sqrt(float(d))}; };
  char label[96];
  if (!step) {
    select::mog_clusters::selection sel; stats s;
    std::vector<double> t[2];
    for (int i = 0; i < 120; ++i) {
      const int w = (i / 2 + i) % 2;  // ABBA order
      cold();
      if (std::getenv("WAKE")) pool.hook()(2, [](index_t) {});
      const auto t0 = std::chrono::steady_clock::now();
      est.selector().select(st.selector_index, kv, query(i), w ? two : one, sel, s);
      t[w].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    for (int w = 0; w < 2; ++w) {
      std::snprintf(label, sizeof label, "g %ld bits %d budget %d, %s", (long)g, bits, pm, w ? "2 threads" : "1 thread ");
      report(label, t[w]);
    }
    return sink == 12345.f;
  }
  const dense de; const auto dst = de.build(kv);
  std::vector<float> out(g * d); stats s;
  std::vector<double> t[4];  // dense 1, dense 2, mog 1, mog 2
  for (int i = 0; i < 160; ++i) {
    const int w = (i + i / 4) % 4;
    cold();
    pool.hook()(2, [](index_t) {});
    const auto t0 = std::chrono::steady_clock::now();
    const exec::simd& e = (w % 2) ? two : one;
    if (w < 2) de.decode(dst, kv, query(i), e, output_group<float>{out.data(), g, d, 0}, s);
    else est.decode(st, kv, query(i), e, output_group<float>{out.data(), g, d, 0}, s);
    t[w].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  const char* names[] = {"dense 1 thread ", "dense 2 threads", "mog   1 thread ", "mog   2 threads"};
  double med[4];
  for (int w = 0; w < 4; ++w) {
    std::snprintf(label, sizeof label, "g %ld %d-bit scan budget %d, %s", (long)g, bits, pm, names[w]);
    report(label, t[w], &med[w]);
  }
  std::printf("  x dense (medians): 1 thread %.2f, 2 threads %.2f\n", med[0] / med[2], med[1] / med[3]);
  return sink == 12345.f;
}
