# The A/B of this folder: /tmp/mog_bench_{old,new} and /tmp/topk_bench_{old,new} built from
# fbbf8d8 and the change, alternating. ROUNDS: the round labels; ORDER: which binary first;
# FILTER: the mog_bench cases; TOPK=1 adds floe_topk_bench's phase_attend (two rounds).
# rounds 1-2: ROUNDS="1 2" ORDER="old new" TOPK=0 FILTER="$WIDE"; rounds 3-4 and 5-6: the defaults
# with ROUNDS="3 4" / "5 6" (after 9ffaef5 for 5-6).
WIDE='^(dense_decode_cold/131072/[14]/|mog_decode_cold/131072/[14]/50/|mog_decode_token_scan_cold/131072/[14]/25/[01]/[42]/|mog_phase_token_scan2_cold/131072/[14]/[01]/1/(25|50)/|mog_phase_cold/131072/[14]/[01]/1/50/)'
F=${FILTER:-'^(dense_decode_cold/131072/[14]/|mog_decode_cold/131072/[14]/50/|mog_decode_token_scan_cold/131072/[14]/25/[01]/2/|mog_phase_token_scan2_cold/131072/[14]/[01]/1/25/|mog_phase_cold/131072/[14]/[01]/1/50/)'}
for r in ${ROUNDS:-3 4}; do
  for b in ${ORDER:-new old}; do
    echo "== round $r $b $(date +%T)"
    /tmp/mog_bench_$b --benchmark_filter="$F" 2>&1 | grep -E "^(dense|mog)"
  done
done
[ "${TOPK:-1}" = 1 ] || exit 0
for r in 1 2; do
  for b in ${ORDER:-new old}; do
    echo "== topk round $r $b $(date +%T)"
    FLOE_BENCH_THREADS=1 FLOE_BENCH_KV_HEADS=4 /tmp/topk_bench_$b --benchmark_filter='^(phase_attend|dense)' 2>&1 | grep -E "^(phase|dense)"
  done
done
