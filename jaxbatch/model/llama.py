"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) as pure functions of a params pytree.

Params layout (a plain dict; weights stored [in, out] so `x @ w` reads naturally):
    embed      [V, d]
    layers[i]  attn_norm [d], wq [d, H*Dh], wk [d, K*Dh], wv [d, K*Dh], wo [H*Dh, d],
               (bq, bk, bv when qkv_bias; bo when o_bias), mlp_norm [d],
               w_gate [d, F], w_up [d, F], w_down [F, d]
    final_norm [d]
    lm_head    [d, V]   absent when embeddings are tied

The KV pool is a tuple with one (k_pages, v_pages) pair per layer, each
[num_kv_heads, num_blocks, block_size, head_dim]. Separate buffers per layer let XLA update
each in place under donation and let kernels read a layer without slicing a stacked pool.
Attention is injected as `attend(q, k_pages, v_pages) -> out`, so the same forward runs a
decode step, a prefill chunk, the plain-jnp reference or a Pallas kernel.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.rope import apply_rope
from pallas_kernels.reference import write_kv_ref

# attend(q [T, H, Dh], k_pages, v_pages) -> [T, H, Dh]
AttendFn = Callable[..., jnp.ndarray]


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _attention_block(layer, cfg: ModelConfig, x, positions, slot_mapping, kv, attend, inv_freq):
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
    k_pages, v_pages = write_kv_ref(kv[0], kv[1], k, v, slot_mapping)
    out = attend(q, k_pages, v_pages).reshape(num_tokens, cfg.num_heads * cfg.head_dim)
    out = out @ layer["wo"]
    if cfg.o_bias:
        out = out + layer["bo"]
    return out, (k_pages, v_pages)


def _mlp_block(layer, x):
    gate = x @ layer["w_gate"]
    up = x @ layer["w_up"]
    return (gate * (1.0 / (1.0 + jnp.exp(-gate.astype(jnp.float32)))).astype(x.dtype) * up) @ layer["w_down"]


def forward_hidden(params, cfg: ModelConfig, kv_pool, tokens, positions, slot_mapping,
                   attend: AttendFn, inv_freq):
    """tokens, positions, slot_mapping: [T] int32 -> (final-normed hidden [T, d], new kv_pool)."""
    x = params["embed"][tokens]                                               # [T, d]
    new_pool = []
    for layer, kv in zip(params["layers"], kv_pool):
        h, kv = _attention_block(layer, cfg, rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps),
                                 positions, slot_mapping, kv, attend, inv_freq)
        x = x + h
        x = x + _mlp_block(layer, rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps))
        new_pool.append(kv)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), tuple(new_pool)


def compute_logits(params, hidden):
    """hidden [N, d] -> float32 logits [N, V]."""
    if "lm_head" in params:
        logits = hidden @ params["lm_head"]
    else:
        logits = hidden @ params["embed"].T
    return logits.astype(jnp.float32)
