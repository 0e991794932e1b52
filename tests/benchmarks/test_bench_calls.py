"""`python -m benchmarks calls`: decode steps cut at each sampling's argmax, prefill and mixed steps left out,
each kernel's calls per step, median, mean and share, on synthetic records; then the whole
bench on the tiny random model (whose decode attention and argmax run on our kernels)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import call_log
from cpu_kernels import paged_decode
from benchmarks import calls

ROOT = Path(__file__).resolve().parents[2]
GEMM, DECODE, PREFILL, NORM, ARGMAX = 1, 2, 3, 4, 5


def _records(spec):
    """[(kind, a, b, c, entry µs, end µs)] -> call_log.records()' array (ns)."""
    return np.array([(k, a, b, c, e * 1000, x * 1000) for k, a, b, c, e, x in spec], np.int64)


def test_kernel_ids_are_the_headers():
    assert {GEMM: "gemm", DECODE: "decode attention", PREFILL: "prefill attention",
            NORM: "add + norm", ARGMAX: "argmax"} == call_log.KERNELS


def test_decode_steps_run_argmax_to_argmax_and_skip_prefill():
    recs = _records([
        (PREFILL, 40, 9, 64, 0, 50), (ARGMAX, 8, 100, 0, 60, 61),        # a prefill step
        (GEMM, 4, 8, 16, 100, 110), (DECODE, 4, 9, 64, 120, 130),         # decode step 1
        (GEMM, 4, 8, 100, 140, 160), (ARGMAX, 4, 100, 0, 170, 172),
        (GEMM, 4, 8, 16, 200, 220), (DECODE, 4, 9, 64, 230, 236),         # decode step 2
        (GEMM, 4, 8, 100, 240, 250), (ARGMAX, 4, 100, 0, 260, 261),
        (GEMM, 4, 8, 16, 270, 280), (DECODE, 4, 9, 64, 281, 285),         # mixed: out
        (PREFILL, 40, 9, 64, 286, 290), (ARGMAX, 4, 100, 0, 295, 296),
        (GEMM, 6, 8, 16, 300, 310), (DECODE, 6, 9, 64, 320, 330),         # other rows: out
        (ARGMAX, 8, 100, 0, 340, 341),
        (GEMM, 4, 8, 16, 400, 0), (ARGMAX, 4, 100, 0, 420, 421)])         # unfinished: out
    steps = calls.decode_steps(recs, rows=4)
    assert [(len(s), end) for s, end in steps] == [(4, 170_000), (4, 260_000)]
    assert steps[0][0][0, 0] == ARGMAX and steps[0][0][0, 4] == 60_000
    summary = calls.summarize(steps)
    assert summary["steps"] == 2
    assert summary["step_median_ms"] == pytest.approx((110 + 90) / 2 / 1000)
    by = {(c["kernel"], tuple(c["sizes"].values())): c for c in summary["calls"]}
    up = by[("gemm", (4, 8, 16))]
    assert up["calls_per_step"] == 1 and up["median_us"] == pytest.approx(15)
    assert up["mean_us"] == pytest.approx(15) and up["ms_per_step"] == pytest.approx(0.015)
    assert by[("argmax", (4, 100, 0))]["calls_per_step"] == 0.5      # one of two steps
    # inside the kernels: step 1 1 + 10 + 10 + 20, step 2 2 + 20 + 6 + 10 µs
    assert summary["in_kernels_ms"] == pytest.approx((41 + 38) / 2 / 1000)


@pytest.mark.skipif(paged_decode.unavailable_reason() is not None,
                    reason=f"CPU kernel unavailable: {paged_decode.unavailable_reason()}")
def test_bench_on_the_tiny_model(tmp_path):
    # Its own process, as it is run: the instrumented kernel build must be chosen before any
    # kernel is registered, and this test process has registered them already.
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "calls", "--random-model", "tiny",
                           "--rows", "2", "--tokens", "8", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "calls.json").read_text())["results"]
    assert result["rows"] == 2 and result["steps"] >= 5
    kernels = {c["kernel"] for c in result["calls"]}
    assert "decode attention" in kernels and "prefill attention" not in kernels
    (attention,) = [c for c in result["calls"] if c["kernel"] == "decode attention"]
    assert attention["calls_per_step"] == 2                  # the tiny model's two layers
    assert 0 < result["in_kernels_ms"] < result["step_mean_ms"]
    assert "decode attention" in (tmp_path / "calls.md").read_text()


def test_calls_switches_to_the_instrumented_build_when_there_is_one(monkeypatch):
    switched = []
    monkeypatch.setattr(call_log, "instrument", lambda: switched.append(True), raising=False)
    calls.instrument()
    assert switched == [True]
    monkeypatch.delattr(call_log, "instrument")
    calls.instrument()                  # a build that logs every call: nothing to switch
    assert switched == [True]
