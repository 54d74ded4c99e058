// The CUDA tests' main: without a CUDA device they report themselves skipped (exit 77,
// which ctest counts as skipped), so CI machines without a GPU stay honest.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "floe/exec/cuda.hpp"

int main(int argc, char** argv) {
  if (!floe::exec::cuda::available()) {
    std::fprintf(stderr, "floe: no CUDA device here; the CUDA executor tests are skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
