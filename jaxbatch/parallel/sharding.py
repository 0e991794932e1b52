"""Megatron-style tensor parallelism for the Llama forward: where each array lives on the "tp"
mesh axis. This is the runner's only contact with sharding (`ModelRunner(tensor_parallel=...)`).

    wq wk wv w_gate w_up  [.., d, out]  column-parallel: split on `out` (whole heads per shard)
    wo w_down             [.., in, d]   row-parallel: split on `in`; the partial sums of the
                                        shards are added by one all-reduce after attention and
                                        one after the MLP, inserted by XLA from these shardings
    bq bk bv              [.., out]     split like their matrix
    embed, norms, bo      replicated
    lm_head               [d, V]        split on V (vocab-parallel) when tp divides V
    we_gate we_up we_down [L, E, ..]    MoE experts: split on E (whole experts per shard); the
                                        router-weighted sum over experts is the all-reduce

    KV pool (k, v)        [KVH, L*N, bs, Dh]  split on KV heads: every block id exists on every
                                        shard, so the host (scheduler, block manager) is unchanged

Fewer KV heads than shards (8 query / 2 KV heads at tp = 4): each KV head is copied tp / KVH
times in wk/wv (and the model is told it has tp KV heads), so shard s holds exactly the KV
head its query heads read. Query head h reads head h // (H / KVH) of the original model and
head h // (H / tp) of the copied one, which is a copy of the same head: the same model, with
each device holding one KV head, as vLLM does.

The KV write and the attention kernels run per shard under `jax.shard_map` (`per_shard`): a
Pallas kernel is opaque to the partitioner, which would otherwise gather its inputs.
Everything else the runner passes (step inputs, sampling arrays, logits) is replicated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.inputs import KVPool
from jaxbatch.parallel.mesh import TP_AXIS, check_tensor_parallel, make_tp_mesh

COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up", "bq", "bk", "bv")
ROW_PARALLEL = ("wo", "w_down")
KV_PROJECTIONS = ("wk", "wv", "bk", "bv")
EXPERTS = ("we_gate", "we_up", "we_down")      # MoE families (jaxbatch/model/moe.py)
HEADS = P(None, TP_AXIS, None)          # q, k, v, attention output: [T, heads, Dh]
POOL = P(TP_AXIS)                       # [KVH, L*N, bs, Dh]


def _leaf_spec(name: str, ndim: int, vocab_split: bool) -> P:
    """`ndim` counts the layer axis of stacked arrays: wq is [L, d, out] stacked, [d, out] as
    one array of the per-layer tuple layout; biases [L, out]."""
    if name in EXPERTS:                 # always stacked: [L, E, in, out]
        return P(None, TP_AXIS, None, None)
    if name in COLUMN_PARALLEL:
        return P(*([None] * (ndim - 1)), TP_AXIS)
    if name in ROW_PARALLEL:
        return P(*([None] * (ndim - 2)), TP_AXIS, None)
    if name == "lm_head" and vocab_split:
        return P(None, TP_AXIS)
    return P()


def _repeat_kv_heads(a: np.ndarray, copies: int, head_dim: int) -> np.ndarray:
    """[..., KVH * Dh] -> [..., KVH * copies * Dh], each head repeated in place."""
    heads = a.reshape(a.shape[:-1] + (-1, head_dim))                          # [..., KVH, Dh]
    return np.repeat(heads, copies, axis=-2).reshape(a.shape[:-1] + (-1,))


def _name_of(path) -> str:
    """The params key a leaf sits under: ('layers', 'wq'[, i]) -> 'wq', ('embed',) -> 'embed'."""
    keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    return keys[-1]


def _global_array(x, sharding: NamedSharding) -> jax.Array:
    """A host array placed as `sharding` says; in a multi-process run each process places only
    its own devices' slices (every process holds the same full host array)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class TensorParallel:
    def __init__(self, tp: int, devices=None):
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r} must be a positive integer")
        self.size = tp
        self.mesh = make_tp_mesh(tp, devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.pool_sharding = NamedSharding(self.mesh, POOL)
        self.multi_process = any(d.process_index != jax.process_index()
                                 for d in self.mesh.devices.flat)
        self._param_shardings = None

    # ---- the model, split ----------------------------------------------------------------
    def prepare(self, cfg: ModelConfig, params) -> tuple[ModelConfig, dict]:
        """(config the runner computes with, params placed on the mesh). The config differs
        from `cfg` only in num_kv_heads, when KV heads are copied (see the module doc)."""
        check_tensor_parallel(cfg, self.size, self.mesh.devices.size)
        copies = max(1, self.size // cfg.num_kv_heads)
        if copies > 1:
            params = {**params, "layers": {
                name: (jax.tree.map(lambda a: _repeat_kv_heads(np.asarray(a), copies,
                                                               cfg.head_dim), value)
                       if name in KV_PROJECTIONS else value)
                for name, value in params["layers"].items()}}
            cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)
        vocab_split = cfg.vocab_size % self.size == 0
        self._param_shardings = jax.tree_util.tree_map_with_path(
            lambda path, a: NamedSharding(self.mesh, _leaf_spec(_name_of(path), np.ndim(a),
                                                                vocab_split)), params)
        placed = jax.tree.map(_global_array, params, self._param_shardings)
        return cfg, placed

    def allocate_pool(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype):
        """Zeros made where they live: each device allocates only its KV heads."""
        shape = (cfg.num_kv_heads, cfg.num_layers * num_blocks, block_size, cfg.head_dim)
        make = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                       out_shardings=(self.pool_sharding, self.pool_sharding))
        return KVPool(*make())

    # ---- compiled calls ------------------------------------------------------------------
    def jit_shardings(self, args, pool_index: int | None, num_outputs: int | None) -> dict:
        """in/out shardings for `jax.jit`: params as `prepare` placed them, the pool on KV
        heads, everything else replicated. A call that takes the pool (argument `pool_index`)
        returns it last of its `num_outputs` outputs."""
        param_tree = jax.tree.structure(self._param_shardings)
        ins = tuple(self._param_shardings if jax.tree.structure(a) == param_tree
                    else self.pool_sharding if i == pool_index else self.replicated
                    for i, a in enumerate(args))
        outs = (self.replicated if pool_index is None
                else (self.replicated,) * (num_outputs - 1) + (self.pool_sharding,))
        return dict(in_shardings=ins, out_shardings=outs)

    def per_shard(self, fn):
        """`fn(q, k, v, pool) -> (out, pool)` run on each device's heads (a float pool: int8
        ones are refused with tensor parallelism). check_vma off: Pallas calls carry no
        varying-axes rules, and every input here is either split on heads or closed over
        replicated (the step's metadata)."""
        pool = KVPool(POOL, POOL)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(HEADS, HEADS, HEADS, pool),
                             out_specs=(HEADS, pool), check_vma=False)

    # ---- host <-> mesh, for multi-process runs -------------------------------------------
    def to_mesh(self, args):
        """Step inputs as global replicated arrays. One process: unchanged (jit places host
        arrays itself); several: jit refuses host arrays for devices it cannot address."""
        if not self.multi_process:
            return args

        def place(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            if isinstance(x, (np.ndarray, np.generic, jax.Array)):
                return _global_array(x, self.replicated)
            return x
        return jax.tree.map(place, args)

    def to_host(self, tree):
        """Replicated outputs as this process's copy (readable with np.asarray)."""
        if not self.multi_process:
            return tree
        return jax.tree.map(lambda x: x.addressable_data(0)
                            if isinstance(x, jax.Array) and not x.is_fully_addressable else x,
                            tree)
