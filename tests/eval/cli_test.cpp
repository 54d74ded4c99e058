// floe-eval's command line: defaults as documented, every bad value rejected naming the flag.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "cli.hpp"
#include "driver.hpp"

using namespace floe::eval;

namespace {
options parse(std::vector<const char*> args) {
  args.insert(args.begin(), "floe-eval");
  return parse_options(static_cast<int>(args.size()), args.data());
}
std::string flag_of(std::vector<const char*> args) {
  try {
    parse(std::move(args));
  } catch (const floe::invalid_argument& e) {
    return e.argument();
  }
  return "no error";
}
}  // namespace

TEST_CASE("cli: defaults are the issue's: 32K synthetic, 8 KV heads, GQA 4, budgets 1/2/5/10%", "[eval][cli]") {
  const options o = parse({});
  CHECK(o.data.empty());
  CHECK(o.synthetic.n == 32768);
  CHECK(o.synthetic.kv_heads == 8);
  CHECK(o.synthetic.group == 4);
  CHECK(o.synthetic.queries == default_synthetic_queries);
  CHECK(o.budgets == std::vector<double>{0.01, 0.02, 0.05, 0.1});
  CHECK(o.methods.empty());
  CHECK(o.threads >= 1);
  CHECK(usage.find("--synthetic N") != std::string_view::npos);
}

TEST_CASE("cli: values are parsed, with K suffixes and --flag=value", "[eval][cli]") {
  const options o = parse({"--synthetic", "8K", "--methods=dense,oracle_topk", "--budgets", "0.5, 1", "--threads", "3",
                           "--queries", "5", "--dtype", "bf16", "--seed", "0", "--csv", "x.csv", "--no-progress"});
  CHECK(o.synthetic.n == 8192);
  CHECK(o.methods == std::vector<std::string>{"dense", "oracle_topk"});
  CHECK(o.budgets == std::vector<double>{0.5, 1.0});
  CHECK(o.threads == 3);
  CHECK(o.synthetic.queries == 5);
  CHECK(o.dtype == "bf16");
  CHECK(o.synthetic.seed == 0);
  CHECK(o.csv == "x.csv");
  CHECK_FALSE(o.progress);
  CHECK(parse({"--data", "dumps", "--layers", "0,8"}).layers == std::vector<long>{0, 8});
}

TEST_CASE("cli: bad options are rejected naming the flag", "[eval][cli]") {
  CHECK(flag_of({"--budgets", "1.5"}) == "--budgets");
  CHECK(flag_of({"--budgets", "abc"}) == "--budgets");
  CHECK(flag_of({"--budgets", ","}) == "--budgets");
  CHECK(flag_of({"--synthetic", "0"}) == "--synthetic");
  CHECK(flag_of({"--synthetic", "-5"}) == "--synthetic");
  CHECK(flag_of({"--threads", "two"}) == "--threads");
  CHECK(flag_of({"--dtype", "f64"}) == "--dtype");
  CHECK(flag_of({"--methods"}) == "--methods");
  CHECK(flag_of({"--frobnicate"}) == "--frobnicate");
  CHECK(flag_of({"--data", "x", "--synthetic", "4096"}) == "--data");
  CHECK(flag_of({"--layers", "2"}) == "--layers");
  // Unknown method names are caught before any work starts.
  const auto registry = registered_methods<timing_executor>();
  CHECK_THROWS_WITH(plan_runs(registry, parse({"--methods", "dense,nope"})), Catch::Contains("'--methods'"));
}
