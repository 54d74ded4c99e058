// residual_codes: 2-bit codes of keys standardised by their cluster. The scan equals the dot
// products of the decoded keys (double reference), each element sits in its Lloyd-Max cell,
// the estimate is unbiased on Gaussian keys with the quantiser's noise, and bad input is refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "support/argument_of.hpp"
#include "support/random_kv.hpp"
#include "floe/index/residual_codes.hpp"

using namespace floe;

namespace {

// Cluster c's rows drawn around its own centre with its own spread per dimension.
std::vector<float> clustered_rows(std::mt19937_64& g, const std::vector<index_t>& begin, index_t d) {
  std::vector<float> rows(begin.back() * d);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> spread(0.05f, 3.f);
  for (index_t c = 0; c + 1 < begin.size(); ++c) {
    std::vector<float> centre(d), sigma(d);
    for (index_t t = 0; t < d; ++t) centre[t] = 4.f * normal(g), sigma[t] = spread(g);
    for (index_t i = begin[c]; i < begin[c + 1]; ++i)
      for (index_t t = 0; t < d; ++t) rows[i * d + t] = centre[t] + sigma[t] * normal(g);
  }
  return rows;
}

}  // namespace

TEST_CASE("residual codes: the scan equals the decoded keys' dot products, elements in their cells", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(761);
  for (index_t d : {1, 5, 64, 128}) {
    INFO("d " << d);
    const std::vector<index_t> begin{0, 37, 37, 300, 301, 700};  // an empty and a one-row cluster
    const auto rows = clustered_rows(g, begin, d);
    const auto codes = residual_codes::build(rows.data(), 700, d, begin);
    REQUIRE(codes.tokens() == 700);
    REQUIRE(codes.clusters() == 5);
    REQUIRE(codes.bytes() == 700u * ((d + 15) / 16 * 4) + 5u * 2 * d * sizeof(float));
    const auto qd = floe::testing::random_floats(g, 5 * d, 1.f);  // 5 heads: two passes of the kernel's 4
    const auto q = query_group::make(qd.data(), 5, d);
    for (index_t c = 0; c < 5; ++c) {
      const index_t first = begin[c], last = begin[c + 1], size = last - first;
      // The cluster's mean and spread, in double.
      for (index_t t = 0; t < d; ++t) {
        double sum = 0.0, sq = 0.0;
        for (index_t i = first; i < last; ++i) sum += rows[i * d + t];
        const double mean = size ? sum / size : 0.0;
        for (index_t i = first; i < last; ++i) sq += (rows[i * d + t] - mean) * (rows[i * d + t] - mean);
        REQUIRE(codes.mean(c)[t] == Approx(mean).margin(1e-5));
        REQUIRE(codes.spread(c)[t] == Approx(size ? std::sqrt(sq / size) : 0.0).margin(1e-5));
      }
      for (const scan_kernel kernel : {scan_kernel::automatic, scan_kernel::portable}) {  // automatic: VNNI where the CPU has it
        INFO("cluster " << c << (kernel == scan_kernel::portable ? " portable" : " automatic"));
        std::vector<float> center(5 * size + 1, std::numeric_limits<float>::quiet_NaN()), maxima(5);
        codes.scan(q, c, first, last, center.data(), size, maxima.data(), kernel);
        for (index_t h = 0; h < 5; ++h) {
          float top = -std::numeric_limits<float>::infinity();
          for (index_t i = first; i < last; ++i) {
            double dot = 0.0, magnitude = 0.0, largest = 0.0, levels = 0.0;  // largest |s q_t sigma_t|, sum_t |level_t|
            for (index_t t = 0; t < d; ++t) {
              largest = std::max(largest, std::fabs(static_cast<double>(q.scale) * q.row(h)[t] * codes.spread(c)[t]));
              const double x = static_cast<double>(q.scale) * q.row(h)[t], k = codes.decoded(i, c, t);
              // The element's standardised value lies in the cell of its level.
              const double sigma = codes.spread(c)[t], level = sigma > 0 ? (k - codes.mean(c)[t]) / sigma : 0.0;
              dot += x * k, magnitude += std::fabs(x) * (std::fabs(codes.mean(c)[t]) + sigma * std::fabs(level));
              levels += std::fabs(level);
              const double u = sigma > 0 ? (rows[i * d + t] - codes.mean(c)[t]) / sigma : 0.0;
              if (sigma > 0) {
                const double lo = level < -1 ? -1e30 : level < 0 ? -residual_codes::split : level < 1 ? 0.0 : residual_codes::split;
                const double hi = level < -1 ? -residual_codes::split : level < 0 ? 0.0 : level < 1 ? residual_codes::split : 1e30;
                REQUIRE(u >= lo - 1e-4);
                REQUIRE(u <= hi + 1e-4);
              }
            }
            const float got = center[h * size + i - first];
            // Float rounding; with VNNI also the weights' int8 rounding, half a step of largest / 127 each.
            const bool vnni = kernel == scan_kernel::automatic && quantized_tile::resolve(kernel) == scan_kernel::avx512_vnni;
            REQUIRE(std::fabs(got - dot) <= 1e-5 * magnitude + 1e-6 + (vnni ? 0.5 * largest / 127 * levels * 1.001 : 0.0));
            top = std::max(top, got);
          }
          if (size) REQUIRE(maxima[h] == top);
        }
        REQUIRE(std::isnan(center[5 * size]));  // nothing written past the last row
      }
    }
  }
}

