# Shared settings for the SmolLM2 scripts: where the model, texts and dumps live.
# Sourced, not run. Everything goes under a git-ignored cache folder.
SMOLLM_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SMOLLM_CACHE=${FLOE_CACHE:-$SMOLLM_REPO/.cache/smollm}
SMOLLM_GGUF=$SMOLLM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM_TEXTS=$SMOLLM_CACHE/texts
SMOLLM_BUILD=${FLOE_BUILD:-$SMOLLM_REPO/build/smollm}
SMOLLM_BIN=$SMOLLM_BUILD/examples/smollm/floe-smollm
# The pyenv python3 if there is one (pip installs land there), else Debian's.
SMOLLM_PYTHON=${PYTHON:-$(command -v python3 || echo /usr/bin/python3)}
mkdir -p "$SMOLLM_CACHE"

# Builds floe-smollm (Release) in its own build folder when it is missing or stale.
smollm_build() {
  if [[ ! -d $SMOLLM_BUILD ]]; then
    cmake -S "$SMOLLM_REPO" -B "$SMOLLM_BUILD" -DCMAKE_BUILD_TYPE=Release >&2
  fi
  cmake --build "$SMOLLM_BUILD" --target floe-smollm -j"${JOBS:-2}" >&2
}

# pip-installs the given modules for $SMOLLM_PYTHON unless they import already.
smollm_pip() {
  local missing=()
  for m in "$@"; do "$SMOLLM_PYTHON" -c "import ${m%%=*}" 2>/dev/null || missing+=("$m"); done
  if ((${#missing[@]})); then "$SMOLLM_PYTHON" -m pip install --quiet "${missing[@]}" >&2; fi
}
