"""Two processes x 2 CPU devices joined by jax.distributed over localhost (gloo collectives),
one tensor-parallel engine across both: the same tokens as one process on one device."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HELPERS = os.path.join(ROOT, "tests", "helpers")
# Compiling the tiny models' steps is most of what these tests cost; LLVM's expensive passes
# buy nothing at this size (2.4x less wall time here). Every comparison's two sides run
# under the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _result(output: str) -> dict:
    return json.loads(next(line[len("RESULT "):] for line in output.splitlines()
                           if line.startswith("RESULT ")))


def test_two_processes_give_the_tokens_of_one():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}",
               PYTHONPATH=os.pathsep.join([ROOT, HELPERS,
                                           os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    worker = os.path.join(HELPERS, "multihost_worker.py")
    # Processes 0 and 1 of the joined engine, and the single-process reference beside them.
    commands = [[worker, "0", str(port)], [worker, "1", str(port)], [worker, "single"]]
    procs = [subprocess.Popen([sys.executable] + c, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    joined, reference = _result(outputs[0]), _result(outputs[2])
    assert joined["tp"] == 4
    assert joined["aborted"] == {"x": "abort", "y": "length"}
    assert "followed" in outputs[1]
    assert joined["tokens"] == reference["tokens"]
