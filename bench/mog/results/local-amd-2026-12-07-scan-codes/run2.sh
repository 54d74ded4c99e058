B=build/release/bench/mog/floe-mog-accuracy
run(){ tag=$1; shift; echo "== $tag $(echo $("$@" 2>&1 | grep -E '^mog  ' | head -1))"; }
export FLOE_SCRATCH_RESID=1
for bits in 4 2 1; do for corr in 0 1; do for ref in 8 16 24 32; do
  FLOE_SCRATCH_CORR=$corr FLOE_SCRATCH_BITS=$bits run "bits$bits corr$corr refine$ref" $B --threads 2 --synthetic 32768 --query-sample --token-scan --refine $ref --budgets 0.025
done; done; done
