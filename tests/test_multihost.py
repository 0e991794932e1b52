"""Two processes x 2 CPU devices joined by jax.distributed over localhost (gloo collectives),
one tensor-parallel engine across both: the same tokens as one process on one device."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_tokens_of_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE,
                                           os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"),
                               str(i), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
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
    result = json.loads(next(line[len("RESULT "):] for line in outputs[0].splitlines()
                             if line.startswith("RESULT ")))
    assert result["tp"] == 4
    assert result["aborted"] == {"x": "abort", "y": "length"}
    assert "followed" in outputs[1]

    # The reference: this process, one device, no tensor parallelism.
    from jaxbatch.engine import LLMEngine
    from multihost_worker import workload
    from tp_checks import SETTINGS, model
    prompts, params = workload()
    engine = LLMEngine(loaded=model(2), **SETTINGS)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert result["tokens"] == [done[str(i)] for i in range(len(prompts))]
