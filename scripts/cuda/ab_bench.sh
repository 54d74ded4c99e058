#!/usr/bin/env bash
# A/B of two builds of floe_cuda_decode_bench in one device call, rounds alternating so
# that drift of a shared machine falls on both: one line per case and binary, then
# ab_summary.py's table (paired ratios per round, their geomean).
#   scripts/cuda/ab_bench.sh BEFORE_BIN AFTER_BIN FILTER [ROUNDS=2] [MIN_TIME=0.3]
set -uo pipefail
if [[ $# -lt 3 || $1 == -h || $1 == --help ]]; then
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
before=$1 after=$2 filter=$3 rounds=${4:-2} min_time=${5:-0.3}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  for bin in "$before" "$after"; do
    echo "== round $r: $bin"
    "$bin" --benchmark_filter="$filter" --benchmark_min_time="$min_time" 2>&1 |
      awk '/^cuda\// {print $1, $2, $3}'
  done
done | tee "$raw"
echo "== summary"
python3 "$(dirname "$0")/ab_summary.py" "$raw"
