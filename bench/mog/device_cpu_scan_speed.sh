#!/usr/bin/env bash
# The token scans' speed on the device host's CPU at 128K, caches cold: 4-bit keys and 2-bit
# codes at budget 2.5 % (about 5 % of the bytes) and 5 %, with dense and the default index in
# the same run, two rounds. Usage (a device run from the repository root, carrying the two
# paths below): bash bench/mog/device_cpu_scan_speed.sh; writes
# $OUT/machine.txt, $OUT/round{1,2}.json and prints a table of µs per step and x dense.
set -euo pipefail
out=${OUT:-/tmp/scan-speed}
mkdir -p "$out"
{ lscpu | grep -E '^(Model name|CPU\(s\)|L3)'; grep -o -w -m1 'avx512_vnni' /proc/cpuinfo || echo 'no avx512_vnni'; uptime; } >"$out/machine.txt"
# The device has no Eigen, xsimd or Google Benchmark: the binary is built here and carried,
#   cmake -S . -B build/device -DCMAKE_BUILD_TYPE=Release -DFLOE_MOG_BENCH_ARCH=x86-64-v4 \
#     -DFLOE_BUILD_TESTS=OFF -DFLOE_BUILD_EXAMPLES=OFF -DFLOE_CUDA=OFF
#   cmake --build build/device --target mog_bench
#   mkdir -p build/device/lib && cp /usr/lib/x86_64-linux-gnu/libbenchmark.so.1.7.1 build/device/lib/libbenchmark.so.1debian
# (run with carry: build/device/bench/mog/mog_bench, build/device/lib). BENCH, FILTER and
# ROUNDS (default 2) override the binary, the benchmark filter and the number of rounds.
bench=${BENCH:-build/device/bench/mog/mog_bench}
export LD_LIBRARY_PATH=build/device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
filter=${FILTER:-'^(dense_decode_cold/131072/[14]/|mog_decode_cold/131072/[14]/50/|mog_decode_clustered_layout_cold/131072/[14]/50/|mog_decode_token_scan_cold/131072/[14]/(25|50)/[01]/[42]/|mog_phase_token_scan2?_cold/131072/[14]/0/0/(25|50)/)'}
rounds=${ROUNDS:-2}
for round in $(seq "$rounds"); do
  "$bench" --benchmark_filter="$filter" --benchmark_format=json \
    --benchmark_out="$out/round$round.json" >/dev/null
done
python3 - $(seq -f "$out/round%g.json" "$rounds") <<'PY'
import json, sys
rounds = [json.load(open(p))["benchmarks"] for p in sys.argv[1:]]
names = [b["name"].replace("/iterations:64", "") for b in rounds[0]]
print(f"{'case (µs per step; x dense of the same g, same round)':60s}" + "".join(f"{'round ' + str(i + 1):>22s}" for i in range(len(rounds))))
for name in names:
    cells = []
    for bs in rounds:
        b = next(x for x in bs if x["name"].replace("/iterations:64", "") == name)
        g = name.split("/")[2]
        dense = next(x for x in bs if x["name"].startswith(f"dense_decode_cold/131072/{g}/"))
        t, frac = b["real_time"], b.get("bytes_read_frac")
        ratio = "" if name.startswith(("dense", "mog_phase")) else f" {dense['real_time'] / t:5.2f}x"
        cells.append(f"{t:8.0f}{ratio}" + (f" {100 * frac:5.2f}%" if frac and not name.startswith("dense") else ""))
    print(f"{name:60s}" + "".join(f"{c:>22s}" for c in cells))
PY
