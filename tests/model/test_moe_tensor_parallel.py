"""MoE families under tensor parallelism on virtual CPU devices (tp_moe_check.py in a
subprocess: the device count is fixed when jax starts): experts split over the mesh, the same
tokens and logprobs as one device."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


# Mixtral: windows, copied KV heads (2 for 4 shards) and one expert per shard at once.
@pytest.mark.parametrize("name,tp", [("mixtral", 4)])
def test_moe_under_tensor_parallel_equals_one_device(checkpoint, name, tp):
    folder, _ = checkpoint(name)
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "helpers", "tp_moe_check.py"), folder,
                           str(tp)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"tp={tp} max |dlogprob|" in proc.stdout
