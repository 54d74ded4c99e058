#!/usr/bin/env python3
"""Where MoG's cluster-level error comes from on a real KV dump (docs/log/mog.md,
"Cluster estimates on the SmolLM2 dumps").

A NumPy model of mog_index's top level (k-means on the keys of each KV head past the 4 sinks
and before the 64-token tail, the 2 % of n farthest keys by diagonal Mahalanobis distance
set aside as exact outliers) and of mog_clusters' refinement at a budget (clusters taken
by estimated mass, floe's fitted variance factor included, until they hold `refine` x the tokens left after outliers, sinks and
tail). Refined clusters are then counted as exact, so that what is left is the error of the
unrefined clusters' estimates alone. Two tables:

1. ranking: which cluster priority leaves the least true mass, and the least net mass
   error, in the unrefined clusters (the Gaussian estimate, the true mass, bounds);
2. estimates: the output's relative error when the unrefined clusters are estimated by
   the diagonal Gaussian, a full or low-rank covariance, with the value-key
   cross-covariance, by the true mass, from subcluster Gaussians, or from m sampled tokens.

Not floe's code: a model of it, for deciding what to build. Needs numpy.
"""
import argparse
import json
import os

import numpy as np


def kmeans(x, k, it, rng):
    c = x[rng.choice(len(x), k, replace=False)].copy()
    for _ in range(it):
        lab = ((x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None]).argmin(1)
        for j in range(k):
            m = lab == j
            if m.any():
                c[j] = x[m].mean(0)
    return lab


