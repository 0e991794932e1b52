"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) as pure functions of a params pytree.

Params layout (a plain dict; weights stored [in, out] so `x @ w` reads naturally):
    embed      [V, d]
    layers     one dict of arrays stacked over layers (leading axis L): attn_norm [L, d],
               wq [L, d, H*Dh], wk [L, d, K*Dh], wv [L, d, K*Dh], wo [L, H*Dh, d],
               (bq, bk, bv when qkv_bias; bo when o_bias), mlp_norm [L, d],
               w_gate [L, d, F], w_up [L, d, F], w_down [L, F, d]
    final_norm [d]
    lm_head    [d, V]   absent when embeddings are tied
Checkpoint readers produce a list of per-layer dicts; `stack_layers` turns it into this form.

The forward is one layer's computation iterated with `lax.scan`: compiled once, not once per
layer, which is what makes a 30-layer step compile in about a second instead of ten.

The KV pool is one (k_pages, v_pages) pair, each [num_kv_heads, L * num_blocks, block_size,
head_dim]: layer l's block b is row l * num_blocks + b. Folding the layer into the block axis
lets the scan carry the whole pool and update it in place (a scatter into the carry), while
every attention kernel still sees the plain one-layer layout [KVH, blocks, block_size, Dh]: a
layer only shifts its block ids by l * num_blocks (`layer_block_offset`). Block 0 of each
layer is that layer's null block.
Attention is injected as `attend(q, k_pages, v_pages, block_offset) -> out`, so the same
forward runs a decode step, a prefill chunk, the plain-jnp reference or a Pallas kernel.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.rope import apply_rope
from pallas_kernels.reference import write_kv_ref

# attend(q [T, H, Dh], k_pages, v_pages, block_offset int32 scalar) -> [T, H, Dh]
AttendFn = Callable[..., jnp.ndarray]


def stack_layers(params: dict) -> dict:
    """Per-layer dicts -> one dict of [L, ...] arrays (idempotent). Works on numpy or jax arrays
    without an extra device copy of the unstacked form surviving the call."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    stack = np.stack if isinstance(jax.tree.leaves(layers)[0], np.ndarray) else jnp.stack
    stacked = {name: stack([layer[name] for layer in layers]) for name in layers[0]}
    return {**params, "layers": stacked}


def num_layers_of(params: dict) -> int:
    layers = params["layers"]
    return len(layers) if isinstance(layers, list) else layers["wq"].shape[0]


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _attention_block(layer, cfg: ModelConfig, x, positions, slot_mapping, k_pool, v_pool,
                     block_offset, attend, inv_freq):
    num_tokens = x.shape[0]
    q = x @ layer["wq"]
    k = x @ layer["wk"]
    v = x @ layer["wv"]
    if cfg.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)                    # [T, H, Dh]
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)                 # [T, K, Dh]
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    # Write first: this step's tokens attend to themselves through the pool.
    block_size = k_pool.shape[2]
    k_pool, v_pool = write_kv_ref(k_pool, v_pool, k, v, slot_mapping + block_offset * block_size)
    out = attend(q, k_pool, v_pool, block_offset).reshape(num_tokens, cfg.num_heads * cfg.head_dim)
    out = out @ layer["wo"]
    if cfg.o_bias:
        out = out + layer["bo"]
    return out, k_pool, v_pool


def _mlp_block(layer, x):
    gate = x @ layer["w_gate"]
    up = x @ layer["w_up"]
    return (gate * (1.0 / (1.0 + jnp.exp(-gate.astype(jnp.float32)))).astype(x.dtype) * up) @ layer["w_down"]


def forward_hidden(params, cfg: ModelConfig, kv_pool, tokens, positions, slot_mapping,
                   attend: AttendFn, inv_freq):
    """tokens, positions, slot_mapping: [T] int32 (slots of layer 0's blocks);
    kv_pool = (k_pages, v_pages) [KVH, L * N, bs, Dh] -> (final-normed hidden [T, d], new pool)."""
    params = stack_layers(params)
    num_layers = params["layers"]["wq"].shape[0]
    blocks_per_layer = kv_pool[0].shape[1] // num_layers
    x = params["embed"][tokens]                                               # [T, d]

    def one_layer(carry, xs):
        x, k_pool, v_pool = carry
        layer, index = xs
        h, k_pool, v_pool = _attention_block(
            layer, cfg, rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), positions,
            slot_mapping, k_pool, v_pool, index * blocks_per_layer, attend, inv_freq)
        x = x + h
        x = x + _mlp_block(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        return (x, k_pool, v_pool), None

    (x, k_pool, v_pool), _ = jax.lax.scan(
        one_layer, (x, kv_pool[0], kv_pool[1]),
        (params["layers"], jnp.arange(num_layers, dtype=jnp.int32)))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), (k_pool, v_pool)


def compute_logits(params, hidden):
    """hidden [N, d] -> float32 logits [N, V]."""
    if "lm_head" in params:
        logits = hidden @ params["lm_head"]
    else:
        logits = hidden @ params["embed"].T
    return logits.astype(jnp.float32)
