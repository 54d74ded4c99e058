B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^mog  ' | sed "s/^/$tag /"; }
export FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_BITS=2
for ref in 12 16 20; do
  run "b2 ref$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.02,0.0225,0.025
  run "b2 ref$ref pt os65" $B --threads 2 --synthetic 32768 --query-sample --token-scan --per-token --outlier-share 0.65 --refine $ref --budgets 0.022,0.025,0.029
done
