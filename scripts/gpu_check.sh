#!/usr/bin/env bash
# GPU check of the attention kernels and of the engine end to end, in one call: at most
# 150 + 260 + 60 s with the default limits (these limits have not yet been tried on the H200).
#
#   scripts/gpu_check.sh [--dry-run]        OUT=dir (default ./gpu_out)   PYTHON=interpreter
#
# For a GPU machine with no network: uses the repo from PYTHONPATH, installs nothing.
# Sections, each under its own hard time limit, so a slow section cannot starve the next one:
# 1. kernels (GPU_CHECK_KERNELS_S, default 150 s): scripts/gpu_check.py kernels -> $OUT/kernels.json
#    availability (Pallas Triton or the xla fallback), correctness of every attention path
#    against the reference, copy bandwidth, kernel timings (these stop early at a soft budget
#    40 s under the limit), JAX's shipped paged_attention on the same inputs.
# 2. end-to-end (GPU_CHECK_E2E_S, default 260 s): python -m benchmarks.gpu_e2e, in its own process
#    after step 1 has exited (the GPU memory step 1 held is free again): random-weight small,
#    1B and 8B models in bf16, decode speed (8B also with an int8 KV cache + int8 weights),
#    greedy tokens against the reference path with the near-tie rule
#                                                            -> $OUT/gpu_e2e.json, e2e.log, e2e.rc
# 3. report: merges both -> $OUT/results.json, prints the markdown table LAST; its last row is
#    the verdict, and it decides the exit status.
# Exit status: 0 only if every correctness check passed and every section finished in time;
# 1 on any correctness failure, timeout or crash; 3 nothing failed but an end-to-end model was
# skipped for time; 2 bad usage.
# --dry-run (or DRY_RUN=1): everything on CPU with tiny shapes and the Pallas interpreter
# (limits 120 s each unless set), to check this script (tests/benchmarks/test_gpu_check.py runs it in CI).
# GPU_CHECK_SIMULATE_FAILURE=kernels|timeout|e2e (comma list) fakes a failure of that kind; the
# exit status must then be non-zero (see scripts/gpu_check.py).
#
# Not covered here (the machine has one GPU): tensor and data parallelism. A multi-GPU run
# would add (docs/PARALLELISM.md): tests/helpers/tp_checks.py on real devices (NCCL all-reduces, the
# Pallas kernels under shard_map lowered for cuda; XLA_FLAGS unset, jax.device_count() >= 8),
# decode step time at tensor_parallel_size 1/2/4/8 against the weight-bandwidth floor / T plus
# the all-reduce time, and `python -m benchmarks scaleout --device gpu --data-parallel-size N` for
# the replica speed-up.
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

if [ "$DRY" = "0" ]; then
  KERNELS_S="${GPU_CHECK_KERNELS_S:-150}"
  E2E_S="${GPU_CHECK_E2E_S:-260}"
  E2E_ARGS=()
else
  KERNELS_S="${GPU_CHECK_KERNELS_S:-120}"
  E2E_S="${GPU_CHECK_E2E_S:-120}"
  E2E_ARGS=(--dry-run --slots 2 --prompt-len 12 --new-tokens 4 --check-requests 2)
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
# Soft budgets inside each section: stop starting new work well before the hard limit.
KERNELS_BUDGET=$(( KERNELS_S > 60 ? KERNELS_S - 40 : KERNELS_S / 2 ))
E2E_BUDGET=$(( E2E_S > 100 ? E2E_S - 80 : E2E_S / 3 ))

rm -f "$OUT"/kernels.json "$OUT"/kernels.rc "$OUT"/e2e.rc "$OUT"/e2e.log "$OUT"/e2e.skipped \
      "$OUT"/gpu_e2e.json "$OUT"/results.json

echo "[gpu_check] kernels (limit ${KERNELS_S}s, soft budget ${KERNELS_BUDGET}s)"
timeout -k 10 "$KERNELS_S" "$PYTHON" scripts/gpu_check.py kernels --out "$OUT" \
  --budget-s "$KERNELS_BUDGET"
rc=$?
echo "$rc" > "$OUT/kernels.rc"
[ "$rc" = 0 ] || echo "[gpu_check] kernels section exited with rc=$rc"

if [ -f benchmarks/gpu_e2e.py ]; then
  echo "[gpu_check] end-to-end: python -m benchmarks.gpu_e2e (limit ${E2E_S}s, soft budget ${E2E_BUDGET}s)"
  timeout -k 10 "$E2E_S" "$PYTHON" -m benchmarks.gpu_e2e --out "$OUT" --budget-s "$E2E_BUDGET" \
    ${E2E_ARGS[@]+"${E2E_ARGS[@]}"} 2>&1 | tee "$OUT/e2e.log"
  echo "${PIPESTATUS[0]}" > "$OUT/e2e.rc"
else
  echo "missing: benchmarks/gpu_e2e.py" > "$OUT/e2e.skipped"
fi

# The report prints the table last and sets the exit status; if it cannot run, that is a failure.
timeout -k 5 60 "$PYTHON" scripts/gpu_check.py report --out "$OUT"
status=$?
exit "$status"
