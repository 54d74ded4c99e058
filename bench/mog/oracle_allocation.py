#!/usr/bin/env python3
"""How low could p90 go if every decode step chose its own budget, knowing its errors?

Reads the CSV of `floe-mog-accuracy --per-query FILE` run over a grid of budgets. A
selection serves the g query heads of one KV head at one step (a "call"): each call may
take any budget of the grid. For each cap on the mean bytes read, this finds the lowest
error quantile any such per-call choice reaches, by an exact dynamic program over calls
(state: queries above the threshold so far; value: least total bytes), and prints it next
to the best single budget for all calls under the same cap.

The choice sees the errors it is judged on, so it bounds from below what any per-step
budget rule (a predicted error, a top-p mass) can reach with this index and these budgets;
it is not such a rule. docs/log/mog.md, "Budgets chosen per step".
"""
import argparse
import collections
import csv
import math
import sys


def load(path, method):
    calls = collections.defaultdict(dict)  # (kv_head, step) -> budget -> [bytes, [errors]]
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["method"] != method:
                continue
            key = (int(row["kv_head"]), int(row["step"]))
            entry = calls[key].setdefault(float(row["budget"]), [float(row["bytes_fraction"]), []])
            entry[1].append(float(row["error"]))
    if not calls:
        sys.exit(f"oracle_allocation: no rows of method '{method}' in {path}")
    budgets = sorted(next(iter(calls.values())))
    for key, by_budget in calls.items():
        if sorted(by_budget) != budgets:
            sys.exit(f"oracle_allocation: call {key} lacks some budgets; rerun with one --budgets list")
    return calls, budgets


def allowed_above(count, q):
    """Queries that may lie above the q-quantile: the tool's quantile is the ceil(q n)-th smallest."""
    return count - max(1, math.ceil(q * count))


def least_bytes(calls, budgets, threshold, limit):
    """Least mean bytes with at most `limit` queries above `threshold`, and that choice."""
    inf = float("inf")
    best = [0.0] + [inf] * limit  # best[v]: least total bytes with v queries above so far
    picks = []
    for by_budget in calls.values():
        options = [(by_budget[b][0], sum(e > threshold for e in by_budget[b][1]), b) for b in budgets]
        nxt, pick = [inf] * (limit + 1), [None] * (limit + 1)
        for v, total in enumerate(best):
            if total == inf:
                continue
            for cost, above, b in options:
                w = v + above
                if w <= limit and total + cost < nxt[w]:
                    nxt[w], pick[w] = total + cost, (v, b)
        best = nxt
        picks.append(pick)
    v = min(range(limit + 1), key=lambda i: best[i])
    total = best[v]
    if total == inf:
        return inf, []
    chosen = []  # per call, last call first
    for pick in reversed(picks):
        v, b = pick[v]
        chosen.append(b)
    return total / len(calls), chosen


def quantile(errors, q):
    errors = sorted(errors)
    return errors[min(len(errors), max(1, math.ceil(q * len(errors)))) - 1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="output of floe-mog-accuracy --per-query")
    p.add_argument("--method", default="mog", help="method rows to use (default mog)")
    p.add_argument("--quantile", type=float, default=0.9, help="error quantile to lower (default 0.9)")
    p.add_argument("--caps", default="0.03,0.04,0.05", help="caps on the mean bytes fraction (default 0.03,0.04,0.05)")
    a = p.parse_args()
    if not 0 < a.quantile < 1:
        p.error("--quantile must lie in (0, 1)")
    try:
        caps = [float(x) for x in a.caps.split(",")]
    except ValueError:
        p.error(f"--caps expects a comma-separated list of fractions, got '{a.caps}'")
    calls, budgets = load(a.csv, a.method)
    count = sum(len(by_budget[budgets[0]][1]) for by_budget in calls.values())
    limit = allowed_above(count, a.quantile)
    uniform = []
    for b in budgets:
        errors = [e for by_budget in calls.values() for e in by_budget[b][1]]
        mean_bytes = sum(by_budget[b][0] for by_budget in calls.values()) / len(calls)
        uniform.append((mean_bytes, quantile(errors, a.quantile), b))
    print(f"{a.method}: {len(calls)} calls, {count} queries, {len(budgets)} budgets; "
          f"p{round(100 * a.quantile)} allows {limit} queries above it")
    print(f"{'cap':>6} {'one budget for all':>26} {'per-call choice':>18} {'its mean bytes':>15}")
    thresholds = sorted({e for by_budget in calls.values() for b in budgets for e in by_budget[b][1]})
    for cap in caps:
        fits = [u for u in uniform if u[0] <= cap]
        one = f"{fits[-1][1]:.4f} (budget {fits[-1][2]:g})" if fits else "none fits"
        lo, hi = 0, len(thresholds) - 1  # least threshold whose least bytes fit the cap
        if least_bytes(calls, budgets, thresholds[hi], limit)[0] > cap:
            print(f"{cap:>6.3f} {one:>26} {'none fits':>18}")
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if least_bytes(calls, budgets, thresholds[mid], limit)[0] <= cap:
                hi = mid
            else:
                lo = mid + 1
        mean_bytes, chosen = least_bytes(calls, budgets, thresholds[lo], limit)
        taken = collections.Counter(chosen)
        spread = ", ".join(f"{b:g}: {taken[b]}" for b in budgets if taken[b])
        print(f"{cap:>6.3f} {one:>26} {thresholds[lo]:>18.4f} {100 * mean_bytes:>14.2f}%   calls per budget: {spread}")


if __name__ == "__main__":
    main()
