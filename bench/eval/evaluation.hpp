// The measurements of floe-eval: the dense reference in double, the attention profile
// (entropy, sink mass) of the data, and one method at one budget against the reference.
// Definitions of every column are in docs/evaluation.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "floe/any_estimator.hpp"
#include "floe/estimator.hpp"
#include "floe/exec/parallel.hpp"
#include "floe/exec/scalar.hpp"
#include "floe/io/kv_dump.hpp"
#include "floe/residual/none.hpp"
#include "floe/select/dense.hpp"
#include "progress.hpp"

namespace floe::eval {

// Dense attention on the scalar reference executor in double, and the shape of the
// attention distribution, for every (query head, decode step) of one layer.
struct layer_reference {
  index_t steps = 0, dv = 0;
  std::vector<double> out;        // [Hq, Q, dv]
  std::vector<double> entropy;    // [Hq, Q], nats
  std::vector<double> sink_mass;  // [Hq, Q], attention weight of token 0
  std::vector<double> top1_mass;  // [Hq, Q], weight of the N/100 heaviest tokens (at least 1)

  const double* row(index_t query_head, index_t step) const { return out.data() + (query_head * steps + step) * dv; }
};

// The shape of softmax(z) over all n tokens: entropy (nats), token 0's weight, and the
// weight of the n/100 heaviest tokens (at least one). z is reordered.
struct attention_shape {
  double entropy = 0, sink_mass = 0, top1_mass = 0;
};

inline attention_shape shape_of(std::vector<float>& z) {
  const double top = *std::max_element(z.begin(), z.end());
  double sum = 0, weighted = 0;
  for (float x : z) {
    const double w = std::exp(static_cast<double>(x) - top);
    sum += w;
    weighted += w * (static_cast<double>(x) - top);
  }
  attention_shape s;
  s.entropy = std::log(sum) - weighted / sum;
  s.sink_mass = std::exp(static_cast<double>(z[0]) - top) / sum;
  const auto heavy = static_cast<std::ptrdiff_t>(std::max<index_t>(1, z.size() / 100));
  std::nth_element(z.begin(), z.begin() + heavy - 1, z.end(), std::greater<>());
  double mass = 0;
  for (auto it = z.begin(); it != z.begin() + heavy; ++it) mass += std::exp(static_cast<double>(*it) - top);
  s.top1_mass = mass / sum;
  return s;
}

inline layer_reference compute_reference(const io::kv_dump& dump, index_t steps, const parallel_for_fn& parallel_for,
                                         progress* bar = nullptr) {
  layer_reference ref;
  ref.steps = steps;
  ref.dv = dump.dv;
  ref.out.assign(dump.q_heads * steps * dump.dv, 0.0);
  ref.entropy.assign(dump.q_heads * steps, 0.0);
  ref.sink_mass.assign(dump.q_heads * steps, 0.0);
  ref.top1_mass.assign(dump.q_heads * steps, 0.0);
  const estimator<select::dense, residual::none> dense;
  const exec::scalar scalar;
  const index_t g = dump.group();
  parallel_for(dump.kv_heads, [&](index_t h) {
    dump.visit_head(h, [&](const auto& kv) {
      const auto st = dense.build(kv);
      std::vector<float> z(kv.n());
      for (index_t t = 0; t < steps; ++t) {
        const query_group q = dump.queries_of(h, t);
        output_group<double> o{ref.out.data() + (h * g * steps + t) * dump.dv, g, dump.dv, steps * dump.dv};
        stats ignored;
        dense.decode(st, kv, q, scalar, o, ignored);
        for (index_t j = 0; j < g; ++j) {
          scalar.score(kv, q, j, token_range{0, kv.n()}, z.data());
          const index_t at = (h * g + j) * steps + t;
          const attention_shape shape = shape_of(z);
          ref.entropy[at] = shape.entropy;
          ref.sink_mass[at] = shape.sink_mass;
          ref.top1_mass[at] = shape.top1_mass;
        }
        if (bar) bar->tick();
      }
    });
  });
  return ref;
}

// ||a - ref|| / ||ref||; a NaN anywhere gives +inf, a zero reference gives 0 or +inf.
inline double relative_l2_error(const float* a, const double* ref, index_t dv) {
  double diff = 0, norm = 0;
  for (index_t j = 0; j < dv; ++j) {
    const double e = static_cast<double>(a[j]) - ref[j];
    diff += e * e;
    norm += ref[j] * ref[j];
  }
  if (!(diff == diff)) return std::numeric_limits<double>::infinity();
  if (norm == 0) return diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

// What one method at one budget accumulated over every layer it ran on.
struct method_tally {
  stats io;                     // reads, summed over calls
  double kv_bytes_total = 0;    // bytes of the whole K and V, summed over calls
  std::vector<double> errors;   // one per (query head, step)
  double decode_seconds = 0;    // summed over calls (and threads)
  index_t query_heads = 0;      // (query head, step) pairs decoded
  index_t certified = 0;        // of those, decoded by a call that reported a certificate
  index_t certificate_held = 0; // of those, with error <= the certificate
};

// Runs `est` over every (KV head, step) of one layer on `exec`, timing each decode call,
// and adds the reads, errors and time to `tally`.
template <Executor E>
void run_method(const any_estimator<E>& est, const io::kv_dump& dump, const layer_reference& ref, index_t steps,
                const E& exec, const parallel_for_fn& parallel_for, method_tally& tally, progress* bar = nullptr) {
  using clock = std::chrono::steady_clock;
  const index_t g = dump.group(), dv = dump.dv;
  std::vector<method_tally> per_head(dump.kv_heads);
  parallel_for(dump.kv_heads, [&](index_t h) {
    method_tally& mine = per_head[h];
    dump.visit_head(h, [&](const auto& kv) {
      const auto st = est.build(kv);
      std::vector<float> out(g * dv);
      for (index_t t = 0; t < steps; ++t) {
        const query_group q = dump.queries_of(h, t);
        const output_group<float> o{out.data(), g, dv, 0};
        const auto start = clock::now();
        stats call;
        est.decode(st, kv, q, exec, o, call);
        mine.decode_seconds += std::chrono::duration<double>(clock::now() - start).count();
        mine.io += call;
        mine.kv_bytes_total += static_cast<double>(kv.n() * (kv.d() + kv.dv()) * dump.element_bytes());
        const bool certified = !std::isnan(call.certificate);
        for (index_t j = 0; j < g; ++j) {
          mine.errors.push_back(relative_l2_error(o.row(j), ref.row(h * g + j, t), dv));
          mine.certified += certified;
          mine.certificate_held += certified && mine.errors.back() <= call.certificate;
        }
        mine.query_heads += g;
        if (bar) bar->tick();
      }
    });
  });
  for (const auto& m : per_head) {
    tally.io += m.io;
    tally.kv_bytes_total += m.kv_bytes_total;
    tally.errors.insert(tally.errors.end(), m.errors.begin(), m.errors.end());
    tally.decode_seconds += m.decode_seconds;
    tally.query_heads += m.query_heads;
    tally.certified += m.certified;
    tally.certificate_held += m.certificate_held;
  }
}

// Nearest-rank quantile of sorted values: the smallest x with at least p of them <= x.
inline double quantile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return std::numeric_limits<double>::quiet_NaN();
  const auto rank = static_cast<index_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size(), std::max<index_t>(rank, 1)) - 1];
}

