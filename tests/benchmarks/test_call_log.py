"""The kernels' call log (the lab's `benchmarks/call_log.h` and `call_log.py`) is
compiled in only for an instrumented build: `call_log.instrument()`, called before any kernel
registers, asks `cpu_kernels.availability.instrument` for libraries built with
-DJAXBATCH_CALL_LOG (a library of their own in the cache). Production libraries carry no log
(no setter to hand one to), `start()` says so, and `instrument()` refuses once a production
library is loaded. The log's own behaviour is tested in a fresh, instrumented process
(instrumented_call_log.py beside this file)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import call_log
from cpu_kernels import add_rms_norm, availability, build, first_argmax, packed_gemm

REASON = (packed_gemm.unavailable_reason() or add_rms_norm.unavailable_reason()
          or first_argmax.unavailable_reason())
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_production_libraries_carry_no_call_log():
    assert not call_log.instrumented()
    _, lib = build.load_library(packed_gemm.SOURCE, availability.build_flags())
    assert not hasattr(lib, "JaxbatchSetCallLog")
    assert not hasattr(lib, "JaxbatchCallLogCapacity")
    _, instrumented = build.load_library(packed_gemm.SOURCE, availability.FLAGS + call_log.FLAGS)
    assert hasattr(instrumented, "JaxbatchSetCallLog")        # the same source, built apart
    # the log itself is the lab's: nothing in the kernels' folder exists only for it
    assert not any("call_log" in name for name in os.listdir(os.path.dirname(packed_gemm.__file__)))


def test_start_without_instrument_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"call_log.instrument\(\)"):
        call_log.start()


def test_instrument_after_a_kernel_registered_is_refused():
    with pytest.raises(RuntimeError, match="registered"):
        call_log.instrument()
    assert not call_log.instrumented()


def test_the_call_log_in_an_instrumented_process():
    import cpu_kernels
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(cpu_kernels.__file__)), *[p for p in sys.path if p]]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT,
         os.path.join(ROOT, "tests", "benchmarks", "instrumented_call_log.py")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