def rel(o, ref):
    return np.linalg.norm(o - ref) / np.linalg.norm(ref)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="a layer directory of scripts/smollm/dump_kv.sh (keys/values/queries.npy, meta.json)")
    ap.add_argument("--budget", type=float, default=0.05, help="exact-token fraction (default 0.05)")
    ap.add_argument("--clusters", type=int, default=0, help="clusters (default round(sqrt(n)))")
    ap.add_argument("--subclusters", type=int, default=6, help="subclusters per cluster (default 6)")
    ap.add_argument("--refine", type=float, default=2.0, help="refined clusters hold this x the tokens left (default 2)")
    ap.add_argument("--seed", type=int, default=1, help="k-means and sampling seed (default 1)")
    a = ap.parse_args()
    print(f"seed {a.seed}")
    rng = np.random.default_rng(a.seed)
    keys = np.load(os.path.join(a.dump, "keys.npy")).astype(np.float64)
    values = np.load(os.path.join(a.dump, "values.npy")).astype(np.float64)
    queries = np.load(os.path.join(a.dump, "queries.npy")).astype(np.float64)
    s = json.load(open(os.path.join(a.dump, "meta.json")))["scale"]
    hkv, n, d = keys.shape
    g = queries.shape[0] // hkv
    C = a.clusters or int(round(np.sqrt(n)))
    sinks, tail = 4, 64
    n_out = int(0.02 * n)
    left = max(int(a.budget * n) - n_out - sinks - tail, 0)
    rank, est = {}, {}
    for h in range(hkv):
        core = np.arange(sinks, n - tail)
        X, Y = keys[h, core], values[h, core]
        lab = kmeans(X, C, 6, rng)
        mu = np.array([X[lab == j].mean(0) for j in range(C)])
        var = np.array([X[lab == j].var(0) + 1e-9 for j in range(C)])
        keep = np.ones(len(X), bool)
        keep[np.argsort(-(((X - mu[lab]) ** 2) / var[lab]).sum(1))[:n_out]] = False
        mem = [np.where(keep & (lab == j))[0] for j in range(C)]
        mem = [m for m in mem if len(m)]
        C_h = len(mem)
        cnt = np.array([len(m) for m in mem])
        mu = np.array([X[m].mean(0) for m in mem])
        var = np.array([X[m].var(0) for m in mem])
        nu = np.array([Y[m].mean(0) for m in mem])
        lo = np.array([X[m].min(0) for m in mem])
        hi = np.array([X[m].max(0) for m in mem])
        rad = np.array([np.sqrt(((X[m] - mu[j]) ** 2).sum(1).max()) for j, m in enumerate(mem)])
        cov = [np.cov(X[m].T, bias=True) for m in mem]
        cvk = [((Y[m] - nu[j]).T @ (X[m] - mu[j])) / len(m) for j, m in enumerate(mem)]
        cvk_svd = {}
        for rk in (1, 2, 4):
            cvk_svd[rk] = []
            for cv in cvk:
                u_, s_, vt_ = np.linalg.svd(cv)
                cvk_svd[rk].append((u_[:, :rk] * s_[:rk], vt_[:rk]))
        dev = np.concatenate([X[m] - mu[j] for j, m in enumerate(mem)])
        U = np.linalg.eigh(dev.T @ dev / len(dev))[1][:, ::-1]  # pooled within-cluster directions
        lowrank = {}
        for r in (2, 8):  # key covariance: pooled directions U_r, an r x r block per cluster, the diagonal rest
            S = [U[:, :r].T @ cv @ U[:, :r] for cv in cov]
            rest = [np.maximum(np.diag(cv) - np.einsum("ti,ij,tj->t", U[:, :r], S[j], U[:, :r]), 0) for j, cv in enumerate(cov)]
            lowrank[r] = (U[:, :r], S, rest)
        # floe's fitted factor of the variance term (mog_config::variance_fit_probes): 64 keys
        # spread evenly as probes, least squares of the true log-mass above log n + s p.mu.
        probes = X[(2 * np.arange(64) + 1) * len(X) // 128] * s
        fit = np.ones(C_h)
        for j, m in enumerate(mem):
            sc = X[m] @ probes.T
            above = np.log(np.exp(sc - sc.max(0)).sum(0)) + sc.max(0) - np.log(cnt[j]) - probes @ mu[j]
            gauss = 0.5 * (probes ** 2) @ var[j]
            fit[j] = np.clip((above * gauss).sum() / (gauss * gauss).sum(), 0, 1) if (gauss * gauss).sum() > 0 else 1
        subs = []
        for m in mem:
            sl = kmeans(X[m], min(a.subclusters, len(m)), 6, rng)
            subs.append([m[sl == t] for t in range(a.subclusters) if (sl == t).any()])
        for qi in range(g):
            for step in range(queries.shape[1]):
                q = queries[h * g + qi, step]
                z = s * (keys[h] @ q)
                top = z.max()
                w = np.exp(z - top)
                total = w.sum()
                ref_out = (w[:, None] * values[h]).sum(0) / total
                wc = w[core]
                T = np.array([wc[m].sum() for m in mem])
                logE = np.log(cnt) + s * mu @ q + 0.5 * s * s * var @ (q * q) - top
                E = np.exp(logE)
                logF = np.log(cnt) + s * mu @ q + 0.5 * fit * s * s * (var @ (q * q)) - top

                def refine_by(pri):
                    ref, tok = np.zeros(C_h, bool), 0
                    for j in np.argsort(-pri):
                        if tok >= a.refine * left:
                            break
                        ref[j], tok = True, tok + cnt[j]
                    return ref

                rules = {"Gaussian estimate": logE, "fitted estimate (floe)": logF, "true mass (oracle)": np.log(T + 1e-300),
                         "box bound": s * np.maximum(lo * q, hi * q).sum(1) - top,
                         "ball bound": s * (mu @ q + rad * np.linalg.norm(q)) - top,
                         "largest estimate error (oracle)": np.log(np.abs(T - E) + 1e-300)}
                for name, pri in rules.items():
                    un = ~refine_by(pri)
                    rank.setdefault(name, []).append((abs((T[un] - E[un]).sum()) / total, T[un].sum() / total))

                un = np.where(~refine_by(logF))[0]
                exact = np.ones(n, bool)
                for j in un:
                    exact[core[mem[j]]] = False
                l0, a0 = w[exact].sum(), (w[exact][:, None] * values[h][exact]).sum(0)

                def err(D, N):
                    return rel((a0 + N.sum(0)) / (l0 + D.sum()), ref_out)

                De, Tu = E[un], T[un]
                Df = np.exp(np.array([np.log(cnt[j]) + s * mu[j] @ q + 0.5 * s * s * q @ cov[j] @ q - top for j in un]))
                tilted = np.array([nu[j] + s * cvk[j] @ q for j in un])
                Dfit = np.exp(logF[un])
                r = {"diagonal Gaussian": err(De, De[:, None] * nu[un]),
                     "diagonal, fitted factor (floe)": err(Dfit, Dfit[:, None] * nu[un]),
                     "fitted + value-key cov.": err(Dfit, Dfit[:, None] * tilted),
                     "full covariance": err(Df, Df[:, None] * nu[un]),
                     "diagonal + value-key cov.": err(De, De[:, None] * tilted),
                     "full cov. + value-key cov.": err(Df, Df[:, None] * tilted)}
                for rk, (Ur, S, rest) in lowrank.items():
                    p = Ur.T @ q
                    Dl = np.exp(np.array([np.log(cnt[j]) + s * mu[j] @ q + 0.5 * s * s * (rest[j] @ (q * q) + p @ S[j] @ p) - top for j in un]))
                    r[f"key cov. in {rk} pooled directions + diagonal"] = err(Dl, Dl[:, None] * nu[un])
                for rk in (2, 4, 8):  # Cov(v, k) U_r U_r^T q: dv x r values per cluster
                    Ur = U[:, :rk]
                    t_r = np.array([nu[j] + s * (cvk[j] @ Ur) @ (Ur.T @ q) for j in un])
                    r[f"fitted + value-key cov. in {rk} pooled key directions"] = err(Dfit, Dfit[:, None] * t_r)
                for rk in (1, 2, 4):  # each cluster's own rank-r SVD of Cov(v, k): (dv + d) x r values
                    t_r = np.array([nu[j] + s * (cvk_svd[rk][j][0] @ (cvk_svd[rk][j][1] @ q)) for j in un])
                    r[f"fitted + value-key cov. SVD {rk}"] = err(Dfit, Dfit[:, None] * t_r)
                r["true mass, value mean"] = err(Tu, Tu[:, None] * nu[un])
                r["true mass + value-key cov."] = err(Tu, Tu[:, None] * tilted)
                Ds, Ns = [], []
                for j in un:
                    e = np.array([np.exp(np.log(len(m)) + s * X[m].mean(0) @ q + 0.5 * s * s * X[m].var(0) @ (q * q) - top) for m in subs[j]])
                    Ds.append(e.sum())
                    Ns.append(sum(ei * Y[m].mean(0) for ei, m in zip(e, subs[j])))
                r["subcluster Gaussians (all read)"] = err(np.array(Ds), np.array(Ns))
                for m_s in (1, 4):
                    D, N, Dc = [], [], []
                    for jj, j in enumerate(un):
                        pick = rng.choice(mem[j], min(m_s, cnt[j]), replace=False)
                        D.append(cnt[j] * wc[pick].mean())
                        N.append(cnt[j] * (wc[pick][:, None] * Y[pick]).mean(0))
                        Dc.append(wc[pick].mean() * cnt[j])
                    r[f"{m_s} sampled token(s) per cluster"] = err(np.array(D), np.array(N))
                    Dc = np.array(Dc)
                    r[f"{m_s} sampled: mass only, value mean"] = err(Dc, Dc[:, None] * nu[un])
                for k, v in r.items():
                    est.setdefault(k, []).append(v)
    print(f"{a.dump}: n = {n}, d = {d}, {hkv} KV heads x {g} query heads x {queries.shape[1]} steps, "
          f"{C} clusters, budget {a.budget} ({left} tokens left after {n_out} outliers, sinks and tail; refine {a.refine}x)")
    print("\n1. refinement order: unrefined clusters' |net mass error| and true mass, shares of the total")
    print(f"   {'priority':34s} {'error p50':>9s} {'p90':>7s} {'mass p50':>9s} {'p90':>7s}")
    for k, v in rank.items():
        v = np.array(v)
        print(f"   {k:34s} {np.percentile(v[:, 0], 50):9.4f} {np.percentile(v[:, 0], 90):7.4f} "
              f"{np.percentile(v[:, 1], 50):9.4f} {np.percentile(v[:, 1], 90):7.4f}")
    print("\n2. output error, refined clusters exact, unrefined ones estimated by")
    print(f"   {'estimate':34s} {'p50':>7s} {'p90':>7s}")
    for k, v in est.items():
        print(f"   {k:34s} {np.percentile(v, 50):7.4f} {np.percentile(v, 90):7.4f}")


if __name__ == "__main__":
    main()
