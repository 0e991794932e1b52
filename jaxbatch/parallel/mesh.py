"""Which devices a tensor-parallel engine runs on, as a `jax.sharding.Mesh` with one "tp" axis,
and which model/setting combinations can be split that way (checked before anything is placed).

The axis is Auto, not Explicit: from jax 0.10 `jax.make_mesh` makes Explicit axes by default,
and those reject the Megatron matmuls ([T, d] replicated @ [d, F] split on F) unless every op
states its output sharding. With Auto axes XLA's partitioner propagates the weights'
shardings through the layer and inserts the two all-reduces itself.
"""
from __future__ import annotations

import numpy as np

import jax
from jax.sharding import AxisType, Mesh

from jaxbatch.model.config import ModelConfig

TP_AXIS = "tp"


def check_tensor_parallel(cfg: ModelConfig, tp: int, num_devices: int) -> None:
    """ValueError naming the setting that cannot be split `tp` ways."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be a positive integer")
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; jax sees "
                         f"{num_devices} ({jax.default_backend()})")
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_heads={cfg.num_heads}")
    kvh = cfg.num_kv_heads
    if kvh % tp and tp % kvh:
        # Fewer KV heads than shards works by replicating each KV head tp / kvh times; that
        # needs a whole number of copies.
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={kvh}: one must divide "
                         f"the other")
    if cfg.num_experts:
        # MoE (issue 24): whole experts per shard; the dense intermediate_size is unused.
        if cfg.num_experts % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"num_experts={cfg.num_experts}")
    elif cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"intermediate_size={cfg.intermediate_size}")


def make_tp_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh over the first `tp` of `devices` (default: every device of every process,
    in jax's order, which groups a host's devices together)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} given")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,), axis_types=(AxisType.Auto,))
