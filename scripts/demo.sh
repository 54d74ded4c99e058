#!/usr/bin/env bash
# The main job: builds floe (release) and runs the evaluation tool floe-eval on its
# embedded synthetic KV cache (32K tokens, 8 KV heads, GQA-4): error against the dense
# reference and bytes read, for every registered method and budget.
# Usage: bash scripts/demo.sh [floe-eval arguments, see --help]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target floe-eval >/dev/null
exec build/release/bench/eval/floe-eval "$@"
