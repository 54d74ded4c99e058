// topk-entropy-eval: floe-eval's measurements split by the attention entropy of each
// (query head, step), and selection-only against completion at equal bytes read.
// Takes floe-eval's options (--data, --synthetic, --methods, --budgets, ...). For every
// method named "X+feature_map..." or "X+scan_completion" it also runs "X+none" at the budget that reads as
// many bytes (the summary's bytes turned into extra exact tokens), so that the two are
// compared at equal token-equivalent bytes. docs/methods/retrieval-completion.md.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "cli.hpp"
#include "evaluation.hpp"
#include "floe/io/kv_dump.hpp"
#include "floe/residual/feature_map.hpp"
#include "floe/residual/feature_maps/optimized_positive_random.hpp"
#include "floe/residual/scan_completion.hpp"
#include "floe/select/scorers/quantized_scan.hpp"
#include "floe/select/topk_anchors.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "method_registry.hpp"
#include "thread_pool.hpp"
#include "timing_executor.hpp"

namespace {
using namespace floe;
using namespace floe::eval;
using exec_t = timing_executor;

// Entropy buckets of the issue (> 5 nats against the rest) and floe-eval's finer bands.
struct bucket {
  const char* name;
  double lo, hi;
};
const bucket buckets[] = {{"all", -1, 1e9}, {"<=5", -1, 5}, {">5", 5, 1e9}, {"<1", -1, 1},
                          {"1-3", 1, 3},    {"3-5", 3, 5},  {"5-7", 5, 7},  {">7", 7, 1e9}};

// Variants beyond the registry, for sweeps of the feature count and the map.
template <class Map>
method_entry<exec_t> quantized_with(const std::string& name, index_t features) {
  using sel = select::topk_anchors<select::quantized_scan>;
  return method<exec_t>(name, "sweep", [features](budget b, index_t n) {
    residual::feature_map<Map> fm;
    fm.map.features = features;
    return estimator<sel, residual::feature_map<Map>>{sel::with_budget(b.resolve(n)), fm};
  });
}

// quantized_scan+none with another re-rank factor.
method_entry<exec_t> rerank_with(const std::string& name, double factor) {
  using sel = select::topk_anchors<select::quantized_scan>;
  return method<exec_t>(name, "sweep", [factor](budget b, index_t n) {
    return estimator<sel, residual::none>{sel::with_budget(b.resolve(n), 4, 64, select::quantized_scan{factor}), {}};
  });
}

// quantized_scan+scan_completion with another value tier; `rerank` 1 picks the k best by
// estimate (no keys read to choose, the fast configuration of the speed bench).
// `rank`: directions of the value sketch (0: none).
method_entry<exec_t> tier_with(const std::string& name, double tier, double rerank = 1.25, index_t rank = 0) {
  using sel = select::topk_anchors<select::quantized_scan>;
  return method<exec_t>(name, "sweep", [tier, rerank, rank](budget b, index_t n) {
    return estimator<sel, residual::scan_completion>{sel::with_budget(b.resolve(n), 4, 64, select::quantized_scan{rerank}), {tier, rank}};
  });
}

std::vector<method_entry<exec_t>> all_methods() {
  auto m = registered_methods<exec_t>();
  for (double f : {1.0, 1.25, 1.5, 2.0, 4.0}) m.push_back(rerank_with("q-rerank" + std::to_string(f).substr(0, 4), f));
  for (double t : {0.25, 0.5, 2.0, 4.0}) m.push_back(tier_with("q+tier" + std::to_string(t).substr(0, 4), t));
  m.push_back(rerank_with("qe+none", 1.0));  // by estimate: the partner of the qe+tier runs
  for (double t : {0.5, 2.0}) m.push_back(tier_with("qe+tier" + std::to_string(t).substr(0, 4), t, 1.0));
  for (index_t rank : {4, 8, 16, 32})  // with a value sketch
    for (double t : {0.5, 2.0})
      m.push_back(tier_with("qe+tier" + std::to_string(t).substr(0, 4) + "+rank" + std::to_string(rank), t, 1.0, rank));
  for (index_t f : {32, 64, 128, 256, 512}) {
    m.push_back(quantized_with<residual::positive_random>("q+prf" + std::to_string(f), f));
    m.push_back(quantized_with<residual::optimized_positive_random>("q+oprf" + std::to_string(f), f));
  }
  return m;
}

struct run_key {
  std::string method;
  double budget;
  bool operator<(const run_key& o) const { return method != o.method ? method < o.method : budget < o.budget; }
};

struct run_result {
  double bytes = 0, keys = 0;
  std::vector<double> errors, entropy;  // aligned, one per (layer, query head, step)
};

double quantile_of(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return quantile(v, p);
}

std::vector<double> in_bucket(const run_result& r, const bucket& b) {
  std::vector<double> e;
  for (index_t i = 0; i < r.errors.size(); ++i)
    if (r.entropy[i] > b.lo && r.entropy[i] <= b.hi) e.push_back(r.errors[i]);
  return e;
}

// The "X+none" partner of a completion method "X+feature_map..." or "X+scan_completion", or "".
std::string partner_of(const std::string& name, const std::vector<method_entry<exec_t>>& methods) {
  std::string base;
  if (name.rfind("q+", 0) == 0) base = "topk_anchors:quantized_scan";
  else if (name.rfind("qe+", 0) == 0 && name != "qe+none") base = "qe";
  else if (const auto at = name.find("+feature_map"); at != std::string::npos) base = name.substr(0, at);
  else if (const auto at2 = name.find("+scan_completion"); at2 != std::string::npos) base = name.substr(0, at2);
  if (base.empty()) return "";
  for (const auto& m : methods)
    if (m.name == base + "+none") return m.name;
  return "";
}
}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    if (o.help) {
      std::cout << "topk-entropy-eval: floe-eval's options; errors per entropy bucket and equal-bytes pairs\n" << usage;
      return 0;
    }
    const auto methods = all_methods();
    const auto parallel_for = threaded_for(o.threads);
    const exec_t exec = make_timing_executor();
    std::vector<std::filesystem::path> layers;
    if (!o.data.empty())
      for (const auto& dir : io::kv_dump_layers(o.data)) {
        const std::string name = dir.filename().string();
        const long number = name.rfind("layer_", 0) == 0 ? std::stol(name.substr(6)) : -1;
        if (o.layers.empty() || std::find(o.layers.begin(), o.layers.end(), number) != o.layers.end())
          layers.push_back(dir);
      }
    const index_t layer_count = o.data.empty() ? 1 : layers.size();
    require(layer_count > 0, "--layers", "selects no layer");

    std::vector<io::kv_dump> dumps;
    std::vector<layer_reference> refs;
    for (index_t l = 0; l < layer_count; ++l) {
      dumps.push_back(o.data.empty() ? testing::make_synthetic_kv(o.synthetic, o.dtype, parallel_for)
                                     : io::load_kv_dump(layers[l]));
      const index_t steps = o.queries ? std::min(o.queries, dumps.back().steps) : dumps.back().steps;
      refs.push_back(compute_reference(dumps.back(), steps, parallel_for));
      std::printf("data: %s layer %zu: N = %zu, %zu KV heads, GQA %zu, d = %zu, %s, %zu steps\n",
                  o.data.empty() ? "synthetic" : o.data.c_str(), l, dumps.back().n, dumps.back().kv_heads,
                  dumps.back().group(), dumps.back().d, std::string(dumps.back().dtype_name()).c_str(), steps);
    }

    std::map<run_key, run_result> results;
    auto run = [&](const std::string& name, double b) -> const run_result& {
      const run_key key{name, b};
      if (auto it = results.find(key); it != results.end()) return it->second;
      const auto& m = find_method(methods, name, "--methods");
      const auto est = m.make(budget::fraction(b));
      run_result r;
      method_tally tally;
      for (index_t l = 0; l < layer_count; ++l) {
        const index_t before = tally.errors.size();
        run_method(est, dumps[l], refs[l], refs[l].steps, exec, parallel_for, tally);
        // tally order: (KV head, step, head in group); entropy order: (query head, step).
        const index_t g = dumps[l].group(), steps = refs[l].steps;
        for (index_t i = before; i < tally.errors.size(); ++i) {
          const index_t e = i - before, j = e % g, t = (e / g) % steps, h = e / (g * steps);
          r.errors.push_back(tally.errors[i]);
          r.entropy.push_back(refs[l].entropy[(h * g + j) * steps + t]);
        }
      }
      r.bytes = static_cast<double>(tally.io.bytes_read()) / tally.kv_bytes_total;
      r.keys = static_cast<double>(tally.io.tokens_read) / static_cast<double>(tally.io.tokens_total);
      return results[key] = std::move(r);
    };

    std::vector<std::string> names = o.methods;
    if (names.empty())
      for (const auto& m : registered_methods<exec_t>()) names.push_back(m.name);

    std::printf("\n%-44s %7s %8s %8s", "method", "budget", "keys", "bytes");
    for (const auto& bk : buckets) std::printf(" %9s", (std::string("p90 ") + bk.name).c_str());
    std::printf("\n%-44s %7s %8s %8s", "", "", "", "");
    for (const auto& bk : buckets) {
      index_t count = 0;
      for (double e : refs.empty() ? std::vector<double>{} : [&] {
             std::vector<double> all;
             for (const auto& rf : refs) all.insert(all.end(), rf.entropy.begin(), rf.entropy.end());
             return all;
           }())
        count += e > bk.lo && e <= bk.hi;
      std::printf(" %9s", ("n=" + std::to_string(count)).c_str());
    }
    std::printf("\n");
    auto print_row = [&](const std::string& name, double b, const run_result& r) {
      std::printf("%-44s %7.4f %7.2f%% %7.2f%%", name.c_str(), b, 100 * r.keys, 100 * r.bytes);
      for (const auto& bk : buckets) {
        const auto e = in_bucket(r, bk);
        if (e.empty()) std::printf(" %9s", "-");
        else std::printf(" %9.2e", quantile_of(e, 0.9));
      }
      std::printf("\n");
    };
    for (const auto& name : names)
      for (double b : o.budgets) print_row(name, b, run(name, b));

    // Completion against selection only at equal bytes: X+none at budget b + (extra bytes).
    bool header = false;
    for (const auto& name : names) {
      const std::string partner = partner_of(name, methods);
      if (partner.empty() || partner == name) continue;
      if (!header) {
        std::printf("\nequal bytes: p90(selection only) / p90(completion) per bucket (> 1: completion better)\n");
        header = true;
      }
      for (double b : o.budgets) {
        const run_result& fm = run(name, b);
        const double matched = std::min(1.0, b + std::max(0.0, fm.bytes - run(partner, b).bytes));
        const run_result& none = run(partner, matched);
        print_row(partner, matched, none);
        std::printf("%-44s %7.4f %7.2f%% %7.2f%%", ("  ratio vs " + name).c_str(), b, 100 * fm.keys, 100 * fm.bytes);
        for (const auto& bk : buckets) {
          const auto a = in_bucket(none, bk), c = in_bucket(fm, bk);
          if (a.empty()) std::printf(" %9s", "-");
          else std::printf(" %9.2f", quantile_of(a, 0.9) / quantile_of(c, 0.9));
        }
        std::printf("\n");
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "topk-entropy-eval: %s\n", e.what());
    return 2;
  }
}
