// floe quickstart: how an engine drops floe in. Builds a random fp16 KV cache (one
// sequence, GQA), runs the dense reference and every estimator shipped so far through
// floe::decode_batch, and prints error against dense with the tokens and bytes read.
#include <floe/floe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
struct options {
  std::size_t n = 8192, d = 128, q_heads = 8, kv_heads = 2;
  std::uint64_t seed = 1;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::uint64_t {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return std::strtoull(argv[++i], nullptr, 10);
    };
    if (a == "--help" || a == "-h") {
      std::printf("usage: floe-quickstart [--n TOKENS] [--d DIM] [--seed S]\n"
                  "Random fp16 KV cache, %zu query heads over %zu KV heads; prints each estimator's\n"
                  "relative L2 error against the dense scalar reference and what it read.\n", o.q_heads, o.kv_heads);
      std::exit(0);
    } else if (a == "--n") o.n = value();
    else if (a == "--d") o.d = value();
    else if (a == "--seed") o.seed = value();
    else { std::fprintf(stderr, "unknown argument %s (see --help)\n", a.c_str()); std::exit(2); }
  }
  return o;
}

// Runs one estimator over the batch and returns its output and stats.
template <class Est>
std::pair<std::vector<float>, floe::stats> run(const Est& est, const std::vector<floe::kv_view<floe::half>>& heads,
                                               const std::vector<float>& queries, const options& o) {
  std::vector<typename Est::state> states;
  for (const auto& kv : heads) states.push_back(est.build(kv));
  std::vector<float> out(o.q_heads * o.d);
  const std::vector<floe::sequence<floe::kv_view<floe::half>>> batch{{heads, queries.data(), out.data()}};
  const auto s = floe::decode_batch(est, std::span<const typename Est::state>(states), std::span(batch),
                                    floe::gqa_shape{o.q_heads, o.kv_heads}, 1.f / std::sqrt(float(o.d)),
                                    floe::exec::scalar{});
  return {out, s};
}
}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  std::printf("floe quickstart: n = %zu tokens, d = dv = %zu, %zu query heads over %zu KV heads, fp16 KV, seed %llu\n",
              o.n, o.d, o.q_heads, o.kv_heads, static_cast<unsigned long long>(o.seed));
  std::mt19937_64 g(o.seed);
  std::normal_distribution<float> normal;
  // Keys with a shared offset and a few strong tokens, so attention is neither flat nor one-hot.
  std::vector<std::vector<floe::half>> keys(o.kv_heads), values(o.kv_heads);
  std::vector<floe::kv_view<floe::half>> heads;
  for (std::size_t h = 0; h < o.kv_heads; ++h) {
    keys[h].resize(o.n * o.d);
    values[h].resize(o.n * o.d);
    for (auto& x : keys[h]) x = floe::half::from_float(normal(g));
    for (auto& x : values[h]) x = floe::half::from_float(normal(g));
    heads.emplace_back(keys[h].data(), values[h].data(), o.n, o.d, o.d);
  }
  std::vector<float> queries(o.q_heads * o.d);
  for (auto& x : queries) x = 1.5f * normal(g);

  const auto [reference, ref_stats] =
      run(floe::estimator<floe::select::dense, floe::residual::none>{}, heads, queries, o);
  std::printf("\n%-22s %8s %12s %12s %10s %10s\n", "method", "budget", "tokens read", "bytes read", "err p50", "err max");
  auto report = [&](const std::string& name, const std::string& budget, const std::vector<float>& out, const floe::stats& s) {
    std::vector<double> err;
    for (std::size_t h = 0; h < o.q_heads; ++h) {
      double num = 0, den = 0;
      for (std::size_t j = 0; j < o.d; ++j) {
        const double r = reference[h * o.d + j], e = out[h * o.d + j] - r;
        num += e * e;
        den += r * r;
      }
      err.push_back(std::sqrt(num / den));
    }
    std::sort(err.begin(), err.end());
    std::printf("%-22s %8s %11.2f%% %11.2f%% %10.2e %10.2e\n", name.c_str(), budget.c_str(),
                100.0 * double(s.tokens_read) / double(s.tokens_total),
                100.0 * double(s.bytes_read()) / double(ref_stats.bytes_read()), err[err.size() / 2], err.back());
  };
  report("dense+none", "1.00", reference, ref_stats);
  for (double f : {0.01, 0.05, 0.2}) {
    const auto k = floe::budget::fraction(f).resolve(o.n);
    const floe::estimator<floe::select::streaming, floe::residual::none> est(floe::select::streaming::with_budget(k), {});
    const auto [out, s] = run(est, heads, queries, o);
    char b[16];
    std::snprintf(b, sizeof b, "%.2f", f);
    report("streaming+none", b, out, s);
  }
  std::printf("\nerror: relative L2 per query head against the dense scalar reference (double accumulation)\n");
  return 0;
}
