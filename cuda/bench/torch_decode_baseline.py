#!/usr/bin/env python3
"""Dense decode attention through PyTorch's scaled_dot_product_attention, the baseline
floe_cuda_decode_bench is compared with: the same shapes, KV copies rotated past L2,
each SDPA backend that accepts the case, median of CUDA-event timings.

    python3 cuda/bench/torch_decode_baseline.py [--reps 50] [--json out.json]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_case(dtype, d, hq, hkv, n, batch, backend, reps):
    step_bytes = batch * hkv * n * d * 2 * torch.finfo(dtype).bits // 8
    copies = max(1, (512 << 20) // step_bytes)
    ks = [torch.randn(batch, hkv, n, d, device="cuda", dtype=dtype) for _ in range(copies)]
    vs = [torch.randn(batch, hkv, n, d, device="cuda", dtype=dtype) for _ in range(copies)]
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=dtype)
    with sdpa_kernel([backend]):
        F.scaled_dot_product_attention(q, ks[0], vs[0], enable_gqa=True)  # may raise: backend refuses
        torch.cuda.synchronize()
        times = []
        for r in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(q, ks[r % copies], vs[r % copies], enable_gqa=True)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    us = statistics.median(times)
    return us, step_bytes / (us * 1e-6) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| KV | shape | N | batch | backend | µs | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for dtype, tname in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        for d, hq, hkv in ((128, 32, 8), (64, 9, 3)):
            for n in (4096, 32768, 131072):
                for batch in (1, 8):
                    for bname, backend in backends.items():
                        try:
                            us, gbps = time_case(dtype, d, hq, hkv, n, batch, backend, args.reps)
                        except RuntimeError as e:  # the backend does not take this case
                            continue
                        rows.append(dict(type=tname, d=d, hq=hq, hkv=hkv, n=n, batch=batch, backend=bname, us=us, gbps=gbps))
                        print(f"| {tname} | d{d}_hq{hq}_hkv{hkv} | {n} | {batch} | {bname} | {us:.1f} | {gbps:.0f} |", flush=True)
                        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
