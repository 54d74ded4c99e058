"""Attention entropy and sink mass of KV dumps (the evaluation tool's definitions).

For every query head h (KV head h // g), decode query q and layer of a dump:
softmax of scale * K q over all N cached tokens; entropy in nats, sink mass = weight of
token 0, plus the share of the mass the top 1% of tokens hold. Prints quantiles per
dump and layer, and over the whole dump.

    attention_stats.py DUMP_DIR [DUMP_DIR ...]
"""
import glob
import json
import os
import sys

import numpy as np


def layer_profile(path):
    keys = np.load(os.path.join(path, "keys.npy")).astype(np.float64)       # [Hkv, N, d]
    queries = np.load(os.path.join(path, "queries.npy")).astype(np.float64)  # [Hq, Q, d]
    meta = json.load(open(os.path.join(path, "meta.json")))
    hkv, n, d = keys.shape
    hq = queries.shape[0]
    scale = meta.get("scale", 1 / np.sqrt(d))
    top = max(1, n // 100)
    entropy, sink, top_mass = [], [], []
    for h in range(hq):
        z = scale * queries[h] @ keys[h // (hq // hkv)].T                    # [Q, N]
        z -= z.max(axis=1, keepdims=True)
        w = np.exp(z)
        w /= w.sum(axis=1, keepdims=True)
        entropy.append(-(w * np.log(np.maximum(w, 1e-300))).sum(axis=1))
        sink.append(w[:, 0])
        top_mass.append(np.sort(w, axis=1)[:, -top:].sum(axis=1))
    return n, np.concatenate(entropy), np.concatenate(sink), np.concatenate(top_mass)


def line(name, v, fmt):
    qs = np.quantile(v, [0, 0.1, 0.5, 0.9, 1.0])
    return f"  {name:<14}" + "  ".join(f"{k} {fmt % x}" for k, x in zip(["min", "p10", "p50", "p90", "max"], qs))


def main():
    for dump in sys.argv[1:]:
        layers = sorted(glob.glob(os.path.join(dump, "layer_*")))
        all_e, all_s, all_t = [], [], []
        print(f"{dump}:")
        for layer in layers:
            n, e, s, t = layer_profile(layer)
            all_e.append(e), all_s.append(s), all_t.append(t)
            print(f" {os.path.basename(layer)} (N = {n}, ln N = {np.log(n):.2f}, {len(e)} query-heads)")
            print(line("entropy", e, "%.2f"))
            print(line("sink mass", s, "%.3f"))
            print(line("top-1% mass", t, "%.3f"))
        e, s, t = np.concatenate(all_e), np.concatenate(all_s), np.concatenate(all_t)
        bands = np.histogram(e, bins=[-1, 1, 3, 5, 7, np.inf])[0] / len(e)
        print(f" all layers ({len(e)} query-heads)")
        print(line("entropy", e, "%.2f"))
        print("  entropy bands " + "  ".join(f"{b}: {100 * x:.0f}%" for b, x in
                                              zip(["< 1", "1-3", "3-5", "5-7", "> 7"], bands)))
        print(line("sink mass", s, "%.3f"))
        print(line("top-1% mass", t, "%.3f"))


if __name__ == "__main__":
    main()
