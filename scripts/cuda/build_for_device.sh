#!/usr/bin/env bash
# Builds the CUDA executor's tests and bench here (nvcc, no GPU needed) into build/cudadev (the programs to carry in build/cudadev-bin),
# with the Google Benchmark library beside them, so a GPU machine without Debian's
# packages can run them (scripts/cuda/device_check.sh).
set -euo pipefail
cmake -S . -B build/cudadev -DCMAKE_BUILD_TYPE=Release -DFLOE_WERROR=ON -DFLOE_CUDA=ON -DFLOE_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/cudadev -j"$(nproc)" --target floe_cuda_executor_test floe_cuda_conformance_test floe_cuda_top_k_test floe_cuda_decode_bench
mkdir -p build/cudadev-bin/lib
cp -L "$(ldd build/cudadev/cuda/floe_cuda_decode_bench | awk '/libbenchmark/ {print $3}')" build/cudadev-bin/lib/
for t in floe_cuda_executor_test floe_cuda_conformance_test floe_cuda_top_k_test floe_cuda_decode_bench; do cp build/cudadev/cuda/$t build/cudadev-bin/; done
