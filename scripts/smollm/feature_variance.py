#!/usr/bin/env python3
"""Why positive random features fail on real queries, and whether centring the proposal helps.

For each layer of a KV dump (scripts/smollm/dump_kv.sh), this measures, in numpy and
double precision, the feature-map estimate of the middle mass left after a Top-K
selection (DESIGN.md section 2, docs/methods/retrieval-completion.md) with two maps:

  prf  positive random features, omega ~ N(0, I) (floe's `positive_random`);
  qc   the same with an importance-sampled proposal: omega drawn around each query head's
       mean query (M/g features per head of the GQA group, a mixture), the weight
       p0(omega) / p_mix(omega) split over the two feature vectors (a per-feature bias),
       so the estimate stays unbiased. The per-feature relative variance of a pair (q, k)
       becomes exp(s |q + k - mu|^2) instead of exp(s |q + k|^2).

The mean query of each head comes from the first half of the decode steps (a stand-in for
the last prefill queries an engine would have); errors are measured on the second half.
Prints, per layer and map: s|q|^2 and s|q - mean|^2 (median), the median relative error
of the estimated mass, and p90 output error of selection only and of selection + map.
"""
import argparse
import json
import os
import sys

import numpy as np


def orthogonal_gaussian(m, d, rng):
    rows = []
    while sum(len(r) for r in rows) < m:
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q = q * np.sign(np.diag(r))
        lengths = np.sqrt((rng.standard_normal((d, d)) ** 2).sum(1))
        rows.append(q.T * lengths[:, None])
    return np.concatenate(rows)[:m]


def log_features(x, w, bias):  # x already scaled by sqrt(s)
    return x @ w.T + bias - 0.5 * (x * x).sum(-1, keepdims=True)


def draw(variant, m, d, means, rng):
    """Projection rows and per-feature bias; means: [g, d] scaled mean queries."""
    if variant == "prf":
        return orthogonal_gaussian(m, d, rng), np.full(m, -0.5 * np.log(m))
    g = len(means)
    per = [m // g + (1 if i < m % g else 0) for i in range(g)]
    w = np.concatenate([means[i] + orthogonal_gaussian(per[i], d, rng) for i in range(g)])
    log_p0 = -0.5 * (w ** 2).sum(1)
    log_mix = np.logaddexp.reduce(np.stack([-0.5 * ((w - mu) ** 2).sum(1) for mu in means]), axis=0) - np.log(g)
    return w, 0.5 * (log_p0 - log_mix) - 0.5 * np.log(m)


def evaluate(layer_dir, budget, m, seeds):
    meta = json.load(open(os.path.join(layer_dir, "meta.json")))
    keys_all = np.load(os.path.join(layer_dir, "keys.npy")).astype(np.float64)
    values_all = np.load(os.path.join(layer_dir, "values.npy")).astype(np.float64)
    queries = np.load(os.path.join(layer_dir, "queries.npy")).astype(np.float64)
    s = meta["scale"]
    hq, hkv = queries.shape[0], keys_all.shape[0]
    g, (n, d), steps = hq // hkv, keys_all.shape[1:], queries.shape[1]
    train = steps // 2
    k_exact = int(round(budget * n))
    sink, window = 4, min(64, k_exact // 4)  # floe-eval's with_budget split
    k_middle = k_exact - sink - window
    rows = {"prf": [], "qc": []}
    for kh in range(hkv):
        keys, values = keys_all[kh], values_all[kh]
        middle = np.arange(sink, n - window)
        centre = keys[middle].mean(0)
        centred = (keys[middle] - centre) * np.sqrt(s)
        heads = list(range(kh * g, kh * g + g))
        mean_q = {h: queries[h, :train].mean(0) for h in heads}
        scaled_means = np.array([np.sqrt(s) * mean_q[h] for h in heads])
        for variant in rows:
            for seed in range(seeds):
                w, bias = draw(variant, m, d, scaled_means, np.random.default_rng(1000 + seed))
                lk = log_features(centred, w, bias)
                for h in heads:
                    for t in range(train, steps):
                        q = queries[h, t]
                        z = s * keys @ q
                        e = np.exp(z - z.max())
                        dense = (e[:, None] * values).sum(0) / e.sum()
                        top = np.argpartition(-z[middle], k_middle)[:k_middle]
                        exact = np.concatenate([np.arange(sink), middle[top], np.arange(n - window, n)])
                        den, num = e[exact].sum(), (e[exact, None] * values[exact]).sum(0)
                        rest = np.ones(len(middle), bool)
                        rest[top] = False
                        lq = log_features((np.sqrt(s) * q)[None], w, bias)[0]
                        u = np.exp(lk + lq[None] + (s * q @ centre - z.max())).sum(1)
                        d_hat = u[rest].sum()
                        n_hat = (u[rest, None] * values[middle][rest]).sum(0)
                        completed = (num + n_hat) / (den + d_hat) if d_hat > 0 else num / den
                        norm = np.linalg.norm(dense)
                        rows[variant].append((
                            np.linalg.norm(num / den - dense) / norm,
                            np.linalg.norm(completed - dense) / norm,
                            abs(d_hat / e[middle][rest].sum() - 1.0),
                            s * q @ q,
                            s * (q - mean_q[h]) @ (q - mean_q[h]),
                        ))
    return {v: np.array(r) for v, r in rows.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", nargs="+", help="dump folders (layer_XX/ inside, or one layer folder)")
    ap.add_argument("--budget", type=float, default=0.05, help="exact tokens as a fraction of N (default 0.05)")
    ap.add_argument("--features", type=int, default=64, help="M (default 64)")
    ap.add_argument("--seeds", type=int, default=3, help="feature draws per map (default 3)")
    a = ap.parse_args()
    layers = []
    for dump in a.dumps:
        if os.path.exists(os.path.join(dump, "meta.json")):
            layers.append(dump)
        else:
            layers += sorted(os.path.join(dump, x) for x in os.listdir(dump) if x.startswith("layer_"))
    if not layers:
        sys.exit("feature_variance.py: no layer folders with meta.json under " + " ".join(a.dumps))
    print(f"budget {a.budget}, M = {a.features}, {a.seeds} draws per map; mean query from the first half of the steps")
    print(f"{'layer':40s} {'map':4s} {'s|q|^2':>7s} {'s|q-m|^2':>8s} {'mass err p50':>12s} {'sel p90':>8s} {'+map p90':>8s}")
    for layer in layers:
        for variant, r in evaluate(layer, a.budget, a.features, a.seeds).items():
            print(f"{layer:40s} {variant:4s} {np.median(r[:, 3]):7.1f} {np.median(r[:, 4]):8.1f} "
                  f"{np.median(r[:, 2]):12.3f} {np.percentile(r[:, 0], 90):8.4f} {np.percentile(r[:, 1], 90):8.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
