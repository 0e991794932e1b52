"""Which engine the scale-out options ask for. `LLMEngine(...)` and `LLM(...)` come here when
data_parallel_size or num_processes is above 1; tensor parallelism alone is the plain engine.

    tensor_parallel_size=T                    one engine over T devices
    data_parallel_size=D                      D engines (replicas) of T devices each
    num_processes=P, process_id, coordinator_address
                                              one engine over every process's devices, process
                                              0 leading (multihost.py); T counts global devices
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def build_engine(model=None, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 num_processes: int = 1, process_id: int = 0,
                 coordinator_address: str | None = None, **kwargs):
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be a positive integer")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer")
    from jaxbatch.engine.llm_engine import LLMEngine
    if num_processes > 1:
        if data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with num_processes > 1 is not supported: "
                             "run one multi-process engine per replica")
        from jaxbatch.parallel import multihost
        multihost.initialize(coordinator_address, num_processes, process_id)
        if kwargs.get("loaded") is None:
            # Without the orbax cache of converted weights: with jax.distributed up, orbax
            # saves collectively (process 0 writes), and processes sharing a disk then race
            # to rename their half-written copies into the cache. Each process converts.
            from jaxbatch.model.loader import load_model
            kwargs["loaded"] = load_model(model, kwargs.get("dtype", "auto"), use_cache=False,
                                          on_device=False)
        engine = LLMEngine(model, tensor_parallel_size=tensor_parallel_size, **kwargs)
        return multihost.MultiHostEngine(engine)
    if data_parallel_size == 1:
        return LLMEngine(model, tensor_parallel_size=tensor_parallel_size, **kwargs)

    import jax
    from jaxbatch.model.loader import load_model
    from jaxbatch.parallel.data_parallel import DataParallelEngine
    devices = jax.devices()
    per = tensor_parallel_size
    if len(devices) >= per * data_parallel_size:
        groups = [devices[i * per:(i + 1) * per] for i in range(data_parallel_size)]
    elif per == 1:
        # Fewer devices than replicas (a one-device CPU): the replicas share the default
        # device, which only overlaps their host work. Allowed, so the routing can be run
        # and tested anywhere; said out loud, as it does not add device capacity.
        logger.warning("data_parallel_size=%d on %d device(s): replicas share devices",
                       data_parallel_size, len(devices))
        groups = [None] * data_parallel_size
    else:
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
                         f"{per} needs {per * data_parallel_size} devices; jax sees "
                         f"{len(devices)}")
    # Weights read once; each replica's runner places its own copy on its devices (host
    # arrays for that), or all share the one copy on the default device.
    loaded = kwargs.pop("loaded", None) or load_model(model, kwargs.get("dtype", "auto"),
                                                      on_device=groups[0] is None)
    replicas = [LLMEngine(model, tensor_parallel_size=per, devices=group, loaded=loaded,
                          **kwargs) for group in groups]
    return DataParallelEngine(replicas)
