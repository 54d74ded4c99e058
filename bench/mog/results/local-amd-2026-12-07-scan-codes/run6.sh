B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^mog  ' | sed "s/^/$tag /"; }
for seed in 1 2 3; do
  run "seed$seed 4bit default" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --budgets 0.025
  run "seed$seed 4bit best" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --per-token --outlier-share 0.65 --budgets 0.029
  export FLOE_SCRATCH_RESID=1 FLOE_SCRATCH_SIGMA=1 FLOE_SCRATCH_BITS=2
  run "seed$seed s2 ref16" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --refine 16 --budgets 0.025,0.026
  run "seed$seed s2 ref16 pt os65" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --refine 16 --per-token --outlier-share 0.65 --budgets 0.029,0.031
  FLOE_SCRATCH_BITS=3 run "seed$seed s3 ref12" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --refine 12 --budgets 0.025
  unset FLOE_SCRATCH_RESID FLOE_SCRATCH_SIGMA FLOE_SCRATCH_BITS
done
