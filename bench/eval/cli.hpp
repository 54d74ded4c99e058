// floe-eval's command line: options, their defaults and the --help text.
#pragma once

#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "floe/core/error.hpp"
#include "floe/testing/synthetic_kv.hpp"

namespace floe::eval {

struct options {
  std::string data;                            // a KV dump directory; empty: the synthetic cache
  testing::synthetic_kv_config synthetic;      // used when data is empty
  std::string dtype = "f16";                   // synthetic element type
  std::string save_synthetic;                  // also write the synthetic cache here
  std::vector<std::string> methods;            // empty: every registered method
  std::vector<double> budgets = {0.01, 0.02, 0.05, 0.1};
  index_t queries = 0;                         // 0: synthetic default / every query of a dump
  std::vector<long> layers;                    // empty: every layer of a dump
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::string csv;
  bool progress = true;
  bool list_methods = false;
  bool help = false;
};

// Decode steps per query head of the default synthetic cache: keeps the README's main job
// well under a minute on 2 cores with the scalar executor (docs/evaluation.md).
inline constexpr index_t default_synthetic_queries = 8;

inline constexpr std::string_view usage = R"(usage: floe-eval [options]

Runs every registered estimator configuration over a KV cache and compares each output
with dense attention computed in double on the scalar reference executor. Reports, per
method and budget: keys and KV bytes read, the relative L2 error per (query, head) as
p50/p90/p99/max, microseconds per query-head and the speed-up against dense decode
timed in the same run. Column definitions: docs/evaluation.md.

data (default: --synthetic 32768):
  --data DIR            a KV dump (docs/kv-format.md): DIR/keys.npy, values.npy,
                        queries.npy [, meta.json], or one such DIR/layer_XX/ per layer
  --synthetic N         the synthetic cache with N tokens (suffixes K = 1024, M)
synthetic cache (docs/evaluation.md, "The synthetic cache"):
  --kv-heads H          KV heads (default 8)
  --gqa G               query heads per KV head (default 4)
  --head-dim D          key and value dimension (default 128)
  --dtype T             f16, bf16 or f32 (default f16)
  --seed S              generator seed (default 1)
  --save-synthetic DIR  also write the synthetic cache there as a KV dump
evaluation:
  --methods LIST        comma-separated method names (default: all; see --list-methods)
  --budgets LIST        comma-separated fractions of N in [0, 1] (default 0.01,0.02,0.05,0.1)
  --queries Q           decode steps per query head (default 8 synthetic, all of a dump)
  --layers LIST         comma-separated layer numbers of a multi-layer dump (default all)
  --threads T           threads over KV heads (default: every core)
output:
  --csv FILE            also write the rows as CSV
  --no-progress         no progress bar (shown on a terminal for runs over a second)
  --list-methods        list the registered methods and exit
  --help                this text
)";

namespace detail {

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string item;
  for (char c : s + ",") {
    if (c == ',') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else if (c != ' ') {
      item += c;
    }
  }
  return out;
}

inline double parse_number(const std::string& s, const char* flag) {
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(x))
    throw invalid_argument(flag, floe::detail::concat("'", s, "' is not a number"));
  return x;
}

// A whole number (positive unless allow_zero), with an optional K (1024) or M (1024^2) suffix.
inline index_t parse_count(std::string s, const char* flag, bool allow_suffix = false, bool allow_zero = false) {
  index_t mult = 1;
  if (allow_suffix && !s.empty() && (s.back() == 'K' || s.back() == 'k')) mult = 1024, s.pop_back();
  else if (allow_suffix && !s.empty() && (s.back() == 'M' || s.back() == 'm')) mult = 1024 * 1024, s.pop_back();
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 12)
    throw invalid_argument(flag, floe::detail::concat("'", s, "' is not a positive whole number"));
  const index_t v = std::stoull(s) * mult;
  if (v == 0 && !allow_zero) throw invalid_argument(flag, "must be at least 1");
  return v;
}

}  // namespace detail

inline options parse_options(int argc, const char* const* argv) {
  options o;
  bool synthetic_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    const auto eq = arg.find('=');
    const bool has_inline = arg.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_inline) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (has_inline) return value;
      if (i + 1 >= argc) throw invalid_argument(argv[i], "needs a value");
      return argv[++i];
    };
    const char* flag = argv[i];
    if (arg == "--help" || arg == "-h") o.help = true;
    else if (arg == "--list-methods") o.list_methods = true;
    else if (arg == "--no-progress") o.progress = false;
    else if (arg == "--data") o.data = next();
    else if (arg == "--synthetic") o.synthetic.n = detail::parse_count(next(), "--synthetic", true), synthetic_given = true;
    else if (arg == "--kv-heads") o.synthetic.kv_heads = detail::parse_count(next(), "--kv-heads");
    else if (arg == "--gqa") o.synthetic.group = detail::parse_count(next(), "--gqa");
    else if (arg == "--head-dim") o.synthetic.d = o.synthetic.dv = detail::parse_count(next(), "--head-dim");
    else if (arg == "--seed") o.synthetic.seed = detail::parse_count(next(), "--seed", false, true);
    else if (arg == "--dtype") {
      o.dtype = next();
      if (o.dtype != "f16" && o.dtype != "bf16" && o.dtype != "f32")
        throw invalid_argument("--dtype", floe::detail::concat("'", o.dtype, "' is not one of f16, bf16, f32"));
    } else if (arg == "--save-synthetic") o.save_synthetic = next();
    else if (arg == "--methods") {
      o.methods = detail::split_list(next());
      if (o.methods.empty()) throw invalid_argument("--methods", "names no method");
    } else if (arg == "--budgets") {
      o.budgets.clear();
      for (const auto& b : detail::split_list(next())) {
        const double x = detail::parse_number(b, "--budgets");
        if (!(x >= 0 && x <= 1)) throw invalid_argument("--budgets", floe::detail::concat("budget ", b, " is not a fraction in [0, 1]"));
        o.budgets.push_back(x);
      }
      if (o.budgets.empty()) throw invalid_argument("--budgets", "names no budget");
    } else if (arg == "--queries") o.queries = detail::parse_count(next(), "--queries");
    else if (arg == "--layers") {
      for (const auto& l : detail::split_list(next()))
        o.layers.push_back(static_cast<long>(detail::parse_count(l, "--layers", false, true)));
    } else if (arg == "--threads") o.threads = static_cast<unsigned>(detail::parse_count(next(), "--threads"));
    else if (arg == "--csv") o.csv = next();
    else throw invalid_argument(flag, "unknown option; see floe-eval --help");
  }
  if (!o.data.empty() && synthetic_given) throw invalid_argument("--data", "give either --data or --synthetic, not both");
  if (o.data.empty() && !o.layers.empty()) throw invalid_argument("--layers", "applies to --data dumps only");
  o.synthetic.queries = o.queries ? o.queries : default_synthetic_queries;
  return o;
}

}  // namespace floe::eval
