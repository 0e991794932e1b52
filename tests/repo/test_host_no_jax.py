"""The host side (scheduler, block manager, plan records, params) must not import JAX: the
scheduler plans step n+1 on the host while step n runs, and its tests run without a device."""
from __future__ import annotations

import subprocess
import sys

HOST_MODULES = ["jaxbatch", "jaxbatch.core.block_manager", "jaxbatch.core.prefix_cache", "jaxbatch.core.scheduler",
                "jaxbatch.engine.output_processor",
                "jaxbatch.spec_decode.speculative",
                "jaxbatch.core.policies",
                "jaxbatch.core.request", "jaxbatch.core.plan", "jaxbatch.core.config", "jaxbatch.sampling_params",
                "jaxbatch.outputs", "jaxbatch.engine.detokenizer",
                "jaxbatch.kv_events.config", "jaxbatch.kv_events.recorder",
                "jaxbatch.kv_events.publisher",
                # The server binds its port before the engine thread imports JAX.
                "jaxbatch.entrypoints.cli", "jaxbatch.entrypoints.openai.app"]

PROBE = f"""
import importlib, sys
for name in {HOST_MODULES!r}:
    importlib.import_module(name)
from jaxbatch import SamplingParams, RequestOutput
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.core.config import SchedulerConfig
Scheduler(SchedulerConfig(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                          prefill_chunk_size=4)).schedule()
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "torch",
                                      "transformers"))
print("HEAVY=" + ",".join(heavy))
"""


def test_host_modules_import_no_jax():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    heavy = out.stdout.strip().split("HEAVY=")[-1]
    assert heavy == "", f"host modules pulled in: {heavy}"


def test_probe_detects_jax():
    """The probe itself works: importing the device side does show up."""
    code = "import sys, jaxbatch.worker.runner; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("True")