// One line of the table and the CSV.
struct eval_row {
  std::string method;
  double budget = 1.0;
  double keys_read_frac = 0, bytes_read_frac = 0;
  double err_p50 = 0, err_p90 = 0, err_p99 = 0, err_max = 0;
  double us_per_query = 0, speedup_vs_dense = 0;
  // Share of query-heads whose call reported an error certificate, and share of those
  // whose error it bounded (NaN when none reported one).
  double cert_frac = 0, cert_held = std::numeric_limits<double>::quiet_NaN();
};

inline eval_row summarize(const std::string& method, double budget, const method_tally& t, double dense_us_per_query) {
  eval_row r;
  r.method = method;
  r.budget = budget;
  r.keys_read_frac = t.io.tokens_total ? static_cast<double>(t.io.tokens_read) / static_cast<double>(t.io.tokens_total) : 0;
  r.bytes_read_frac = t.kv_bytes_total > 0 ? static_cast<double>(t.io.bytes_read()) / t.kv_bytes_total : 0;
  std::vector<double> e = t.errors;
  std::sort(e.begin(), e.end());
  r.err_p50 = quantile(e, 0.50);
  r.err_p90 = quantile(e, 0.90);
  r.err_p99 = quantile(e, 0.99);
  r.err_max = e.empty() ? r.err_p50 : e.back();
  r.us_per_query = t.query_heads ? 1e6 * t.decode_seconds / static_cast<double>(t.query_heads) : 0;
  r.speedup_vs_dense = r.us_per_query > 0 ? dense_us_per_query / r.us_per_query : 0;
  if (t.query_heads) r.cert_frac = static_cast<double>(t.certified) / static_cast<double>(t.query_heads);
  if (t.certified) r.cert_held = static_cast<double>(t.certificate_held) / static_cast<double>(t.certified);
  return r;
}

}  // namespace floe::eval
