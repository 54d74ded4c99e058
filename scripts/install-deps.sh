#!/usr/bin/env bash
# Installs the Debian packages floe's build, tests and tools need, only those missing.
set -euo pipefail
packages=(cmake g++ make libeigen3-dev libxsimd-dev xtl-dev catch2 libbenchmark-dev python3-matplotlib python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "floe: installing missing Debian packages: ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
