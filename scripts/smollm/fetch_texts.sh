#!/usr/bin/env bash
# Extracts Pride and Prejudice and Emma as plain text from Debian's r-cran-janeaustenr
# (apt-get download + dpkg-deb -x, no R needed) into the cache; skips what is there.
set -euo pipefail
source "$(dirname "$0")/common.sh"

mkdir -p "$SMOLLM_TEXTS"
if [[ ! -s $SMOLLM_TEXTS/prideprejudice.txt || ! -s $SMOLLM_TEXTS/emma.txt ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && { apt-get download r-cran-janeaustenr >/dev/null 2>&1 ||
                   { apt-get update -qq >/dev/null && apt-get download r-cran-janeaustenr >/dev/null; }; })
  dpkg-deb -x "$work"/r-cran-janeaustenr_*.deb "$work/root"
  data=$work/root/usr/lib/R/site-library/janeaustenr/data
  SMOLLM_SCRIPTS=$(dirname "$0") "$SMOLLM_PYTHON" - "$data" "$SMOLLM_TEXTS" <<'PY'
import sys, os
sys.path.insert(0, os.path.join(os.path.abspath(os.environ["SMOLLM_SCRIPTS"])))
import rdata
data, out = sys.argv[1], sys.argv[2]
books = rdata.load(os.path.join(data, "Rdata.rdx"), os.path.join(data, "Rdata.rdb"))
for name in ("prideprejudice", "emma"):
    with open(os.path.join(out, name + ".txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(line or "" for line in books[name]) + "\n")
PY
fi
ls "$SMOLLM_TEXTS"/prideprejudice.txt "$SMOLLM_TEXTS"/emma.txt
