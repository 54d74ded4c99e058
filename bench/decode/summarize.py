#!/usr/bin/env python3
"""Turns decode_bench's JSON output into the table of docs/benchmarks.md (the medians when
the run had --benchmark_repetitions).

    decode_bench --benchmark_out=decode.json --benchmark_out_format=json
    python3 bench/decode/summarize.py decode.json [--cpu]

--cpu: one-thread rows from the process's CPU time instead of the wall clock (GB/s,
speedups and ratios recomputed, bw_fraction left out: the streaming read is timed by the
wall clock). For a loaded machine, where the wall clock counts other processes' time;
2-thread rows stay on the wall clock (their CPU time is one thread's).
"""
import json
import re
import sys

NAME = re.compile(r"decode/(?P<exec>simd|scalar)/(?P<access>dense|gathered|paged\d+)/(?P<type>\w+)/"
                  r"(?P<shape>d\d+_hq\d+_hkv\d+)/N:(?P<n>\d+)/threads:(?P<threads>\d+)")


def use_cpu_time(b):
    """Rescales a one-thread case's wall-clock figures to its CPU time."""
    if int(NAME.match(b["name"])["threads"]) != 1:
        return b
    b = dict(b)
    if "GB/s" in b:
        b["GB/s"] *= b["real_time"] / b["cpu_time"]
    b["real_time"] = b["cpu_time"]
    b.pop("bw_fraction", None)
    b.pop("bw_fraction_scattered", None)
    return b


def main(path, cpu=False):
    with open(path) as f:
        report = json.load(f)
    ctx = report["context"]
    print(f"host: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs, load average "
          f"{', '.join(f'{x:.2f}' for x in ctx.get('load_avg', []))}; floe_simd_arch {ctx.get('floe_simd_arch', '?')}")
    rows = {}
    benches = report["benchmarks"]
    if any(b.get("run_type") == "aggregate" for b in benches):  # --benchmark_repetitions: medians
        benches = [b for b in benches if b.get("aggregate_name") == "median"]
    for b in benches:
        if b["name"].startswith("stream_read"):
            print(f"{b['name'].split('/iterations')[0]}: median {b['GB/s']:.2f} GB/s, best {b['best_GB/s']:.2f} GB/s")
            continue
        m = NAME.match(b["name"])
        if not m:
            continue
        if cpu:
            b = use_cpu_time(b)
        key = (m["type"], m["shape"], int(m["n"]), int(m["threads"]))
        access = "paged" if m["access"].startswith("paged") else m["access"]  # any block size
        rows.setdefault(key, {})[(m["exec"], access)] = b
    print()
    print("| KV | shape | N | thr | simd dense ms | GB/s | bw_fraction | scalar dense ms | speedup "
          "| simd gathered GB/s | gathered/dense | scalar gathered ms | paged GB/s | paged/dense "
          "| scattered read GB/s | paged/scattered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(rows, key=lambda k: (k[1] != "d128_hq32_hkv8", k[0], k[2], k[3])):
        r = rows[key]
        dense, sdense = r.get(("simd", "dense")), r.get(("scalar", "dense"))
        gath, sgath, paged = r.get(("simd", "gathered")), r.get(("scalar", "gathered")), r.get(("simd", "paged"))
        cell = lambda b, k, fmt: fmt.format(b[k]) if b and k in b else "-"
        speedup = f"{sdense['real_time'] / dense['real_time']:.1f}x" if dense and sdense else "-"
        g_ratio = f"{gath['GB/s'] / dense['GB/s']:.2f}" if gath and dense else "-"
        p_ratio = f"{paged['GB/s'] / dense['GB/s']:.2f}" if paged and dense else "-"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {cell(dense, 'real_time', '{:.2f}')} "
              f"| {cell(dense, 'GB/s', '{:.2f}')} | {cell(dense, 'bw_fraction', '{:.2f}')} "
              f"| {cell(sdense, 'real_time', '{:.1f}')} | {speedup} | {cell(gath, 'GB/s', '{:.2f}')} | {g_ratio} "
              f"| {cell(sgath, 'real_time', '{:.2f}')} | {cell(paged, 'GB/s', '{:.2f}')} | {p_ratio} "
              f"| {cell(paged, 'scattered_GB/s', '{:.2f}')} | {cell(paged, 'bw_fraction_scattered', '{:.2f}')} |")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    main(args[0] if args else "decode.json", cpu="--cpu" in sys.argv[1:])
