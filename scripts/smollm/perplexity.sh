#!/usr/bin/env bash
# Perplexity of teacher-forced decoding after a long prefill, dense next to each method.
#   perplexity.sh [BOOK=prideprejudice] [CTX=2048] [EVAL=256] [METHODS=dense,streaming] [BUDGET=0.1]
# (positional or as environment variables). Takes about 1 min at 2K on one core.
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
book=${1:-${BOOK:-prideprejudice}}
ctx=${2:-${CTX:-2048}}
eval_tokens=${3:-${EVAL:-256}}
methods=${4:-${METHODS:-dense,streaming}}
budget=${5:-${BUDGET:-0.1}}
"$here/fetch_model.sh" >/dev/null
"$here/fetch_texts.sh" >/dev/null
smollm_build
"$SMOLLM_BIN" --model "$SMOLLM_GGUF" --perplexity "$SMOLLM_TEXTS/$book.txt" --ctx "$ctx" --eval "$eval_tokens" \
  --attn "$methods" --budget "$budget" ${THREADS:+--threads "$THREADS"}
