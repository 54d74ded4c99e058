#!/usr/bin/env bash
# Correctness of floe-smollm against independent implementations:
#  1. logits of the first 64 tokens of Pride and Prejudice, by prefill and by decode steps
#     through floe (SIMD and scalar executors), against the NumPy float64 forward pass
#     (reference.py), max relative difference <= 1e-3;
#  2. token ids of the first 100,000 characters of both novels against Hugging Face's
#     `tokenizers` BPE built from the same GGUF vocabulary (check_tokenizer.py);
#  3. greedy generation from "Once upon a time".
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
"$here/fetch_model.sh" >/dev/null
"$here/fetch_texts.sh" >/dev/null
smollm_build
smollm_pip numpy gguf tokenizers

out=$SMOLLM_CACHE/check
mkdir -p "$out"
text=$SMOLLM_TEXTS/prideprejudice.txt
"$SMOLLM_BIN" --model "$SMOLLM_GGUF" --logits "$out/prefill.npy" --text "$text" --tokens 64 2>/dev/null
for exec in simd scalar; do
  "$SMOLLM_BIN" --model "$SMOLLM_GGUF" --logits "$out/decode-$exec.npy" --text "$text" --tokens 64 --decode \
    --exec "$exec" 2>/dev/null
done
"$SMOLLM_PYTHON" "$here/reference.py" "$SMOLLM_GGUF" "$out/prefill.npy" "$out/decode-simd.npy" "$out/decode-scalar.npy"

for book in prideprejudice emma; do
  "$SMOLLM_BIN" --model "$SMOLLM_GGUF" --tokenize "$SMOLLM_TEXTS/$book.txt" --chars 100000 --out "$out/$book.ids.npy"
  "$SMOLLM_PYTHON" "$here/check_tokenizer.py" "$SMOLLM_GGUF" "$SMOLLM_TEXTS/$book.txt" 100000 "$out/$book.ids.npy"
done

"$SMOLLM_BIN" --model "$SMOLLM_GGUF" --generate "Once upon a time" --max-new 48
