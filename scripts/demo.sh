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
# With no arguments: one configuration per method family, so the table prints in well
# under a minute on 2 cores (`floe-eval` alone runs every registered configuration).
if (($# == 0)); then
  set -- --queries 4 --budgets 0.02,0.1 --methods dense,streaming,oracle_topk,mog,mog_clusters+none,topk_anchors:quantized_scan+none,topk_anchors:quantized_scan+feature_map,topk_anchors:quantized_scan+scan_completion,page_bounds
fi
exec build/release/bench/eval/floe-eval "$@"
