"""`bench calls`: decode steps cut at each sampling's argmax, prefill and mixed steps left out,
each kernel's calls per step, median, mean and share, on synthetic records; then the whole
bench on the tiny random model (whose decode attention and argmax run on our kernels)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cpu_kernels import call_log, paged_decode
from jaxbatch.benchmarks import calls

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
    """In a process of its own: the call log is compiled only into an instrumented build,
    which call_log.instrument() asks for before any kernel registers (this process has
    registered them already)."""
    import os
    import subprocess
    import sys
    import cpu_kernels
    code = ("import sys; from cpu_kernels import call_log; call_log.instrument(); "
            "from jaxbatch.benchmarks import calls; sys.exit(calls.main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(cpu_kernels.__file__)), *[p for p in sys.path if p]]))
    done = subprocess.run([sys.executable, "-c", code, "--random-model", "tiny", "--rows", "2",
                           "--tokens", "8", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "calls.json").read_text())["results"]
    assert result["rows"] == 2 and result["steps"] >= 5
    kernels = {c["kernel"] for c in result["calls"]}
    assert "decode attention" in kernels and "prefill attention" not in kernels
    (attention,) = [c for c in result["calls"] if c["kernel"] == "decode attention"]
    assert attention["calls_per_step"] == 2                  # the tiny model's two layers
    assert 0 < result["in_kernels_ms"] < result["step_mean_ms"]
    assert "decode attention" in (tmp_path / "calls.md").read_text()
