#include <chrono>
#include <cstdio>
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
int main(int argc, char** argv) {
  index_t g = 1; bool stage = argc > 1 && argv[1][0] == '1';
  testing::synthetic_kv_config cfg; cfg.n = 131072; cfg.kv_heads = 1; cfg.group = g; cfg.queries = 8;
  auto head = testing::generate_synthetic_head(cfg, 0);
  index_t n = cfg.n, d = cfg.d;
  std::vector<half> K, V; for (float x : head.keys) K.push_back(half::from_float(x)); for (float x : head.values) V.push_back(half::from_float(x));
  kv_view<half> kv{K.data(), V.data(), n, d, d};
  auto sel0 = select::mog_clusters::with_budget(budget::fraction(0.025), n);
  mog est(sel0.with_token_scan(mog_config::scan_code::residual_2bit), {});
  auto st = est.build(kv);
  exec::simd_options o; o.stage_short_runs = stage; exec::simd e(o);
  query_group q{head.queries.data(), g, d, cfg.queries * d, 1.f / std::sqrt(float(d))};
  select::mog_clusters::selection sel; stats s;
  est.selector().select(st.selector_index, kv, q, e, sel, s);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20000; ++i) { partial_set<float> parts(q.heads, kv.dv()); e.attend(kv, q, sel.ranges, parts); }
  printf("%.1f us per call\n", std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 20000);
}
