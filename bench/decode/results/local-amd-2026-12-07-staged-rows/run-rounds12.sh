F='^(dense_decode_cold/131072/[14]/|mog_decode_cold/131072/[14]/50/|mog_decode_token_scan_cold/131072/[14]/25/[01]/[42]/|mog_phase_token_scan2_cold/131072/[14]/[01]/1/(25|50)/|mog_phase_cold/131072/[14]/[01]/1/50/)'
for r in 1 2; do
  for b in old new; do
    echo "== round $r $b $(date +%T)"
    /tmp/mog_bench_$b --benchmark_filter="$F" 2>&1 | grep -E "^(dense|mog)"
  done
done
