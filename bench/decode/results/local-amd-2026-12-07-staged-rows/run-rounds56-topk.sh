F='^(dense_decode_cold/131072/[14]/|mog_decode_cold/131072/[14]/50/|mog_decode_token_scan_cold/131072/[14]/25/[01]/2/|mog_phase_token_scan2_cold/131072/[14]/[01]/1/25/|mog_phase_cold/131072/[14]/[01]/1/50/)'
for r in 5 6; do
  for b in new old; do
    echo "== round $r $b $(date +%T)"
    /tmp/mog_bench_$b --benchmark_filter="$F" 2>&1 | grep -E "^(dense|mog)"
  done
done
for r in 1 2; do
  for b in new old; do
    echo "== topk round $r $b $(date +%T)"
    FLOE_BENCH_THREADS=1 FLOE_BENCH_KV_HEADS=4 /tmp/topk_bench_$b --benchmark_filter='^(phase_attend|dense)' 2>&1 | grep -E "^(phase|dense)"
  done
done
