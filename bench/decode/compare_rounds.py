#!/usr/bin/env python3
"""Side-by-side A/B of Google Benchmark JSON files taken in alternating rounds: per case the
best real time of each variant over its rounds, their ratio, and the median ratio.

    # PATTERN names each variant's round files with {v} for the variant:
    python3 bench/decode/compare_rounds.py 'results/dir/{v}-*.json' old new

A ratio above 1 means B was faster. Aggregate rows (--benchmark_repetitions) are skipped;
their single runs count as rounds.
"""
import collections
import glob
import json
import statistics
import sys


def best_times(pattern, variant):
    times = collections.defaultdict(list)
    for path in sorted(glob.glob(pattern.replace("{v}", variant))):
        for b in json.load(open(path))["benchmarks"]:
            if b.get("run_type") != "aggregate":
                times[b["name"]].append((b["real_time"], b["time_unit"]))
    return times


def main():
    if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    pattern, a, b = sys.argv[1:]
    if "{v}" not in pattern:
        sys.exit("PATTERN must contain {v}, where the variant's name goes")
    ta, tb = best_times(pattern, a), best_times(pattern, b)
    if not ta or not tb:
        sys.exit(f"no files match {pattern} for {a} or for {b}")
    ratios = []
    print(f"{'case':62s} {a:>9s} {b:>9s} {a + '/' + b:>9s}  rounds")
    for name, runs in ta.items():
        if name not in tb:
            continue
        best_a, best_b = min(runs)[0], min(tb[name])[0]
        ratios.append(best_a / best_b)
        unit = runs[0][1]
        print(f"{name:62s} {best_a:9.4g} {best_b:9.4g} {best_a / best_b:9.3f}  {len(runs)} / {len(tb[name])} ({unit})")
    print(f"median {a}/{b}: {statistics.median(ratios):.3f} over {len(ratios)} cases")


if __name__ == "__main__":
    main()
