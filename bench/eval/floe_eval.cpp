// floe-eval: error against bytes read for every registered estimator configuration, on a
// KV dump or the synthetic cache. docs/evaluation.md explains every column.
#include <cstdio>
#include <fstream>
#include <iostream>

#include "driver.hpp"

int main(int argc, char** argv) {
  using namespace floe::eval;
  try {
    const options o = parse_options(argc, argv);
    if (o.help) {
      std::cout << usage;
      return 0;
    }
    if (o.list_methods) {
      for (const auto& m : registered_methods<timing_executor>())
        std::printf("%-14s %s\n", m.name.c_str(), m.description.c_str());
      return 0;
    }
    const eval_result r = run_evaluation(o, std::cout);
    write_profile(std::cout, r.entropy, r.sink_mass, r.top1_mass, r.n);
    std::cout << "\n";
    write_table(std::cout, r.rows);
    if (!o.csv.empty()) {
      std::ofstream csv(o.csv);
      if (!csv) throw floe::invalid_argument("--csv", floe::detail::concat("cannot create ", o.csv));
      write_csv(csv, r.rows);
      std::cout << "\nCSV: " << o.csv << "\n";
    }
    std::printf("\nfloe-eval finished in %.1f s\n", r.seconds);
    return 0;
  } catch (const floe::invalid_argument& e) {
    std::fprintf(stderr, "floe-eval: %s\n(see floe-eval --help)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "floe-eval: error: %s\n", e.what());
    return 1;
  }
}
