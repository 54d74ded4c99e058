#!/usr/bin/env bash
# Kascade's cross-layer reuse end to end: calibrate anchor plans on one book (dense decode
# steps), then measure perplexity on the other with each plan, next to dense, oracle_topk
# and streaming, and the head-map ablation.
#   anchor_reuse.sh [DEV=emma] [TEST=prideprejudice] [CTX=2048] [EVAL=256] [COUNTS=3,5,8] [BUDGETS=0.05,0.1]
# Also DENSE_LAYERS (default 0, as Kascade; 'none'), CAL_STEPS (64), CAL_BUDGET (0.05).
# Plans go to $SMOLLM_CACHE/anchor-plans/. About 10 s per method and budget at 2K.
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
dev=${1:-${DEV:-emma}}
test_book=${2:-${TEST:-prideprejudice}}
ctx=${3:-${CTX:-2048}}
eval_tokens=${4:-${EVAL:-256}}
counts=${5:-${COUNTS:-3,5,8}}
budgets=${6:-${BUDGETS:-0.05,0.1}}
dense_layers=${DENSE_LAYERS:-0}
"$here/fetch_model.sh" >/dev/null
"$here/fetch_texts.sh" >/dev/null
smollm_build
plans=$SMOLLM_CACHE/anchor-plans
mkdir -p "$plans"
prefix=$plans/$dev-$ctx-dense${dense_layers//,/_}
"$SMOLLM_BIN" --model "$SMOLLM_GGUF" --calibrate-anchors "$SMOLLM_TEXTS/$dev.txt" --ctx "$ctx" \
  --eval "${CAL_STEPS:-64}" --budget "${CAL_BUDGET:-0.05}" --anchors "$counts" --dense-layers "$dense_layers" \
  --out "$prefix"
first=1
for m in ${counts//,/ }; do
  echo "== plan: $m anchors ($prefix-$m.json)"
  baselines=""
  if ((first)); then baselines="oracle_topk,streaming,"; fi
  first=0
  "$SMOLLM_BIN" --model "$SMOLLM_GGUF" --perplexity "$SMOLLM_TEXTS/$test_book.txt" --ctx "$ctx" --eval "$eval_tokens" \
    --attn "${baselines}anchor_reuse+none,anchor_reuse:same_heads+none" --budget "$budgets" \
    --anchor-plan "$prefix-$m.json" ${THREADS:+--threads "$THREADS"}
done
