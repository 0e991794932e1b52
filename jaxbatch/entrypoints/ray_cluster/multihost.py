"""One engine over several hosts (engine/multihost.py), its `jax.distributed` processes placed
and started by Ray instead of one hand-typed command per host.

    engine = launch(model, num_hosts=2, engine_kwargs={"tensor_parallel_size": 8, ...},
                    resources_per_host={"GPU": 4})
    outputs = engine.generate(prompts, params)      # process 0's results
    engine.shutdown()

A placement group holds one bundle per host (STRICT_SPREAD: each process on its own node, as
jax.distributed expects one process per host); one `EngineProcess` actor is started in each.
Process 0 picks the coordinator address on its node; every process then initializes
jax.distributed and builds the same engine at once (the build's collectives meet across
processes). Processes 1.. follow process 0 (MultiHostEngine.follow) in a call that returns when
process 0 shuts down; process 0 takes the requests.
"""
from __future__ import annotations

import socket
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(max_concurrency=2)     # a follower's follow() runs while shutdown can be asked
class EngineProcess:
    def __init__(self, process_id: int, num_processes: int):
        self.process_id, self.num_processes = process_id, num_processes
        self.llm = None

    def coordinator_address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, coordinator: str, model, engine_kwargs: dict) -> dict:
        from jaxbatch.engine import multihost
        multihost.initialize(coordinator, self.num_processes, self.process_id)
        from jaxbatch import LLM
        source = {"loaded": model()} if callable(model) else {"model": model}
        self.llm = LLM(**source, num_processes=self.num_processes, process_id=self.process_id,
                       coordinator_address=coordinator, **engine_kwargs)
        import jax
        return {"process": self.process_id, "node": ray.get_runtime_context().get_node_id(),
                "local_devices": jax.local_device_count(), "devices": jax.device_count()}

    def follow(self) -> int:
        """A follower: steps with process 0 until it shuts down; the steps it followed."""
        engine = self.llm.llm_engine
        while engine.follow():
            pass
        return engine.stats()["num_steps"]

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params, use_tqdm=False)

    def stats(self) -> dict:
        return self.llm.llm_engine.stats()

    def shutdown(self) -> None:
        self.llm.llm_engine.shutdown()


class RayMultiHostEngine:
    """Process 0's engine on a Ray cluster, its followers running beside it."""

    def __init__(self, processes, followers, group, placed: list[dict]):
        self.processes, self._followers, self._group = processes, followers, group
        self.placed = placed      # per process: its node and devices
        self._lock = threading.Lock()

    def generate(self, prompts, params=None, timeout: float | None = None):
        """`timeout`: seconds before ray.exceptions.GetTimeoutError (a process that stopped
        following leaves the others waiting in a collective)."""
        with self._lock:       # one batch at a time, as LLM.generate on process 0 would
            return ray.get(self.processes[0].generate.remote(prompts, params), timeout=timeout)

    def stats(self) -> dict:
        return ray.get(self.processes[0].stats.remote())

    def shutdown(self, timeout: float = 60.0) -> list[int]:
        """Stops every process; the steps each follower took."""
        ray.get(self.processes[0].shutdown.remote())
        steps = ray.get(self._followers, timeout=timeout)
        for p in self.processes:
            ray.kill(p)
        remove_placement_group(self._group)
        return steps


def launch(model, num_hosts: int, engine_kwargs: dict | None = None, *,
           resources_per_host: dict | None = None, env_vars: dict | None = None,
           strategy: str = "STRICT_SPREAD", timeout: float = 600.0) -> RayMultiHostEngine:
    """`model`: a path (as `LLM(model=...)`) or a zero-argument function returning a
    LoadedModel, called in each process after jax.distributed is up. `resources_per_host`:
    one bundle per host (default one CPU); `env_vars`: each process's environment (XLA_FLAGS,
    CUDA_VISIBLE_DEVICES, ...), set before JAX is imported there."""
    if num_hosts < 2:
        raise ValueError(f"num_hosts must be at least 2 (one host: LLM(...)), got {num_hosts}")
    bundle = dict(resources_per_host or {"CPU": 1})
    group = placement_group([bundle] * num_hosts, strategy=strategy)
    ray.get(group.ready(), timeout=timeout)
    env = {"env_vars": {k: str(v) for k, v in (env_vars or {}).items()}}
    processes = [
        EngineProcess.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            runtime_env=env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i),
        ).remote(i, num_hosts)
        for i in range(num_hosts)]
    try:
        coordinator = ray.get(processes[0].coordinator_address.remote())
        placed = ray.get([p.start.remote(coordinator, model, dict(engine_kwargs or {}))
                          for p in processes], timeout=timeout)
    except BaseException:
        for p in processes:
            ray.kill(p)
        remove_placement_group(group)
        raise
    followers = [p.follow.remote() for p in processes[1:]]
    return RayMultiHostEngine(processes, followers, group, placed)
