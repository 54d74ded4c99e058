#!/usr/bin/env bash
# Real KV dumps for floe-eval --data: layers 2, 8, 15, 22, 29 of SmolLM2-135M, at 2K and
# 8K context (8160 cached tokens + 32 decode queries = the model's 8192), for each book.
# Writes $SMOLLM_CACHE/dumps/<book>-<ctx>/layer_XX/{keys,values,queries}.npy + meta.json
# and skips dumps already complete. Then prints their attention entropy / sink mass.
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
books=${BOOKS:-prideprejudice emma}
contexts=${CONTEXTS:-2048 8160}
layers=${LAYERS:-2,8,15,22,29}
queries=${QUERIES:-32}
"$here/fetch_model.sh" >/dev/null
"$here/fetch_texts.sh" >/dev/null
smollm_build

dumps=()
for book in $books; do
  for ctx in $contexts; do
    dir=$SMOLLM_CACHE/dumps/$book-$ctx
    last=$(printf 'layer_%02d' "${layers##*,}")
    if [[ ! -s $dir/$last/meta.json ]]; then
      "$SMOLLM_BIN" --model "$SMOLLM_GGUF" --dump-kv "$dir" --text "$SMOLLM_TEXTS/$book.txt" --ctx "$ctx" \
        --layers "$layers" --queries "$queries" ${THREADS:+--threads "$THREADS"}
    fi
    dumps+=("$dir")
  done
done
smollm_pip numpy
"$SMOLLM_PYTHON" "$here/attention_stats.py" "${dumps[@]}"
