// floe-mog-accuracy: error of MoG attention against the scalar dense reference (double),
// with the ablation mog_clusters+none and selection-only oracle top-K at the same bytes.
// A focused companion of floe-eval for tuning and for the figures in docs/methods/mog.md.
//
//   floe-mog-accuracy [--synthetic N | --data DIR] [--dtype f16] [--kv-heads H]
//                     [--budgets 0.01,0.02,0.03,0.05] [--threads 2] [--window W]
//                     [--refine R] [--optimism O] [--clusters C] [--subclusters S] [--outliers F | --outlier-share B] [--outlier-sigma Z]
//                     [--query-metric] [--append A] [--join-sigma S] [--split-factor F] [--segment-growth G]
//                     [--maximin] [--per-token] [--token-scan] [--breakdown] [--per-query FILE]
// --query-metric builds the k-means metric from the queries of the second half of the
// decode steps and reports errors on the first half only. --append A builds on the first
// n - A tokens, appends the last A (index append) and also reports a fresh build on all n.
// --maximin lets the GQA heads take turns (greedy maximin of covered mass) instead of ranking by the largest share of any head.
// --breakdown prints where the error comes from (mog_breakdown.hpp). --per-query writes every
// query's error and bytes as CSV (bench/mog/oracle_allocation.py reads it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "floe/estimator.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/io/kv_dump.hpp"
#include "floe/residual/gaussian_moments.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "floe/select/mog_clusters.hpp"
#include "floe/select/oracle_topk.hpp"
#include "floe/testing/synthetic_kv.hpp"
#include "../eval/cli.hpp"
#include "mog_breakdown.hpp"

