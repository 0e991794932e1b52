"""scripts/gpu_check.sh cannot lie: its dry run (CPU, tiny shapes, Pallas interpreter) passes
every section and prints the table last; simulated failures of each kind make it exit non-zero;
and the end-to-end greedy comparison follows the near-tie rule of the CPU tests.

The two dry runs take ~40 s each on two CPU cores: one passing, one with every kind of failure
simulated at once (a kernel's wrong output, a kernels section that hangs past its limit, a
corrupted end-to-end token), which also shows that a hung section does not starve the next.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"availability", "correctness", "copy_bandwidth", "decode_headline", "ragged",
            "kv_write", "int8_decode", "int8_weights"}


def dry_run(out_dir, **env):
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith("GPU_CHECK_") and k not in ("DRY_RUN", "OUT")}
    full_env.update(OUT=str(out_dir), PYTHON=sys.executable, GPU_CHECK_SEED="1234", **env)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
    results = json.loads((out_dir / "results.json").read_text())
    return proc, results


def test_dry_run_passes_every_section_and_prints_the_table_last(tmp_path):
    proc, results = dry_run(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("| VERDICT | PASS"), last
    kernels = results["kernels"]
    assert set(kernels["sections"]) == SECTIONS and not kernels["errors"], kernels["errors"]
    assert kernels["finished"] and results["kernels_rc"] == "0"
    corr = kernels["sections"]["correctness"]
    kinds = {case["kernel"] for case in corr["cases"]}
    assert kinds == {"paged_decode", "ragged", "xla_decode", "xla_prefill", "write_kv",
                     "paged_decode_int8", "ragged_int8", "xla_decode_int8"}, kinds
    assert corr["all_ok"] and corr["pallas_checked"]
    e2e = results["e2e"]
    assert e2e["rc"] == "0"
    model = e2e["report"]["models"][0]
    assert model["speed"]["backend"] == "pallas_interpret" and model["check"]["equal"]
    assert model["speed"]["compilations_timed"] == 0


def test_simulated_failures_make_it_exit_non_zero(tmp_path):
    proc, results = dry_run(tmp_path, GPU_CHECK_SIMULATE_FAILURE="kernels,timeout,e2e",
                            GPU_CHECK_KERNELS_S="45")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    reasons = " / ".join(results["reasons"])
    assert proc.stdout.strip().splitlines()[-1].startswith("| VERDICT | FAIL"), out[-2000:]
    # The kernels section hung after its correctness section and was killed at its limit ...
    assert results["kernels_rc"] in ("124", "137") and "kernels section TIMED OUT" in reasons
    assert "correctness" in results["kernels"]["sections"], (
        "the correctness section did not finish within 45 s: " + out[-2000:])
    assert "kernel correctness FAILED" in reasons
    # ... and the end-to-end section still ran, and failed on the corrupted token.
    assert results["e2e"]["rc"] == "1" and "end-to-end section FAILED" in reasons
    check = results["e2e"]["report"]["models"][0]["check"]
    assert check["simulated_failure"] and not check["equal"]


# --- the near-tie rule (no subprocess) ---------------------------------------------------------

def test_compare_greedy_accepts_only_near_ties():
    from benchmarks.gpu_e2e import compare_greedy
    lps = [{5: -0.1, 6: -3.0}, {7: -0.70, 8: -0.71}, {9: -0.2, 4: -2.0}]
    assert compare_greedy([5, 7, 9], lps, [5, 7, 9], 0.05)["ok"]
    near = compare_greedy([5, 7, 9], lps, [5, 8, 1], 0.05)     # parts at a 0.01 gap, then free
    assert near["ok"] and near["near_tie"] and near["first_divergence"] == 1
    far = compare_greedy([5, 7, 9], lps, [6, 7, 9], 0.05)      # parts at a 2.9 gap
    assert not far["ok"] and far["gap"] == pytest.approx(2.9)
    unranked = compare_greedy([5, 7, 9], lps, [5, 3, 9], 10.0)  # not in the reference's top-k
    assert not unranked["ok"] and unranked["gap"] is None
    assert not compare_greedy([5, 7, 9], lps, [5, 7], 0.05)["ok"]   # a token missing


def test_near_tie_tolerance_scales_with_dtype_and_width():
    from benchmarks.gpu_e2e import MODEL_SHAPES, near_tie_tolerance
    small, big = MODEL_SHAPES["small"], MODEL_SHAPES["8B"]
    assert near_tie_tolerance(small, "float32") < near_tie_tolerance(small, "bfloat16")
    assert near_tie_tolerance(small, "bfloat16") < near_tie_tolerance(big, "bfloat16") < 3.0


def test_report_fails_when_a_section_left_no_trace(tmp_path):
    """No kernels.json, no exit codes (the shell died early): the report must not pass."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "report",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("| VERDICT | FAIL")
