#!/usr/bin/env python3
"""Side-by-side table of one device run: floe_cuda_decode_bench's JSON against the
fastest PyTorch SDPA backend (torch_decode_baseline.py --json) on the same shapes.

    python3 cuda/bench/summarize.py cuda_decode_bench.json torch.json
"""
import json
import re
import sys


def main():
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    bench = json.load(open(sys.argv[1]))["benchmarks"]
    torch_rows = json.load(open(sys.argv[2]))
    best = {}
    for r in torch_rows:
        key = (r["type"], r["d"], r["hq"], r["hkv"], r["n"], r["batch"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    floe = {}
    for b in bench:
        m = re.match(r"cuda/(\w+)/(\w+)/d(\d+)_hq(\d+)_hkv(\d+)/N:(\d+)/batch:(\d+)", b["name"])
        if not m:
            continue
        how, t, d, hq, hkv, n, batch = m.groups()
        floe[(how, t, int(d), int(hq), int(hkv), int(n), int(batch))] = b
    print("| KV | shape | N | batch | floe dense µs | GB/s | bw_fraction | torch best µs (backend) | torch / floe | "
          "gathered 5 % µs | paged16 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(k for k in floe if k[0] == "dense"):
        _, t, d, hq, hkv, n, batch = key
        b = floe[key]
        tb = best.get((t, d, hq, hkv, n, batch))
        gathered = floe.get(("gathered",) + key[1:])
        paged = floe.get(("paged16",) + key[1:])
        us = b["real_time"]
        cells = [t, f"d{d} Hq{hq} Hkv{hkv}", str(n), str(batch), f"{us:.1f}", f"{b['GB/s']:.0f}",
                 f"{b['bw_fraction']:.2f}",
                 f"{tb['us']:.1f} ({tb['backend']})" if tb else "-",
                 f"{tb['us'] / us:.2f}" if tb else "-",
                 f"{gathered['real_time']:.1f}" if gathered else "-",
                 f"{paged['real_time']:.1f}" if paged else "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
