"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) as pure functions of a params pytree.

Params layout (a plain dict; weights stored [in, out] so `x @ w` reads naturally):
    embed      [V, d]
    layers     one dict over layers: vectors stacked on a leading axis L (attn_norm [L, d],
               mlp_norm [L, d], bq/bk/bv [L, ...] when qkv_bias, bo [L, d] when o_bias), and
               matrices (wq [d, H*Dh], wk/wv [d, K*Dh], wo [H*Dh, d], w_gate/w_up [d, F],
               w_down [F, d]) either stacked too ([L, in, out]) or kept as a tuple of L arrays
    final_norm [d]
    lm_head    [d, V]   absent when embeddings are tied
Checkpoint readers produce a list of per-layer dicts; `stack_layers` turns it into this form.
With int8 weights (`model/quantize.py`) each layer matrix is a dict {"int8", "scale"}, stacked
or per layer in the same way.

The forward is one layer's computation iterated with `lax.scan`: compiled once, not once per
layer, which is what makes a 30-layer step compile in about a second instead of ten. Two ways
for the scan to reach a layer's matrices:
  stacked [L, in, out]  (default) the scan slices layer l out of the stack. XLA:GPU feeds such
                        a slice to its GEMM in place; XLA:CPU copies it first (every weight,
                        every step: about +20 ms on a 16-row SmolLM2 decode step).
  tuple of L arrays     (JAXBATCH_WEIGHT_LAYOUT=per_layer) each matmul is a `lax.switch` over
                        the L weights, whose chosen branch reads its weight where it lies: no
                        copy, 15-20 % faster decode-only steps on CPU, but tracing 30 branches
                        per matmul makes warm-up's tracing 3x slower (a second start 26 s
                        instead of 13.5 s), and on the mixed benchmark workload (3 prompt
                        tokens per output token) throughput was the same (92-94 vs 91-93
                        tok/s). On a GPU a switch would also sync the host.

The KV pool is one (k_pages, v_pages) pair, each [num_kv_heads, L * num_blocks, block_size,
head_dim], plus (k_scales, v_scales) [num_kv_heads, L * num_blocks, block_size] when the pages
are int8 (`pallas_kernels/int8.py`): layer l's block b is row l * num_blocks + b. Folding the layer into the block axis
lets the scan carry the whole pool and update it in place (a scatter into the carry), while
every attention kernel still sees the plain one-layer layout [KVH, blocks, block_size, Dh]: a
layer only shifts its block ids by l * num_blocks (`layer_block_offset`). Block 0 of each
layer is that layer's null block.
Attention is injected as `attend(q, k_pages, v_pages, block_offset) -> out`, so the same
forward runs a decode step, a prefill chunk, the plain-jnp reference or a Pallas kernel.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model import precision
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.quantize import int8_matmul, is_quantized
from jaxbatch.model.rope import apply_rope
from pallas_kernels.int8 import write_kv_int8
from pallas_kernels.reference import write_kv_ref

# attend(q [T, H, Dh], k_pages, v_pages, block_offset int32 scalar, scales=None) -> [T, H, Dh]
AttendFn = Callable[..., jnp.ndarray]


def stack_layers(params: dict, matrices_per_layer: bool | None = None) -> dict:
    """Per-layer dicts -> the layers dict above (idempotent). `matrices_per_layer` keeps the
    matrices as a tuple of L arrays; None: only if JAXBATCH_WEIGHT_LAYOUT=per_layer (see the
    module doc). Vectors are always stacked. Works on numpy or jax arrays."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    if matrices_per_layer is None:
        matrices_per_layer = os.environ.get("JAXBATCH_WEIGHT_LAYOUT") == "per_layer"
    stack = np.stack if isinstance(jax.tree.leaves(layers)[0], np.ndarray) else jnp.stack
    out = {}
    for name in layers[0]:
        per_layer = [layer[name] for layer in layers]
        if is_quantized(per_layer[0]):           # int8 matrix: stack its values and its scales
            out[name] = tuple(per_layer) if matrices_per_layer else {
                part: stack([w[part] for w in per_layer]) for part in per_layer[0]}
            continue
        is_matrix = per_layer[0].ndim == 2
        out[name] = tuple(per_layer) if is_matrix and matrices_per_layer else stack(per_layer)
    return {**params, "layers": out}


def num_layers_of(params: dict) -> int:
    layers = params["layers"]
    if isinstance(layers, list):
        return len(layers)
    return layers["attn_norm"].shape[0]


def _dense(x, weight):
    return int8_matmul(x, weight) if is_quantized(weight) else precision.dense(x, weight)


def _matmul(x, weight, index):
    """x @ this layer's weight: `weight` is the layer's [in, out] slice (stacked layout) or the
    tuple of every layer's weight (per-layer layout, chosen by `index`); int8 or float."""
    if not isinstance(weight, tuple):
        return _dense(x, weight)
    if len(weight) == 1:
        return _dense(x, weight[0])
    return jax.lax.switch(index, [lambda x, w=w: _dense(x, w) for w in weight], x)


