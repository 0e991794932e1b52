"""The one place that decides which engine the options ask for.

    build_engine(model, **options)
      tensor_parallel_size=T                  one LLMEngine over T devices
      data_parallel_size=D                    D LLMEngines (replicas) of T devices each,
                                              behind engine/data_parallel.py's router
      num_processes=P, process_id, coordinator_address
                                              one engine over every process's devices, process
                                              0 leading (engine/multihost.py); T counts
                                              global devices

Every result implements `engine/interface.py`'s EngineClient. `LLM(...)` and `jaxbatch serve`
build through here; `LLMEngine(...)` is the plain engine only.
"""
from __future__ import annotations

import logging

from jaxbatch.engine.config import EngineConfig
from jaxbatch.engine.interface import EngineClient
from jaxbatch.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

SCALE_OUT = ("data_parallel_size", "num_processes", "process_id", "coordinator_address")


def build_engine(model=None, **kwargs) -> EngineClient:
    """`kwargs`: engine options (engine/config.py) plus LLMEngine's `loaded=` / `runner=` /
    `devices=`. Options are checked before anything loads."""
    objects = {k: kwargs.pop(k) for k in ("loaded", "runner", "devices") if k in kwargs}
    if isinstance(objects.get("runner"), str):     # runner="pooling": the option, not a runner
        kwargs["runner"] = objects.pop("runner")
    par = EngineConfig.from_kwargs(model=model, **kwargs).parallel
    engine_kwargs = {k: v for k, v in kwargs.items() if k not in SCALE_OUT}
    if par.num_processes > 1:
        if par.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with num_processes > 1 is not supported: "
                             "run one multi-process engine per replica")
        from jaxbatch.engine import multihost
        multihost.initialize(par.coordinator_address, par.num_processes, par.process_id)
        if objects.get("loaded") is None:
            # Without the orbax cache of converted weights: with jax.distributed up, orbax
            # saves collectively (process 0 writes), and processes sharing a disk then race
            # to rename their half-written copies into the cache. Each process converts.
            from jaxbatch.model.loader import load_model
            objects["loaded"] = load_model(model, kwargs.get("dtype", "auto"), use_cache=False,
                                           on_device=False)
        if par.process_id != 0:
            # KV events come from process 0 alone: the followers apply its steps to prefix
            # caches that mirror its own, and would publish the same blocks again
            engine_kwargs.pop("kv_events_config", None)
        return multihost.MultiHostEngine(LLMEngine(model, **objects, **engine_kwargs))
    if par.data_parallel_size == 1:
        return LLMEngine(model, **objects, **engine_kwargs)
    if "runner" in objects or "devices" in objects:
        raise ValueError("data_parallel_size > 1 places each replica itself: runner= and "
                         "devices= do not apply")
    return _replicas(model, par.data_parallel_size, objects.get("loaded"), engine_kwargs)


def _replicas(model, count: int, loaded, engine_kwargs):
    import jax
    from jaxbatch.model.loader import load_model
    from jaxbatch.engine.data_parallel import DataParallelEngine
    devices = jax.devices()
    per = engine_kwargs.get("tensor_parallel_size", 1)
    if len(devices) >= per * count:
        groups = [devices[i * per:(i + 1) * per] for i in range(count)]
    elif per == 1:
        # Fewer devices than replicas (a one-device CPU): the replicas share the default
        # device, which only overlaps their host work. Allowed, so the routing can be run
        # and tested anywhere; said out loud, as it does not add device capacity.
        logger.warning("data_parallel_size=%d on %d device(s): replicas share devices",
                       count, len(devices))
        groups = [None] * count
    else:
        raise ValueError(f"data_parallel_size={count} x tensor_parallel_size={per} needs "
                         f"{per * count} devices; jax sees {len(devices)}")
    # Weights read once; each replica's runner places its own copy on its devices (host
    # arrays for that), or all share the one copy on the default device.
    loaded = loaded or load_model(model, engine_kwargs.get("dtype", "auto"),
                                  on_device=groups[0] is None)
    return DataParallelEngine([LLMEngine(model, devices=group, loaded=loaded,
                                         **_replica_options(engine_kwargs, rank))
                               for rank, group in enumerate(groups)])


def _replica_options(engine_kwargs: dict, rank: int) -> dict:
    """Replica `rank` publishes its KV events as vLLM's data-parallel rank `rank` does: on the
    endpoints' ports + rank, each batch naming the rank."""
    events = engine_kwargs.get("kv_events_config")
    if not events:
        return engine_kwargs
    return {**engine_kwargs, "kv_events_config": {**events, "data_parallel_rank": rank}}
