#!/usr/bin/env bash
# The main job: builds floe (release) and runs the demo on a random KV cache, printing
# error against the dense reference and tokens read for every estimator.
# Usage: bash scripts/demo.sh [demo arguments, see --help]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target floe-quickstart >/dev/null
exec build/release/examples/quickstart/floe-quickstart "$@"
