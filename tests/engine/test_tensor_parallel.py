"""Tensor parallelism on 8 virtual CPU devices (tests/helpers/tp_checks.py, in one subprocess so the
rest of the suite keeps one device and the checks share their compiled engines)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HELPERS = os.path.join(ROOT, "tests", "helpers")
# Compiling the tiny models' steps is most of what these tests cost; LLVM's expensive passes
# buy nothing at this size (2.4x less wall time here). Every comparison's two sides run
# under the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def tp_run():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}",
               PYTHONPATH=os.pathsep.join([ROOT, HELPERS,
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "tp_checks.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    results = dict(re.findall(r"^CHECK (\w+) (PASS|FAIL)", output, re.M))
    return results, output


@pytest.mark.parametrize("check", ["check_bad_settings", "check_logits", "check_greedy_64",
                                   "check_engine_mixed_with_preemption",
                                   "check_hlo_collectives_and_donation",
                                   "check_pallas_kernels_per_shard",
                                   "check_data_parallel_replicas_on_their_own_devices"])
def test_tensor_parallel(tp_run, check):
    results, output = tp_run
    assert results.get(check) == "PASS", output[-6000:]
