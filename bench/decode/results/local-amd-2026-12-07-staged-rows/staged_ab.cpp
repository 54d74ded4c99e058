#include <algorithm>
#include <chrono>
#include <cstdio>
#include "floe/estimator.hpp"
#include "floe/exec/simd.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "../../../support/huge_page_allocator.hpp"
using namespace floe;
using mog = estimator<select::mog_clusters, residual::gaussian_moments>;
static std::vector<std::uint64_t> junk(1u << 27, 1);
void evict() { std::uint64_t s = 0; for (std::size_t i = 0; i < junk.size(); i += 8) s += junk[i]; asm volatile("" ::"r"(s)); }
double now() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  index_t g = argc > 1 ? atoi(argv[1]) : 1;
  testing::synthetic_kv_config cfg; cfg.n = 131072; cfg.kv_heads = 1; cfg.group = g; cfg.queries = 8;
  auto head = testing::generate_synthetic_head(cfg, 0);
  index_t n = cfg.n, d = cfg.d;
  std::vector<half, floe::bench::huge_page_allocator<half>> K, V; for (float x : head.keys) K.push_back(half::from_float(x)); for (float x : head.values) V.push_back(half::from_float(x));
  kv_view<half> kv{K.data(), V.data(), n, d, d};
  const bool scan = argc > 2 && argv[2][0] == 's';
  auto sel0 = select::mog_clusters::with_budget(budget::fraction(scan ? 0.025 : 0.05), n);
  mog est = scan ? mog(sel0.with_token_scan(mog_config::scan_code::residual_2bit), {}) : mog(sel0, {});
  auto st = est.build(kv);
  exec::simd_options on, off; off.stage_short_runs = false;
  exec::simd e_on(on), e_off(off);
  std::vector<double> t_on, t_off, w_on, w_off;
  for (int rep = 0; rep < 40; ++rep) {
    index_t step = rep % 8;
    query_group q{head.queries.data() + step * d, g, d, cfg.queries * d, 1.f / std::sqrt(float(d))};
    select::mog_clusters::selection sel; stats s;
    est.selector().select(st.selector_index, kv, q, e_on, sel, s);
    if (rep == 0) { index_t tok = 0; for (auto r : sel.ranges) tok += r.end - r.begin; printf("runs %zu tokens %ld\n", sel.ranges.size(), (long)tok); }
    for (int w = 0; w < 2; ++w) {
      bool first_on = (rep + w) % 2 == 0;
      for (int k = 0; k < 2; ++k) {
        const exec::simd& e = (k == 0) == first_on ? e_on : e_off;
        partial_set<float> parts(q.heads, kv.dv());
        if (w == 0) evict();
        double t0 = now(); e.attend(kv, q, sel.ranges, parts); double t = now() - t0;
        ((&e == &e_on) ? (w ? w_on : t_on) : (w ? w_off : t_off)).push_back(t);
      }
    }
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  auto mn = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()); };
  printf("g=%ld cold: staged med %.1f min %.1f | unstaged med %.1f min %.1f   warm: staged %.1f unstaged %.1f\n", (long)g,
         med(t_on), mn(t_on), med(t_off), mn(t_off), med(w_on), med(w_off));
}
