// floe-eval end to end on small caches: dense is exact and reads everything, oracle_topk
// at budget 1.0 is dense, reads are counted as documented, dumps on disk give the same
// rows as the cache they were written from, and the CSV has the documented columns.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "driver.hpp"
#include "support/random_kv.hpp"

using namespace floe;
using namespace floe::eval;

namespace {

options small_options(const std::string& dtype) {
  options o;
  o.synthetic.n = 2048;
  o.synthetic.kv_heads = 2;
  o.synthetic.group = 2;
  o.synthetic.d = o.synthetic.dv = 64;
  o.synthetic.queries = 3;
  o.synthetic.seed = floe::testing::seed() % 1000;
  o.dtype = dtype;
  o.budgets = {0.05, 1.0};
  o.threads = 2;
  o.progress = false;
  return o;
}

const eval_row& row(const eval_result& r, const std::string& method, double budget) {
  for (const auto& x : r.rows)
    if (x.method == method && x.budget == budget) return x;
  throw std::runtime_error("no row " + method);
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / (name + "_" + std::to_string(getpid()));
}

}  // namespace

TEST_CASE("floe-eval: dense is exact and reads 100%, and oracle_topk at budget 1.0 equals dense", "[eval]") {
  INFO("seed " << floe::testing::seed());
  for (const char* dtype : {"f32", "f16", "bf16"}) {
    INFO("dtype " << dtype);
    std::ostringstream log;
    options o = small_options(dtype);
    o.methods = {"dense", "streaming", "oracle_topk"};
    const auto r = run_evaluation(o, log);
    CHECK_THAT(log.str(), Catch::Contains("N = 2048, 2 KV heads, 4 query heads (GQA 2), d = 64, dv = 64"));
    REQUIRE(r.rows.size() == 1 + 2 + 2);  // dense once, streaming and oracle_topk at two budgets
    CHECK(r.entropy.size() == 4 * 3);

    const auto& dense = row(r, "dense", 1.0);
    CHECK(dense.err_max <= 1e-5);  // fp32 accumulation against the double reference (issue 3: 1e-5); 1.1e-6 seen
    CHECK(dense.err_p50 <= dense.err_p90);
    CHECK(dense.err_p90 <= dense.err_p99);
    CHECK(dense.err_p99 <= dense.err_max);
    CHECK(dense.keys_read_frac == 1.0);
    CHECK(dense.bytes_read_frac == 1.0);
    CHECK(dense.speedup_vs_dense == 1.0);
    CHECK(dense.us_per_query > 0);

    const auto& full = row(r, "oracle_topk", 1.0);
    CHECK(full.err_max <= 1e-5);
    CHECK(full.keys_read_frac == 1.0);
    CHECK(full.bytes_read_frac == 1.0);
    CHECK(row(r, "streaming", 1.0).err_max <= 1e-5);

    // Budget 0.05 of 2048 tokens: k = 103. The oracle scans all keys, streaming does not.
    const double k = 103, n = 2048;
    const auto& top = row(r, "oracle_topk", 0.05);
    CHECK(top.keys_read_frac == Approx(k / n));
    CHECK(top.bytes_read_frac == Approx((n * 64 + k * 64) / (n * 128)));
    const auto& stream = row(r, "streaming", 0.05);
    CHECK(stream.keys_read_frac == Approx(k / n));
    CHECK(stream.bytes_read_frac == Approx(k / n));
    CHECK(stream.err_p50 > full.err_max);  // dropping 95% of the tokens is visible
  }
}

