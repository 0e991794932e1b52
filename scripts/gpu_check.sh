#!/usr/bin/env bash
# GPU check of the Pallas kernels (+ the optional end-to-end decode run), in one call, < 6 min.
#
#   scripts/gpu_check.sh [--dry-run]        OUT=dir (default ./gpu_out)   PYTHON=interpreter
#
# For a GPU machine with no network: uses the repo from PYTHONPATH, installs nothing.
# 1. scripts/gpu_check.py kernels: correctness, copy bandwidth, decode/ragged/kv-write timings,
#    JAX's shipped paged_attention on the same inputs          -> $OUT/kernels.json
# 2. python -m jaxbatch.gpu_e2e --out $OUT, only if jaxbatch/gpu_e2e.py exists; run in its own
#    process after step 1 has exited, so the GPU memory step 1 held is free again
#                                                               -> $OUT/e2e.log, $OUT/e2e.rc
# 3. scripts/gpu_check.py report: merges both                   -> $OUT/results.json, and prints
#    the markdown summary table LAST.
# --dry-run (or DRY_RUN=1): the CPU-side parts with tiny shapes and interpret mode; no e2e.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"

DRY="${DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
  esac
done
[ "$DRY" = "0" ] || export DRY_RUN=1

# The system python on the GPU machine; this repo's CPU venv only when nothing else has jax.
if [ -z "${PYTHON:-}" ]; then
  if python3 -c "import jax" 2>/dev/null; then PYTHON=python3; else PYTHON=.venv/bin/python; fi
fi

TOTAL_S=345                                   # stay under 6 minutes including the report
start=$(date +%s)
rm -f "$OUT/kernels.json" "$OUT/e2e.rc" "$OUT/e2e.log" "$OUT/e2e.skipped" "$OUT/results.json"

timeout 280 "$PYTHON" scripts/gpu_check.py kernels --out "$OUT" \
  || echo "[gpu_check] kernel checks exited with rc=$?"

if [ "$DRY" != "0" ]; then
  echo "skipped: dry run" > "$OUT/e2e.skipped"
elif [ -f jaxbatch/gpu_e2e.py ]; then
  left=$(( TOTAL_S - ($(date +%s) - start) ))
  if [ "$left" -gt 20 ]; then
    echo "[gpu_check] end-to-end: python -m jaxbatch.gpu_e2e (limit ${left}s)"
    timeout "$left" "$PYTHON" -m jaxbatch.gpu_e2e --out "$OUT" > "$OUT/e2e.log" 2>&1
    echo $? > "$OUT/e2e.rc"
  else
    echo "skipped: no time left (${left}s)" > "$OUT/e2e.skipped"
  fi
fi

"$PYTHON" scripts/gpu_check.py report --out "$OUT"