def unsharded(fn):
    """`forward_hidden`'s per_shard on one device: run fn as it is."""
    return fn


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def write_kv_pool(pool: tuple, k, v, slot_mapping) -> tuple:
    """Scatters k, v [T, KVH, Dh] into a float pool (k, v) or an int8 pool (k, v, k_scales,
    v_scales), quantizing on the way in."""
    if len(pool) == 2:
        return write_kv_ref(*pool, k, v, slot_mapping)
    return write_kv_int8(*pool, k, v, slot_mapping)


def _attention_block(layer, cfg: ModelConfig, x, positions, slot_mapping, pool,
                     index, block_offset, attend, inv_freq, per_shard):
    num_tokens = x.shape[0]
    q = _matmul(x, layer["wq"], index)
    k = _matmul(x, layer["wk"], index)
    v = _matmul(x, layer["wv"], index)
    if cfg.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)                    # [T, H, Dh]
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)                 # [T, K, Dh]
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)

    def write_and_attend(q, k, v, *pool):
        # Write first: this step's tokens attend to themselves through the pool.
        block_size = pool[0].shape[2]
        pool = write_kv_pool(pool, k, v, slot_mapping + block_offset * block_size)
        scales = pool[2:] if len(pool) == 4 else None
        return (attend(q, pool[0], pool[1], block_offset, scales=scales),) + tuple(pool)

    out, *pool = per_shard(write_and_attend)(q, k, v, *pool)                  # [T, H, Dh]
    pool = tuple(pool)
    out = _matmul(out.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer["wo"], index)
    if cfg.o_bias:
        out = out + layer["bo"]
    return out, pool


def _mlp_block(layer, x, index):
    gate = _matmul(x, layer["w_gate"], index)
    up = _matmul(x, layer["w_up"], index)
    act = (gate * (1.0 / (1.0 + jnp.exp(-gate.astype(jnp.float32)))).astype(x.dtype) * up)
    return _matmul(act, layer["w_down"], index)


def forward_hidden(params, cfg: ModelConfig, kv_pool, tokens, positions, slot_mapping,
                   attend: AttendFn, inv_freq, per_shard: Callable = unsharded):
    """tokens, positions, slot_mapping: [T] int32 (slots of layer 0's blocks);
    kv_pool = (k_pages, v_pages) [KVH, L * N, bs, Dh], plus (k_scales, v_scales) [KVH, L * N, bs]
    for an int8 pool -> (final-normed hidden [T, d], new pool of the same structure).

    `per_shard(fn)` runs the KV write and attention, `fn(q, k, v, *pool)`, once per
    tensor-parallel shard of the heads (`jaxbatch/parallel/sharding.py`: a `jax.shard_map`,
    since kernels are opaque to automatic sharding); on one device it is the identity."""
    params = stack_layers(params)
    num_layers = num_layers_of(params)
    blocks_per_layer = kv_pool[0].shape[1] // num_layers
    # Stacked arrays are scanned over (sliced per layer); per-layer tuples are closed over
    # whole and picked by index inside each matmul.
    per_layer = {k: v for k, v in params["layers"].items() if isinstance(v, tuple)}
    stacked = {k: v for k, v in params["layers"].items() if not isinstance(v, tuple)}
    x = params["embed"][tokens]                                               # [T, d]

    def one_layer(carry, xs):
        x, pool = carry
        layer, index = xs
        layer = {**layer, **per_layer}
        h, pool = _attention_block(
            layer, cfg, rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), positions,
            slot_mapping, pool, index, index * blocks_per_layer, attend, inv_freq, per_shard)
        x = x + h
        x = x + _mlp_block(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps), index)
        return (x, pool), None

    (x, pool), _ = jax.lax.scan(
        one_layer, (x, tuple(kv_pool)), (stacked, jnp.arange(num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), pool


def compute_logits(params, hidden):
    """hidden [N, d] -> float32 logits [N, V]."""
    return precision.logits(params, hidden)
