#!/usr/bin/env bash
# The whole test suite: release build + tests, then the AddressSanitizer/UBSan debug
# build + tests, then ThreadSanitizer over the threaded tests. Installs what is missing
# first. Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
# tsan: ThreadSanitizer over the tests that run threads (SIMD executor, thread pool,
# concurrent decodes of every registered method, conformance with split-K, MoG's split token scan).
for preset in release debug-asan tsan; do
  echo "== floe: $preset: configure, build, test" >&2
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs"
done