TEST_CASE("floe-eval: a cache written with --save-synthetic and read with --data gives the same rows", "[eval]") {
  INFO("seed " << floe::testing::seed());
  const auto dir = temp_path("floe_eval_dump");
  std::filesystem::remove_all(dir);
  auto o = small_options("bf16");
  o.methods = {"streaming", "oracle_topk"};
  o.save_synthetic = (dir / "layer_03").string();
  std::ostringstream log;
  const auto a = run_evaluation(o, log);
  auto p = small_options("bf16");
  p.methods = o.methods;
  p.data = dir.string();
  p.layers = {3};
  const auto b = run_evaluation(p, log);
  std::filesystem::remove_all(dir);
  REQUIRE(a.rows.size() == 4);  // dense is timed but not shown
  REQUIRE(b.rows.size() == a.rows.size());
  for (index_t i = 0; i < a.rows.size(); ++i) {
    CHECK(a.rows[i].method == b.rows[i].method);
    CHECK(a.rows[i].err_p90 == b.rows[i].err_p90);
    CHECK(a.rows[i].err_max == b.rows[i].err_max);
    CHECK(a.rows[i].bytes_read_frac == b.rows[i].bytes_read_frac);
  }
  CHECK(a.entropy == b.entropy);
  CHECK(a.sink_mass == b.sink_mass);

  p.layers = {4};
  std::filesystem::create_directories(dir);
  io::save_kv_dump(dir / "layer_03", testing::make_synthetic_kv(o.synthetic, "f32"));
  CHECK_THROWS_WITH(run_evaluation(p, log), Catch::Contains("'--layers'"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("floe-eval: the CSV has exactly the documented columns", "[eval]") {
  const std::string documented =
      "method,budget,keys_read_frac,bytes_read_frac,err_p50,err_p90,err_p99,err_max,us_per_query,speedup_vs_dense,"
      "cert_frac,cert_held";
  CHECK(csv_columns == documented);

  std::ifstream doc(std::string(FLOE_SOURCE_DIR) + "/docs/evaluation.md");
  REQUIRE(doc);
  const std::string text((std::istreambuf_iterator<char>(doc)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains(documented));

  std::vector<eval_row> rows = {{"dense", 1, 1, 1, 1e-8, 2e-8, 3e-8, 4e-8, 1234.5, 1},
                                {"oracle_topk", 0.05, 0.05, 0.525, 0.1, 0.2, 0.3, 0.4, 600, 2.0575},
                                {"exp_threshold+horvitz_thompson", 0.05, 0.04, 0.2, 0.1, 0.2, 0.3, 0.4, 600, 2, 1, 0.975}};
  std::ostringstream csv;
  write_csv(csv, rows);
  std::istringstream lines(csv.str());
  std::string line;
  std::getline(lines, line);
  CHECK(line == documented);
  for (const auto& r : rows) {
    REQUIRE(std::getline(lines, line));
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    // The last field is empty (no certificate reported) for rows without one.
    REQUIRE(fields.size() == (std::isnan(r.cert_held) ? 11u : 12u));
    CHECK(fields[0] == r.method);
    CHECK(std::stod(fields[1]) == r.budget);
    CHECK(std::stod(fields[3]) == Approx(r.bytes_read_frac));
    CHECK(std::stod(fields[5]) == Approx(r.err_p90));
    CHECK(std::stod(fields[8]) == Approx(r.us_per_query));
    CHECK(std::stod(fields[9]) == Approx(r.speedup_vs_dense).epsilon(1e-3));
    CHECK(std::stod(fields[10]) == Approx(r.cert_frac));
    if (fields.size() == 12) CHECK(std::stod(fields[11]) == Approx(r.cert_held));
  }
  CHECK_FALSE(std::getline(lines, line));
}

TEST_CASE("floe-eval: error and quantile definitions", "[eval]") {
  const double ref[3] = {3, 0, 4};
  const float same[3] = {3, 0, 4}, off[3] = {3, 0, 4.5f}, nan[3] = {std::nanf(""), 0, 4};
  CHECK(relative_l2_error(same, ref, 3) == 0);
  CHECK(relative_l2_error(off, ref, 3) == Approx(0.1));
  CHECK(std::isinf(relative_l2_error(nan, ref, 3)));
  const double zero[3] = {0, 0, 0};
  CHECK(relative_l2_error(same, zero, 3) == std::numeric_limits<double>::infinity());

  std::vector<double> v(100);
  for (int i = 0; i < 100; ++i) v[static_cast<std::size_t>(i)] = i + 1;
  CHECK(quantile(v, 0.5) == 50);
  CHECK(quantile(v, 0.9) == 90);
  CHECK(quantile(v, 0.99) == 99);
  CHECK(quantile(v, 1.0) == 100);
  CHECK(quantile({7}, 0.99) == 7);

  std::vector<float> flat(400, 0.f);
  const auto uniform = shape_of(flat);
  CHECK(uniform.entropy == Approx(std::log(400.0)));
  CHECK(uniform.sink_mass == Approx(1 / 400.0));
  CHECK(uniform.top1_mass == Approx(4 / 400.0));  // the 4 heaviest of 400
  std::vector<float> peaked = {100.f, 0.f, 0.f};
  const auto one = shape_of(peaked);
  CHECK(one.entropy < 1e-30);
  CHECK(one.sink_mass == Approx(1.0));
  CHECK(one.top1_mass == Approx(1.0));  // at least one token
  std::vector<float> later = {0.f, 0.f, std::log(2.f)};
  CHECK(shape_of(later).top1_mass == Approx(0.5));
}
