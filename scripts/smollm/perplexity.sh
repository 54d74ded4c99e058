#!/usr/bin/env bash
# Perplexity of teacher-forced decoding after a long prefill, dense next to each method.
#   perplexity.sh [BOOK=prideprejudice] [CTX=2048] [EVAL=256] [METHODS=all registered] [BUDGETS=0.02,0.05,0.1]
# (positional or as environment variables). About 1 min per method and budget at 2K.
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
book=${1:-${BOOK:-prideprejudice}}
ctx=${2:-${CTX:-2048}}
eval_tokens=${3:-${EVAL:-256}}
methods=${4:-${METHODS:-}}
budget=${5:-${BUDGETS:-0.02,0.05,0.1}}
"$here/fetch_model.sh" >/dev/null
"$here/fetch_texts.sh" >/dev/null
smollm_build
if [[ -z $methods ]]; then methods=$("$SMOLLM_BIN" --list-methods | cut -f1 | paste -sd, -); fi
"$SMOLLM_BIN" --model "$SMOLLM_GGUF" --perplexity "$SMOLLM_TEXTS/$book.txt" --ctx "$ctx" --eval "$eval_tokens" \
  --attn "$methods" --budget "$budget" ${THREADS:+--threads "$THREADS"}