namespace {

using namespace floe;

struct options {
  index_t synthetic = 32768, kv_heads = 8, threads = 2, seed = 1;
  std::string data, dtype = "f16";
  std::vector<double> budgets{0.01, 0.02, 0.03, 0.05};
  select::mog_clusters selector;
  index_t append = 0;        // tokens appended after the build (0: none)
  bool key_metric = false;    // experiment: the keys themselves as the metric sample
  bool outliers_given = false;  // --outliers: one cap for every budget
  double outlier_share = select::mog_clusters::outlier_share;  // else at most this share of each budget
  bool query_sample = false;  // build with the queries of the second half of the steps, test on the first
  bool breakdown = false;     // per-query counterfactual errors (mog_breakdown.hpp)
  bool cross_covariance = false;  // the residual corrects value means by s Cov(v, k) q
  std::string per_query;      // CSV of every query's error and bytes ("" : none)
  double top_p_cap = 0;       // > 0: the budgets are top-p masses, each capped at this fraction of n
  bool help = false;
};

constexpr const char* usage = R"(floe-mog-accuracy: p50/p90/p99/max relative error of MoG attention (mog) against the
dense reference in double, with the ablation mog_clusters+none and selection-only
oracle_topk given MoG's bytes, per budget; also index build time and memory.

usage: floe-mog-accuracy [options]

data
  --synthetic N          synthetic cache of N tokens (default 32768; docs/evaluation.md)
  --data DIR             a KV dump directory instead (scripts/smollm/dump_kv.sh;
                         e.g. .cache/smollm/dumps/emma-8160/layer_08)
  --dtype f16|bf16|f32   element type of the synthetic cache (default f16)
  --kv-heads H           synthetic KV heads (default 8)
  --seed S               seed of the synthetic cache (default 1: the cache the docs' figures use)
  --threads T            threads for building and scoring (default 2)
budgets and selector
  --budgets B1,B2,...    exact-token fractions (default 0.01,0.02,0.03,0.05)
  --top-p-cap F          the budgets are top-p masses instead (budget::top_p: read until every head's
                         estimated covered share reaches p), each capped at fraction F of n
  --window W             exact recent tokens (default 64)
  --refine R             refined clusters hold R x the budget (default 2)
  --optimism O           rank by O x the score variance (default 1)
  --variance-scale C     estimate with C x the Gaussian's variance term (default 1)
  --maximin              GQA heads take turns instead of ranking by any head's share
  --per-token            rank groups by estimated mass per token, not by mass (rank_per_token)
  --token-scan           rank the members of refined clusters one by one by 4-bit keys kept in the
                         index (mog_config::token_scan; the scan's bytes are in bytes_read); refine 8
                         unless --refine is given
  --scan-code 4bit|2bit  --token-scan, ranking by 4-bit keys (default) or by 2-bit codes of the keys
                         standardised by their cluster (mog_config::scan_code::residual_2bit; refine 16
                         unless --refine is given)
index
  --clusters C           clusters (default round(sqrt(n)))
  --subclusters S        subclusters per cluster (default max(1, round(2/3 ln n)))
  --outliers F           exact outliers: at most fraction F of n, for every budget
  --outlier-share B      else at most B x each budget's tokens (default 0.5)
  --outlier-sigma Z      outlier threshold d + Z sqrt(2d) (default 3)
  --outlier-directions P also test along P pooled principal deviation directions (default 0: off)
  --outlier-bands B      also test windows of d/2/B RoPE pairs, rotate-half layout (default 8; 0: off)
  --outlier-clip P       passes of sigma clipping in each cluster's outlier test (default 1; 0: off)
  --fit-probes P         fit each group's variance term over P probe keys (default 64; 0: off)
  --cross-covariance R   correct unrefined clusters' value means by s Cov(v, k) q, Cov(v, k) kept at
                         rank R (0: whole; float, dv d or R (d + dv) floats per cluster read, in bytes_read)
  --query-sample         the queries of the second half of the steps as mog_config::query_sample
                         (an engine's last prefill queries); errors reported on the first half only
  --sample-outliers F    with a query sample: share F of the exact outliers are the keys it attends
                         most, the rest the farthest (mog_config::sample_outlier_share, default 0.75)
  --query-metric         --query-sample, and k-means in the metric of those queries
  --ridge R              ridge of that metric (fraction of the mean eigenvalue, default 0.1)
  --key-metric           experiment: the keys themselves as the metric sample
append (docs/log/mog.md, "Appending 4096 tokens")
  --append A             build on n - A tokens, append the last A, compare with a fresh build
  --join-sigma S, --split-factor F, --segment-growth G   append's thresholds
output
  --breakdown            where the error comes from: each class of uncovered groups
                         replaced by its truth in turn, and an oracle's floor at the same
                         token count (bench/mog/mog_breakdown.hpp)
  --per-query FILE       write every query's error and bytes read as CSV (method, budget, KV head,
                         step, query head, role, error, bytes_fraction); the bytes are its group's
                         call's, shared by the g heads (bench/mog/oracle_allocation.py reads it)
  --help                 this text
)";

// Values through floe-eval's checked parsers (bench/eval/cli.hpp): errors name the option.
index_t whole_number(const std::string& name, const std::string& text, bool allow_zero = true) {
  return eval::detail::parse_count(text, name.c_str(), false, allow_zero);
}
double real_number(const std::string& name, const std::string& text) { return eval::detail::parse_number(text, name.c_str()); }
std::vector<double> parse_list(const std::string& name, const std::string& s) {
  std::vector<double> out;
  for (const std::string& item : eval::detail::split_list(s)) out.push_back(real_number(name, item));
  require(!out.empty(), name.c_str(), "expects a comma-separated list of numbers");
  return out;
}

options parse(int argc, char** argv) {
  options o;
  bool refine_given = false;
  o.selector.config.window = 64;  // as mog_clusters::with_budget for budgets of 1024 tokens or more
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      require(i + 1 < argc, a.c_str(), "needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") o.help = true;
    else if (a == "--synthetic") o.synthetic = whole_number(a, next(), false);
    else if (a == "--data") o.data = next();
    else if (a == "--dtype") o.dtype = next();
    else if (a == "--kv-heads") o.kv_heads = whole_number(a, next(), false);
    else if (a == "--seed") o.seed = whole_number(a, next(), false);
    else if (a == "--budgets") o.budgets = parse_list(a, next());
    else if (a == "--threads") o.threads = whole_number(a, next(), false);
    else if (a == "--window") o.selector.config.window = whole_number(a, next());
    else if (a == "--refine") o.selector.refine = real_number(a, next()), refine_given = true;
    else if (a == "--optimism") o.selector.optimism = real_number(a, next());
    else if (a == "--variance-scale") o.selector.variance_scale = real_number(a, next());
    else if (a == "--clusters") o.selector.config.clusters = whole_number(a, next());
    else if (a == "--subclusters") o.selector.config.subclusters = whole_number(a, next());
    else if (a == "--outliers") o.selector.config.outlier_fraction = real_number(a, next()), o.outliers_given = true;
    else if (a == "--outlier-share") o.outlier_share = real_number(a, next());
    else if (a == "--outlier-sigma") o.selector.config.outlier_sigma = real_number(a, next());
    else if (a == "--outlier-directions") o.selector.config.outlier_directions = whole_number(a, next());
    else if (a == "--outlier-bands") o.selector.config.outlier_bands = whole_number(a, next());
    else if (a == "--outlier-clip") o.selector.config.outlier_clip_passes = whole_number(a, next());
    else if (a == "--fit-probes") o.selector.config.variance_fit_probes = whole_number(a, next());
    else if (a == "--cross-covariance") {
      o.selector.config.cross_covariance = o.cross_covariance = true;
      o.selector.config.cross_covariance_rank = whole_number(a, next());
    }
    else if (a == "--query-sample") o.query_sample = true;
    else if (a == "--query-metric") o.query_sample = o.selector.config.query_metric = true;
    else if (a == "--sample-outliers") o.selector.config.sample_outlier_share = real_number(a, next());
    else if (a == "--key-metric") {  // the metric only: outliers by distance unless --sample-outliers follows
      o.key_metric = o.selector.config.query_metric = true;
      o.selector.config.sample_outlier_share = 0;
    }
    else if (a == "--append") o.append = whole_number(a, next());
    else if (a == "--maximin") o.selector.maximin = true;
    else if (a == "--per-token") o.selector.rank_per_token = true;
    else if (a == "--token-scan") o.selector.config.token_scan = true;
    else if (a == "--scan-code") {
      const std::string code = next();
      require(code == "4bit" || code == "2bit", "--scan-code", "must be 4bit or 2bit, got '", code, "'");
      o.selector.config.token_scan = true;
      o.selector.config.token_scan_code = code == "2bit" ? mog_config::scan_code::residual_2bit : mog_config::scan_code::keys_4bit;
    }
    else if (a == "--breakdown") o.breakdown = true;
    else if (a == "--per-query") o.per_query = next();
    else if (a == "--top-p-cap") {
      o.top_p_cap = real_number(a, next());
      require(o.top_p_cap > 0.0 && o.top_p_cap <= 1.0, "--top-p-cap", "must lie in (0, 1], got ", o.top_p_cap);
    }
    else if (a == "--join-sigma") o.selector.config.join_sigma = real_number(a, next());
    else if (a == "--split-factor") o.selector.config.split_factor = real_number(a, next());
    else if (a == "--segment-growth") o.selector.config.segment_growth = real_number(a, next());
    else if (a == "--ridge") o.selector.config.query_metric_ridge = real_number(a, next());
    else throw invalid_argument(a.c_str(), "unknown option");
  }
  for (double b : o.budgets) require(b > 0.0 && b <= 1.0, "--budgets", "fractions must lie in (0, 1], got ", b);
  if (o.selector.config.token_scan && !refine_given)
    o.selector.refine = o.selector.with_token_scan(o.selector.config.token_scan_code).refine;
  return o;
}

void for_threads(index_t n, index_t threads, const std::function<void(index_t)>& body) {
  std::atomic<index_t> next{0};
  auto work = [&] {
    for (index_t i; (i = next++) < n;) body(i);
  };
  std::vector<std::thread> pool;
  for (index_t t = 1; t < std::min(threads, n); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

double rel_l2(const float* a, const double* ref, index_t dv) {
  double num = 0, den = 0;
  for (index_t j = 0; j < dv; ++j) {
    num += (a[j] - ref[j]) * (a[j] - ref[j]);
    den += ref[j] * ref[j];
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

double quantile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<index_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::min(v.size(), std::max<index_t>(rank, 1)) - 1];
}

// One query head's error at one step, with the bytes its group's call read.
struct query_record {
  index_t kv_head, step, query_head;
  double error, bytes_fraction;
};

// Everything measured for one method at one budget, over all heads and steps.
struct tally {
  std::vector<double> errors;
  std::vector<query_record> queries;  // the same errors, with where and what they cost
  std::map<index_t, std::vector<double>> by_role;  // synthetic: query head % 5
  stats io;
  double kv_bytes = 0;
  void add(const tally& o) {
    errors.insert(errors.end(), o.errors.begin(), o.errors.end());
    queries.insert(queries.end(), o.queries.begin(), o.queries.end());
    for (const auto& [r, e] : o.by_role) by_role[r].insert(by_role[r].end(), e.begin(), e.end());
    io += o.io;
    kv_bytes += o.kv_bytes;
  }
};

}  // namespace

int main(int argc, char** argv) try {
  const options opt = parse(argc, argv);
  if (opt.help) {
    std::fputs(usage, stdout);
    return 0;
  }
  // Opened before any work, so that a path that cannot be written fails at once.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> per_query(nullptr, &std::fclose);
  if (!opt.per_query.empty()) {
    per_query.reset(std::fopen(opt.per_query.c_str(), "w"));
    require(per_query != nullptr, "--per-query", "cannot write '", opt.per_query, "'");
  }
  io::kv_dump dump;
  if (!opt.data.empty()) {
    dump = io::load_kv_dump(opt.data);
  } else {
    testing::synthetic_kv_config cfg;
    cfg.n = opt.synthetic;
    cfg.kv_heads = opt.kv_heads;
    cfg.seed = opt.seed;
    dump = testing::make_synthetic_kv(cfg, opt.dtype, [&](index_t n, const std::function<void(index_t)>& f) { for_threads(n, opt.threads, f); });
  }
  const bool synthetic = opt.data.empty();
  const index_t g = dump.group(), dv = dump.dv, nb = opt.budgets.size();
  if (opt.top_p_cap > 0) std::printf("budgets: top-p masses, each capped at %g of n\n", opt.top_p_cap);
  std::printf("data: %s, n = %zu, d = %zu, KV heads %zu, GQA %zu, %zu steps, %s\n",
              synthetic ? "synthetic" : opt.data.c_str(), dump.n, dump.d, dump.kv_heads, g, dump.steps,
              std::string(dump.dtype_name()).c_str());

  // Per budget: mog, mog_clusters+none, oracle_topk at mog's bytes.
  std::vector<tally> mog(nb), ablation(nb), oracle(nb), appended(nb);
  std::vector<std::vector<bench::mog_breakdown>> parts(nb), appended_parts(nb);
  std::vector<index_t> rebuilds(dump.kv_heads, 0);
  std::vector<double> build_seconds(dump.kv_heads), index_frac(dump.kv_heads);
  std::vector<mog_memory> memory(dump.kv_heads);
  std::vector<index_t> shape(3 * dump.kv_heads);  // clusters, subclusters, outliers
  std::vector<std::pair<index_t, index_t>> grown_outliers(dump.kv_heads);  // of the appended index at the last budget
  std::mutex merge;
  for_threads(dump.kv_heads, opt.threads, [&](index_t h) {
    dump.visit_head(h, [&](const auto& kv) {
      const double kv_bytes = static_cast<double>(kv.n() * (kv.d() + kv.dv()) * dump.element_bytes());
      const estimator<select::dense, residual::none> dense;
      const auto dense_state = dense.build(kv);
      select::mog_clusters builder = opt.selector;
      const index_t test_steps = opt.query_sample ? dump.steps / 2 : dump.steps;
      if (opt.query_sample)
        for (index_t t = test_steps; t < dump.steps; ++t)
          for (index_t j = 0; j < g; ++j) {
            const float* r = dump.queries_of(h, t).row(j);
            builder.config.query_sample.insert(builder.config.query_sample.end(), r, r + dump.d);
          }
      if (opt.key_metric)
        for (index_t i = 0; i < kv.n(); i += 16)
          for (index_t t = 0; t < dump.d; ++t) builder.config.query_sample.push_back(to_float(kv.key_row(i)[t]));
      const auto index = builder.build(kv);  // the largest budget's; smaller ones cap outliers lower
      // As mog_clusters::with_budget: outliers take at most outlier_share of each budget, unless --outliers is given.
      std::vector<mog_index> per_budget(nb);
      std::vector<const mog_index*> index_of(nb, &index);
      for (index_t b = 0; b < nb; ++b) {
        if (opt.outliers_given) continue;
        select::mog_clusters capped = builder;
        const double most = opt.top_p_cap > 0 ? opt.top_p_cap : opt.budgets[b];  // the fraction the budget may read at most
        capped.config.outlier_fraction = std::min(builder.config.outlier_fraction, opt.outlier_share * most);
        if (capped.config.outlier_fraction == builder.config.outlier_fraction) continue;
        per_budget[b] = capped.build(kv);
        index_of[b] = &per_budget[b];
      }
      // Per budget: built on the first n - append tokens with that budget's configuration,
      // then grown by append() one decode step at a time.
      std::vector<mog_index> grown(opt.append ? nb : 0);
      for (index_t b = 0; b < grown.size(); ++b) {
        using T = typename std::decay_t<decltype(kv)>::element_type;
        const kv_view<T> prefix(kv.key_row(0), kv.value_row(0), kv.n() - opt.append, kv.d(), kv.dv());
        grown[b] = mog_index::build(prefix, index_of[b]->config());
        const auto generation = grown[b].generation();
        for (index_t step = prefix.n() + 1; step <= kv.n(); ++step)
          grown[b].append(kv_view<T>(kv.key_row(0), kv.value_row(0), step, kv.d(), kv.dv()));
        rebuilds[h] += grown[b].generation() - generation;
        if (b + 1 == nb) grown_outliers[h] = {grown[b].outliers().size(), index_of[b]->outliers().size()};
      }
      build_seconds[h] = index.build_seconds();
      index_frac[h] = static_cast<double>(index.bytes()) / kv_bytes;
      memory[h] = index.memory();
      shape[3 * h] = index.clusters();
      shape[3 * h + 1] = index.subclusters();
      shape[3 * h + 2] = index.outliers().size();
      std::vector<tally> m(nb), a(nb), o(nb), ap(nb);
      std::vector<double> ref(g * dv);
      std::vector<float> out(g * dv);
      for (index_t t = 0; t < test_steps; ++t) {
        const query_group q = dump.queries_of(h, t);
        stats ignored;
        dense.decode(dense_state, kv, q, exec::scalar{}, output_group<double>{ref.data(), g, dv, 0}, ignored);
        auto record = [&](tally& into, const auto& est, const auto& state) {
          stats s;
          est.decode(state, kv, q, exec::scalar{}, output_group<float>{out.data(), g, dv, 0}, s);
          into.io += s;
          into.kv_bytes += kv_bytes;
          for (index_t j = 0; j < g; ++j) {
            const double e = rel_l2(out.data() + j * dv, ref.data() + j * dv, dv);
            into.errors.push_back(e);
            into.by_role[(h * g + j) % 5].push_back(e);
            into.queries.push_back({h, t, h * g + j, e, static_cast<double>(s.bytes_read()) / kv_bytes});
          }
          return s;
        };
        for (index_t b = 0; b < nb; ++b) {
          select::mog_clusters sel = opt.selector;
          sel.limit = opt.top_p_cap > 0
                          ? budget::top_p(opt.budgets[b], 0,
                                          static_cast<index_t>(std::ceil(opt.top_p_cap * static_cast<double>(kv.n()))))
                          : budget::fraction(opt.budgets[b]);
          const estimator<select::mog_clusters, residual::gaussian_moments> with(sel, {opt.cross_covariance});
          const estimator<select::mog_clusters, residual::none> without(sel, {});
          const stats s = record(m[b], with, decltype(with)::state{*index_of[b], {}});
          record(a[b], without, decltype(without)::state{*index_of[b], {}});
          if (opt.append) record(ap[b], with, decltype(with)::state{grown[b], {}});
          auto explain = [&](const mog_index& idx, std::vector<bench::mog_breakdown>& into) {
            select::mog_clusters::selection chosen;
            stats ignored_stats;
            sel.select(idx, kv, q, exec::scalar{}, chosen, ignored_stats);
            const auto r = bench::breakdown(idx, chosen, kv, q, ref);
            std::lock_guard lock(merge);
            into.insert(into.end(), r.begin(), r.end());
          };
          if (opt.breakdown) {
            explain(*index_of[b], parts[b]);
            if (opt.append) explain(grown[b], appended_parts[b]);
          }
          // The oracle attends as many tokens as MoG's bytes (summaries included) would buy.
          const auto k = static_cast<index_t>(static_cast<double>(s.bytes_read()) /
                                              static_cast<double>((kv.d() + kv.dv()) * dump.element_bytes()));
          const estimator<select::oracle_topk, residual::none> top({std::min(k, kv.n())}, {});
          record(o[b], top, top.build(kv));
        }
      }
      std::lock_guard lock(merge);
      for (index_t b = 0; b < nb; ++b) {
        mog[b].add(m[b]);
        ablation[b].add(a[b]);
        oracle[b].add(o[b]);
        appended[b].add(ap[b]);
      }
    });
  });

  double mean_build = 0, mean_index = 0;
  for (index_t h = 0; h < dump.kv_heads; ++h) {
    mean_build += build_seconds[h] / static_cast<double>(dump.kv_heads);
    mean_index += index_frac[h] / static_cast<double>(dump.kv_heads);
  }
  std::printf("index: %.3f s build per KV head (one thread), %.2f %% of the head's KV bytes\n", mean_build, 100 * mean_index);
  {  // memory by part, head 0
    const double kv0 = static_cast<double>(dump.n * (dump.d + dump.dv) * dump.element_bytes()) / 100.0;
    const mog_memory& m = memory[0];
    std::printf("index of KV head 0: %zu clusters, %zu subclusters, %zu outliers; %% of KV bytes: cluster summaries %.2f, "
                "subcluster summaries %.2f, positions %.2f, offsets %.2f, cross-covariance %.2f, metric %.2f, probes %.2f, token scan %.2f, total %.2f\n",
                shape[0], shape[1], shape[2], m.cluster_summaries / kv0, m.subcluster_summaries / kv0, m.positions / kv0,
                m.offsets / kv0, m.cross_covariance / kv0, m.metric / kv0, m.probes / kv0, m.token_scan / kv0,
                m.total() / kv0);
  }
  std::printf("%-18s %7s %9s %10s %8s %8s %8s %8s\n", "method", "budget", "keys_read", "bytes_read", "err_p50", "err_p90",
              "err_p99", "err_max");
  auto row = [](const char* name, double b, const tally& t) {
    const double keys = static_cast<double>(t.io.tokens_read) / static_cast<double>(t.io.tokens_total);
    std::printf("%-18s %7.3f %8.2f%% %9.2f%% %8.4f %8.4f %8.4f %8.4f\n", name, b, 100 * keys,
                100 * static_cast<double>(t.io.bytes_read()) / t.kv_bytes, quantile(t.errors, 0.5),
                quantile(t.errors, 0.9), quantile(t.errors, 0.99), quantile(t.errors, 1.0));
  };
  for (index_t b = 0; b < nb; ++b) {
    row("mog", opt.budgets[b], mog[b]);
    row("mog_clusters+none", opt.budgets[b], ablation[b]);
    row("oracle_topk@bytes", opt.budgets[b], oracle[b]);
    if (opt.append) row("mog(appended)", opt.budgets[b], appended[b]);
  }
  if (per_query) {
    std::FILE* f = per_query.get();
    std::fprintf(f, "method,budget,kv_head,step,query_head,role,error,bytes_fraction\n");
    auto write = [&](const char* name, double b, const tally& t) {
      std::vector<query_record> queries = t.queries;  // heads finish in any order
      std::sort(queries.begin(), queries.end(), [](const query_record& x, const query_record& y) {
        return std::tie(x.kv_head, x.step, x.query_head) < std::tie(y.kv_head, y.step, y.query_head);
      });
      for (const query_record& r : queries)
        std::fprintf(f, "%s,%g,%zu,%zu,%zu,%s,%.6g,%.6g\n", name, b, r.kv_head, r.step, r.query_head,
                     synthetic ? std::string(testing::head_role_name(testing::role_of(r.query_head))).c_str() : "",
                     r.error, r.bytes_fraction);
    };
    for (index_t b = 0; b < nb; ++b) {
      write("mog", opt.budgets[b], mog[b]);
      write("mog_clusters+none", opt.budgets[b], ablation[b]);
      write("oracle_topk@bytes", opt.budgets[b], oracle[b]);
      if (opt.append) write("mog(appended)", opt.budgets[b], appended[b]);
    }
    require(std::fflush(f) == 0 && !std::ferror(f), "--per-query", "writing '", opt.per_query, "' failed");
    std::printf("per-query errors: %s\n", opt.per_query.c_str());
  }
  if (opt.append) {
    index_t total = 0;
    for (auto r : rebuilds) total += r;
    std::printf("append: %zu tokens appended one step at a time; %zu re-clusterings over %zu KV heads and %zu budgets; "
                "KV head 0 at budget %.3f: %zu outliers appended-index, %zu fresh\n",
                opt.append, total, dump.kv_heads, nb, opt.budgets.back(), grown_outliers[0].first, grown_outliers[0].second);
  }
  if (opt.breakdown) {
    std::printf("breakdown: p90 (and mean over the worst tenth of queries) of the error with one class of residual "
                "groups replaced by the truth; resid and missed: mean over the worst tenth; oracle: the same count of "
                "tokens read by true weight (own: per head, shared: one set per group), the rest at the true unread "
                "mass of each subcluster with its value mean\n%-16s %6s %15s %15s %15s %15s %15s %15s %15s %9s %9s %15s %15s\n",
                "index", "budget", "as estimated", "clusters", "subclusters", "spiky groups", "smooth groups", "mass only",
                "value only", "resid", "missed", "oracle own", "oracle shared");
    auto print = [&](const char* name, double budget, std::vector<bench::mog_breakdown> v) {
      if (v.empty()) return;
      std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.error < b.error; });
      const index_t worst = v.size() - std::max<index_t>(1, v.size() / 10);
      auto col = [&](double bench::mog_breakdown::*f) {
        std::vector<double> all;
        double tail = 0;
        for (index_t i = 0; i < v.size(); ++i) {
          all.push_back(v[i].*f);
          if (i >= worst) tail += v[i].*f / static_cast<double>(v.size() - worst);
        }
        std::printf(" %7.4f (%5.3f)", quantile(all, 0.9), tail);
      };
      std::printf("%-16s %6.3f", name, budget);
      for (auto f : {&bench::mog_breakdown::error, &bench::mog_breakdown::fix_clusters, &bench::mog_breakdown::fix_subclusters,
                     &bench::mog_breakdown::fix_spiky, &bench::mog_breakdown::fix_smooth, &bench::mog_breakdown::fix_mass,
                     &bench::mog_breakdown::fix_value})
        col(f);
      double resid = 0, missed = 0;
      for (index_t i = worst; i < v.size(); ++i) {
        resid += v[i].residual_share / static_cast<double>(v.size() - worst);
        missed += v[i].missed_share / static_cast<double>(v.size() - worst);
      }
      std::printf(" %9.4f %9.4f", resid, missed);
      col(&bench::mog_breakdown::floor_own);
      col(&bench::mog_breakdown::floor_shared);
      std::printf("\n");
    };
    for (index_t b = 0; b < nb; ++b) {
      print("mog", opt.budgets[b], parts[b]);
      print("mog(appended)", opt.budgets[b], appended_parts[b]);
    }
  }
  if (synthetic) {
    std::printf("mog error p50 / p90 by synthetic head role at budget %.3f:\n", opt.budgets.back());
    for (const auto& [r, e] : mog.back().by_role)
      std::printf("  %-9s %8.4f %8.4f\n", std::string(testing::head_role_name(static_cast<testing::head_role>(r))).c_str(),
                  quantile(e, 0.5), quantile(e, 0.9));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "floe-mog-accuracy: %s\n(see floe-mog-accuracy --help)\n", e.what());
  return 2;
}
