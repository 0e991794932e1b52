"""A multi-host engine started through Ray (issue 58, part 2): two `jax.distributed` processes
placed by a placement group on the two nodes of a local Ray cluster (two raylets on this
machine), 2 CPU devices each, one tensor-parallel engine across both: the same tokens as one
process on one device."""
from __future__ import annotations

import functools
import os

import pytest

ray = pytest.importorskip("ray")

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(os.path.dirname(HERE), "helpers")
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# One CPU per node; no dashboard; a small object store (nothing big travels through it).
NODE = dict(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20)


def test_two_ray_placed_processes_give_the_tokens_of_one():
    from ray.cluster_utils import Cluster
    from jaxbatch.entrypoints.ray_cluster.multihost import launch
    from multihost_worker import workload
    from tp_checks import SETTINGS, model, run_all
    from jaxbatch.engine.llm_engine import LLMEngine

    prompts, params = workload()
    reference = run_all(LLMEngine(loaded=model(2), **SETTINGS), prompts, params)

    with pytest.MonkeyPatch.context() as mp:      # the raylets' workers find the helpers
        mp.setenv("RAY_memory_monitor_refresh_ms", "0")    # see test_ray_serve.py
        mp.setenv("PYTHONPATH", os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")]))
        cluster = Cluster(initialize_head=True, head_node_args=NODE)
        cluster.add_node(**NODE)
        ray.init(address=cluster.address)
    try:
        engine = launch(functools.partial(model, 2), num_hosts=2,
                        engine_kwargs=dict(tensor_parallel_size=4, **SETTINGS),
                        env_vars={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                               + FAST_COMPILE}, timeout=300)
        assert len({p["node"] for p in engine.placed}) == 2          # one process per node
        assert [(p["local_devices"], p["devices"]) for p in engine.placed] == [(2, 4)] * 2
        # Two batches: the follower returns from one and follows the next.
        outs = (engine.generate(prompts[:4], params[:4], timeout=300)
                + engine.generate(prompts[4:], params[4:], timeout=300))
        stats = engine.stats()
        assert stats["tensor_parallel_size"] == 4
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        followed = engine.shutdown()
        assert followed == [stats["num_steps"]]            # the follower took every step
        assert [o.outputs[0].token_ids for o in outs] == reference
    finally:
        ray.shutdown()
        cluster.shutdown()
