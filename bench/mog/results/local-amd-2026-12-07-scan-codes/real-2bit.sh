# The 2-bit codes as built (7ece1ec): 32K seeds 1-3, refine sweep, 128K, SmolLM2 dumps. From the repository root.
B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; "$@" 2>&1 | grep -E '^(mog|oracle_topk@bytes|mog_clusters\+none) |^index of' | sed "s/^/$tag | /"; }
for seed in 1 2 3; do
  run "32K s$seed 4bit" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --token-scan --budgets 0.025
  run "32K s$seed 2bit" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --scan-code 2bit --budgets 0.02,0.025,0.026,0.03
  run "32K s$seed 2bit pt os65" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --scan-code 2bit --per-token --outlier-share 0.65 --budgets 0.028,0.03
  for ref in 8 12 20 24; do run "32K s$seed 2bit ref$ref" $B --threads 2 --synthetic 32768 --seed $seed --query-sample --scan-code 2bit --refine $ref --budgets 0.025; done
done
run "32K s1 2bit nosample" $B --threads 2 --synthetic 32768 --scan-code 2bit --budgets 0.025,0.03
run "32K s1 4bit nosample" $B --threads 2 --synthetic 32768 --token-scan --budgets 0.025,0.03
run "128K s1 4bit" $B --threads 2 --synthetic 131072 --query-sample --token-scan --budgets 0.025,0.03
run "128K s1 2bit" $B --threads 2 --synthetic 131072 --query-sample --scan-code 2bit --budgets 0.02,0.025,0.03
for L in 02 08 15 22 29; do
  run "dump L$L 4bit" $B --data .cache/smollm/dumps/emma-8160/layer_$L --query-sample --token-scan --budgets 0.02,0.05,0.1
  run "dump L$L 2bit" $B --data .cache/smollm/dumps/emma-8160/layer_$L --query-sample --scan-code 2bit --budgets 0.02,0.05,0.1
done
