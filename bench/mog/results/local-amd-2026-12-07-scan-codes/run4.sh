B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^mog  ' | sed "s/^/$tag /"; }
export FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1
for bits in 2 1 3; do for ref in 12 16 24 32; do
  FLOE_SCRATCH_BITS=$bits run "s$bits ref$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
done; done
