B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^mog  ' | sed "s/^/$tag /"; }
for L in 02 08 15 22 29; do
  run "L$L 4bit" $B --data .cache/smollm/dumps/emma-8160/layer_$L --query-sample --token-scan --budgets 0.05
  FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1 FLOE_SCRATCH_BITS=2 run "L$L s2 ref8" $B --data .cache/smollm/dumps/emma-8160/layer_$L --query-sample --token-scan --budgets 0.05
  FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1 FLOE_SCRATCH_BITS=2 run "L$L s2 ref16" $B --data .cache/smollm/dumps/emma-8160/layer_$L --query-sample --token-scan --refine 16 --budgets 0.05
done
run "128K 4bit" $B --threads 2 --synthetic 131072 --query-sample --token-scan --budgets 0.025,0.03
FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1 FLOE_SCRATCH_BITS=2 run "128K s2 ref16" $B --threads 2 --synthetic 131072 --query-sample --token-scan --refine 16 --budgets 0.025,0.03
