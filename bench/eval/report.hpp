// floe-eval's output: the readable table, the CSV (columns fixed by csv_columns) and the
// summary of the data's attention entropy and sink mass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "evaluation.hpp"

namespace floe::eval {

inline constexpr std::string_view csv_columns =
    "method,budget,keys_read_frac,bytes_read_frac,err_p50,err_p90,err_p99,err_max,us_per_query,speedup_vs_dense,cert_frac,cert_held";

inline std::string format(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

inline void write_csv(std::ostream& out, const std::vector<eval_row>& rows) {
  out << csv_columns << "\n";
  for (const auto& r : rows)
    out << r.method << ',' << format("%g", r.budget) << ',' << format("%.6g", r.keys_read_frac) << ','
        << format("%.6g", r.bytes_read_frac) << ',' << format("%.6g", r.err_p50) << ',' << format("%.6g", r.err_p90)
        << ',' << format("%.6g", r.err_p99) << ',' << format("%.6g", r.err_max) << ','
        << format("%.3f", r.us_per_query) << ',' << format("%.4g", r.speedup_vs_dense) << ','
        << format("%.4g", r.cert_frac) << ',' << (std::isnan(r.cert_held) ? std::string() : format("%.4g", r.cert_held))
        << "\n";
}

inline void write_table(std::ostream& out, const std::vector<eval_row>& rows) {
  std::size_t width = 6;
  for (const auto& r : rows) width = std::max(width, r.method.size());
  const std::string pad(width - 6, ' ');
  out << "method" << pad
      << "  budget  keys read  bytes read    err p50    err p90    err p99    err max   us/query  speed-up  cert held\n";
  for (const auto& r : rows) {
    char line[256];
    std::snprintf(line, sizeof line, "  %6.3g  %8.2f%%  %9.2f%%  %9.2e  %9.2e  %9.2e  %9.2e  %9.1f  %7.2fx", r.budget,
                  100 * r.keys_read_frac, 100 * r.bytes_read_frac, r.err_p50, r.err_p90, r.err_p99, r.err_max,
                  r.us_per_query, r.speedup_vs_dense);
    // Certificates: the share of certified query-heads whose error they bounded.
    const std::string held = std::isnan(r.cert_held) ? "          -" : format("  %8.1f%%", 100 * r.cert_held);
    out << r.method << std::string(width - r.method.size(), ' ') << line << held << "\n";
  }
}

// Quantiles of the entropy, the sink mass and the top-1% mass over every (query head,
// step), and how the entropies fall into bands, so that synthetic and real data can be
// compared (docs/real-model.md uses the same definitions).
inline void write_profile(std::ostream& out, std::vector<double> entropy, std::vector<double> sink,
                          std::vector<double> top1, index_t n) {
  if (entropy.empty()) return;
  std::sort(entropy.begin(), entropy.end());
  std::sort(sink.begin(), sink.end());
  std::sort(top1.begin(), top1.end());
  auto line = [&](const std::vector<double>& v, const char* fmt) {
    std::string s;
    for (double p : {0.0, 0.1, 0.5, 0.9, 1.0}) {
      const char* name = p == 0.0 ? "min" : p == 1.0 ? "max" : p == 0.1 ? "p10" : p == 0.5 ? "p50" : "p90";
      s += floe::detail::concat("  ", name, " ", format(fmt, p == 0.0 ? v.front() : quantile(v, p)));
    }
    return s;
  };
  out << "attention entropy, nats (ln N = " << format("%.2f", std::log(static_cast<double>(n))) << "), over "
      << entropy.size() << " query-heads:" << line(entropy, "%.2f") << "\n";
  const double bands[] = {1, 3, 5, 7};
  const char* names[] = {"< 1", "1-3", "3-5", "5-7", "> 7"};
  std::string hist;
  for (int b = 0; b < 5; ++b) {
    const double lo = b == 0 ? -1.0 : bands[b - 1], hi = b == 4 ? 1e300 : bands[b];
    const auto count = std::count_if(entropy.begin(), entropy.end(), [&](double x) { return x >= lo && x < hi; });
    hist += floe::detail::concat("  ", names[b], ": ",
                                 format("%.0f%%", 100.0 * static_cast<double>(count) / static_cast<double>(entropy.size())));
  }
  out << "  share of query-heads by entropy:" << hist << "\n";
  out << "sink mass (attention weight of token 0):" << line(sink, "%.3f") << "\n";
  out << "top-1% mass (weight of the N/100 heaviest tokens):" << line(top1, "%.3f") << "\n";
}

}  // namespace floe::eval
