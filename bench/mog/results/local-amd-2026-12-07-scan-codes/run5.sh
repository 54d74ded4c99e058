B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^mog  ' | sed "s/^/$tag /"; }
export FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1
for ref in 16 32; do
  FLOE_SCRATCH_BITS=1 FLOE_SCRATCH_SCORR=0.3634 run "s1 corr ref$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
  FLOE_SCRATCH_BITS=2 FLOE_SCRATCH_SCORR=0.1175 run "s2 corr ref$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
  FLOE_SCRATCH_BITS=2 FLOE_SCRATCH_SCORR=-0.1175 run "s2 negcorr ref$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
done