TEST_CASE("residual codes: on Gaussian keys the estimate is unbiased, with the quantiser's noise", "[mog]") {
  // Lloyd-Max levels are their cells' means: the rounding error has mean 0 and, for N(0, 1),
  // variance 0.1175 per element, so z - z_hat has variance 0.1175 sum_t (s q_t sigma_t)^2.
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(762);
  const index_t n = 20000, d = 64;
  const std::vector<index_t> begin{0, n};
  const auto rows = clustered_rows(g, begin, d);
  const auto codes = residual_codes::build(rows.data(), n, d, begin);
  const auto qd = floe::testing::random_floats(g, d, 1.f);
  const auto q = query_group::make(qd.data(), 1, d);
  std::vector<float> center(n);
  codes.scan(q, 0, 0, n, center.data(), n);
  double predicted = 0.0;
  for (index_t t = 0; t < d; ++t) {
    const double w = static_cast<double>(q.scale) * qd[t] * codes.spread(0)[t];
    predicted += 0.1175 * w * w;
  }
  double sum = 0.0, sq = 0.0;
  for (index_t i = 0; i < n; ++i) {
    double z = 0.0;
    for (index_t t = 0; t < d; ++t) z += static_cast<double>(q.scale) * qd[t] * rows[i * d + t];
    const double e = z - center[i];
    sum += e, sq += e * e;
  }
  const double mean = sum / n, variance = sq / n - mean * mean;
  INFO("error mean " << mean << " variance " << variance << " predicted " << predicted);
  REQUIRE(std::fabs(mean) <= 5.0 * std::sqrt(predicted / n));  // 5 standard errors
  REQUIRE(variance == Approx(predicted).epsilon(0.08));
}

TEST_CASE("residual codes: identical keys code exactly, bad input is refused naming the argument", "[mog]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(763);
  const index_t d = 16;
  std::vector<float> rows(50 * d);
  const auto key = floe::testing::random_floats(g, d, 2.f);
  for (index_t i = 0; i < 50; ++i) std::copy(key.begin(), key.end(), rows.begin() + i * d);
  const std::vector<index_t> begin{0, 50};
  const auto codes = residual_codes::build(rows.data(), 50, d, begin);
  const auto qd = floe::testing::random_floats(g, d, 1.f);
  const auto q = query_group::make(qd.data(), 1, d);
  std::vector<float> center(50);
  codes.scan(q, 0, 0, 50, center.data(), 50);
  double dot = 0.0;
  for (index_t t = 0; t < d; ++t) dot += static_cast<double>(q.scale) * qd[t] * key[t];
  for (float z : center) REQUIRE(z == Approx(dot).margin(1e-5));

  using floe::testing::argument_of;
  const std::vector<index_t> short_begin{0, 49}, falling{0, 30, 20, 50}, past_n{0, 60, 50};
  REQUIRE(argument_of([&] { residual_codes::build(rows.data(), 50, d, short_begin); }) == "cluster_begin");
  REQUIRE(argument_of([&] { residual_codes::build(rows.data(), 50, d, falling); }) == "cluster_begin");
  REQUIRE(argument_of([&] { residual_codes::build(rows.data(), 50, d, past_n); }) == "cluster_begin");  // no row past n read
  REQUIRE(argument_of([&] { residual_codes::build(rows.data(), 50, 0, begin); }) == "d");
  REQUIRE(argument_of([&] { residual_codes::build(nullptr, 50, d, begin); }) == "rows");
  auto bad = rows;
  bad[17 * d + 3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(argument_of([&] { residual_codes::build(bad.data(), 50, d, begin); }) == "rows");
  const std::vector<float> other_d(d + 1, 1.f);
  REQUIRE(argument_of([&] { codes.scan(query_group::make(other_d.data(), 1, d + 1), 0, 0, 50, center.data(), 50); }) == "query");
  REQUIRE(argument_of([&] { codes.scan(q, 1, 0, 50, center.data(), 50); }) == "cluster");
  auto nan_query = qd;
  nan_query[5] = std::numeric_limits<float>::quiet_NaN();
  const auto before = center;
  REQUIRE(argument_of([&] { codes.scan(query_group::make(nan_query.data(), 1, d), 0, 0, 50, center.data(), 50); }) == "query");
  REQUIRE(center == before);  // refused before anything is written
  REQUIRE(argument_of([&] { codes.scan(q, 0, 10, 51, center.data(), 50); }) == "range");
  REQUIRE(argument_of([&] { codes.scan(q, 0, 20, 10, center.data(), 50); }) == "range");
  REQUIRE(argument_of([&] { codes.scan(q, 0, 0, 50, center.data(), 50, nullptr, scan_kernel::avx2); }) == "kernel");
}
