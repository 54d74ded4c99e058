// The whole of a floe-eval run: load or generate each layer, compute the reference once,
// run every (method, budget) on it, and pool the results over layers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "evaluation.hpp"
#include "floe/io/kv_dump.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "method_registry.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "thread_pool.hpp"
#include "timing_executor.hpp"

namespace floe::eval {

struct eval_result {
  std::vector<eval_row> rows;
  std::vector<double> entropy, sink_mass, top1_mass;  // per (layer, query head, step)
  index_t n = 0;                           // tokens of the (last) layer
  double seconds = 0;                      // wall time of the whole run
};

// One (method, budget) to run; `shown` is false for the dense run kept only for timing.
struct planned_run {
  const method_entry<timing_executor>* method;
  double budget;
  bool shown;
};

inline std::vector<planned_run> plan_runs(const std::vector<method_entry<timing_executor>>& registry,
                                          const options& o) {
  std::vector<std::string> names = o.methods;
  if (names.empty())
    for (const auto& m : registry) names.push_back(m.name);
  std::vector<planned_run> runs;
  const auto has = [&](const std::string& name) { return std::find(names.begin(), names.end(), name) != names.end(); };
  if (!has("dense")) runs.push_back({&find_method(registry, "dense"), 1.0, false});
  for (const auto& name : names) {
    const auto& m = find_method(registry, name, "--methods");
    if (!m.uses_budget) runs.push_back({&m, 1.0, true});
    else
      for (double b : o.budgets) runs.push_back({&m, b, true});
  }
  return runs;
}

// A one-line description of one layer's data.
inline std::string describe(const io::kv_dump& d, index_t steps) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "N = %zu, %zu KV heads, %zu query heads (GQA %zu), d = %zu, dv = %zu, %s, %zu queries per query head",
                d.n, d.kv_heads, d.q_heads, d.group(), d.d, d.dv, std::string(d.dtype_name()).c_str(), steps);
  return buf;
}

// Runs everything `o` asks for, writing the data description to `log` as it goes.
inline eval_result run_evaluation(const options& o, std::ostream& log) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto registry = registered_methods<timing_executor>();
  const auto runs = plan_runs(registry, o);
  const auto parallel_for = threaded_for(o.threads);
  const timing_executor exec = make_timing_executor();

  std::vector<std::filesystem::path> layers;
  if (!o.data.empty()) {
    for (const auto& dir : io::kv_dump_layers(o.data)) {
      const std::string name = dir.filename().string();
      const long number = name.rfind("layer_", 0) == 0 ? std::stol(name.substr(6)) : -1;
      if (o.layers.empty() || std::find(o.layers.begin(), o.layers.end(), number) != o.layers.end())
        layers.push_back(dir);
    }
    require(!layers.empty(), "--layers", "selects none of the layers in ", o.data);
  }
  const index_t layer_count = o.data.empty() ? 1 : layers.size();

  eval_result result;
  std::vector<method_tally> tallies(runs.size());
  std::unique_ptr<progress> bar;
  for (index_t l = 0; l < layer_count; ++l) {
    io::kv_dump dump;
    if (o.data.empty()) {
      dump = testing::make_synthetic_kv(o.synthetic, o.dtype, parallel_for);
      log << "data: synthetic KV cache (floe::testing::synthetic_kv, seed " << o.synthetic.seed << "): "
          << describe(dump, dump.steps) << "\n";
      if (!o.save_synthetic.empty()) {
        io::save_kv_dump(o.save_synthetic, dump);
        log << "  written to " << o.save_synthetic << "\n";
      }
    } else {
      dump = io::load_kv_dump(layers[l]);
      log << "data: " << layers[l].string() << ": " << describe(dump, o.queries ? std::min(o.queries, dump.steps) : dump.steps)
          << "\n";
    }
    const index_t steps = o.queries ? std::min(o.queries, dump.steps) : dump.steps;
    if (!bar) {
      bar = std::make_unique<progress>(layer_count * (1 + runs.size()) * dump.kv_heads * steps, o.progress && isatty(2));
      log << "executor: " << timing_executor::name << ", " << o.threads
          << " thread(s) over KV heads; error reference: dense on exec::scalar in double\n";
      log.flush();
    }
    bar->set_label("reference");
    const layer_reference ref = compute_reference(dump, steps, parallel_for, bar.get());
    result.entropy.insert(result.entropy.end(), ref.entropy.begin(), ref.entropy.end());
    result.sink_mass.insert(result.sink_mass.end(), ref.sink_mass.begin(), ref.sink_mass.end());
    result.top1_mass.insert(result.top1_mass.end(), ref.top1_mass.begin(), ref.top1_mass.end());
    result.n = dump.n;
    for (index_t r = 0; r < runs.size(); ++r) {
      const auto est = runs[r].method->make(budget::fraction(runs[r].budget));
      bar->set_label(floe::detail::concat(runs[r].method->name, " ", runs[r].budget));
      run_method(est, dump, ref, steps, exec, parallel_for, tallies[r], bar.get());
    }
  }
  if (bar) bar->finish();

  double dense_us = 0;
  for (index_t r = 0; r < runs.size(); ++r)
    if (runs[r].method->name == "dense") dense_us = summarize("dense", 1.0, tallies[r], 0).us_per_query;
  for (index_t r = 0; r < runs.size(); ++r)
    if (runs[r].shown) result.rows.push_back(summarize(runs[r].method->name, runs[r].budget, tallies[r], dense_us));
  result.seconds = std::chrono::duration<double>(clock::now() - start).count();
  return result;
}

}  // namespace floe::eval
