#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA executor's tests, its decode bench and the
# PyTorch baseline in one run, results under $OUT (or ./cuda-results). Uses the binaries
# in build/cudadev-bin (scripts/cuda/build_for_device.sh) when present, else fails: build them first.
set -uo pipefail
out=${OUT:-cuda-results}
mkdir -p "$out"
bin=build/cudadev-bin
export LD_LIBRARY_PATH=$PWD/$bin/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/gpu.txt"
for t in floe_cuda_executor_test floe_cuda_conformance_test floe_cuda_top_k_test; do
  echo "== $t"
  "$bin/$t" --durations yes 2>&1 | tail -25 | tee "$out/$t.txt"
  echo "rc=${PIPESTATUS[0]}"
done
echo "== bench"
"$bin/floe_cuda_decode_bench" --benchmark_format=console --benchmark_out="$out/cuda_decode_bench.json" \
  --benchmark_out_format=json --benchmark_min_time=0.2 ${FLOE_BENCH_FILTER:+--benchmark_filter=$FLOE_BENCH_FILTER} 2>&1 | tee "$out/bench.txt" | tail -40
echo "== chunk sizes (dense bf16 d128): automatic above, fixed here"
for c in 1024 2048 4096; do
  FLOE_CUDA_CHUNK=$c "$bin/floe_cuda_decode_bench" --benchmark_filter='cuda/dense/bf16/d128.*N:131072' \
    --benchmark_min_time=0.2 2>&1 | grep cuda/ | sed "s/^/chunk $c: /" | tee -a "$out/chunks.txt"
done
echo "== torch"
python3 cuda/bench/torch_decode_baseline.py --json "$out/torch.json" 2>&1 | tee "$out/torch.txt" | tail -40
