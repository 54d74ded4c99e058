#!/usr/bin/env python3
"""Summarises scripts/cuda/ab_bench.sh output: per case, each build's times by round and
the after/before ratio of each round (paired, so drift between rounds cancels), then the
geometric mean of the ratios over all cases and over the cases matching --group.

    python3 scripts/cuda/ab_summary.py AB_OUTPUT [--group REGEX ...]
"""
import argparse
import math
import re
import sys
from collections import defaultdict


def parse(lines):
    """{case: {binary: [time per round]}} and the binaries in order of appearance."""
    times, binaries, current = defaultdict(lambda: defaultdict(list)), [], None
    for line in lines:
        if line.startswith("== round"):
            current = line.split(":", 1)[1].strip()
            if current not in binaries:
                binaries.append(current)
            continue
        fields = line.split()
        if current and len(fields) >= 3 and fields[0].startswith("cuda/"):
            times[fields[0].removesuffix("/real_time")][current].append(float(fields[1]))
    return times, binaries


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="a file holding ab_bench.sh's output ('-': standard input)")
    ap.add_argument("--group", action="append", default=[], metavar="REGEX",
                    help="also report the geomean over the cases matching REGEX (repeatable)")
    args = ap.parse_args()
    lines = sys.stdin if args.output == "-" else open(args.output)
    times, binaries = parse(lines)
    if len(binaries) != 2 or not times:
        sys.exit(f"ab_summary: expected rounds of two binaries, found {len(binaries)} binaries and {len(times)} cases")
    before, after = binaries
    print(f"before: {before}\nafter:  {after}\ntimes in the benchmarks' unit, one per round; ratio = after / before, per round")
    width = max(len(c) for c in times)
    ratios = {}
    for case, t in times.items():
        rounds = min(len(t[before]), len(t[after]))
        ratios[case] = [t[after][r] / t[before][r] for r in range(rounds)]
        print(f"{case:<{width}}  before {' '.join(f'{x:g}' for x in t[before])}  after {' '.join(f'{x:g}' for x in t[after])}"
              f"  ratio {' '.join(f'{x:.3f}' for x in ratios[case])}")
    every = [r for rs in ratios.values() for r in rs]
    print(f"geomean ratio, all {len(ratios)} cases: {geomean(every):.4f} (range {min(every):.3f}-{max(every):.3f})")
    for pattern in args.group:
        chosen = [r for case, rs in ratios.items() if re.search(pattern, case) for r in rs]
        if chosen:
            print(f"geomean ratio, cases matching {pattern!r}: {geomean(chosen):.4f} (range {min(chosen):.3f}-{max(chosen):.3f})")
        else:
            print(f"no case matches {pattern!r}")


if __name__ == "__main__":
    main()
