B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; echo "== $tag"; "$@" 2>&1 | grep -E '^\s*(mog |budget|  *0\.)' | head -8; }
run base4 $B --threads 2 --synthetic 32768 --query-sample --token-scan --budgets 0.025
for bits in 2 1; do for resid in 0 1; do for ref in 8 16 32; do
  if [ $resid = 1 ]; then export FLOE_SCRATCH_RESID=1; else unset FLOE_SCRATCH_RESID; fi
  FLOE_SCRATCH_BITS=$bits run "bits$bits resid$resid refine$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
done; done; done
