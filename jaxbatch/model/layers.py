"""Layers every family is built from: the attention block (q/k norms, RoPE, KV write, paged
attention), the dense MLP and the routed MoE block.

Every weight matmul is `k.matmul(x, w)` (`model/kernels.py`: the weight applies itself,
`model/linear.py`), and a LoRA delta, where the engine serves adapters, is added after it by
the layer's `LayerLoRA`. Nothing here knows which CPU or kernel runs a matmul.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.inputs import KVPool
from jaxbatch.model.kernels import Kernels
from jaxbatch.model.linear import SILU_MUL, activation, layer_matrix, split
from jaxbatch.model.lora_delta import LayerLoRA
from jaxbatch.model.norms import rms_norm
from jaxbatch.model.rope import apply_rope
from pallas_kernels.int8 import write_kv_int8
from pallas_kernels.ordered_sum import ordered_softmax, ordered_sum
from pallas_kernels.reference import write_kv_ref

# attend(q [T, H, Dh], k_pages, v_pages, block_offset int32 scalar, scales=None, window=None,
#        soft_cap=None) -> [T, H, Dh]; window and soft_cap are passed only by models with them.
AttendFn = Callable[..., jnp.ndarray]

# Matrices whose product may be one matrix holding their parts side by side (the weights'
# CPU form, `worker/weight_forms.py`): the fused name -> its parts, in order.
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


class Layer:
    """One layer's weights as the layer scan hands them over: `layer[name]` is this layer's
    array or matrix (a scanned slice, or `PerLayer.at(index)`)."""

    def __init__(self, weights: dict, index, lora: LayerLoRA):
        self.weights, self.index, self.lora = weights, index, lora

    def __getitem__(self, name: str):
        return layer_matrix(self.weights[name], self.index)

    def __contains__(self, name: str) -> bool:
        return name in self.weights


def linear(k: Kernels, x, layer: Layer, name: str):
    """x @ the layer's matrix `name`, plus its LoRA delta."""
    return layer.lora.add(name, k.matmul(x, layer[name]), x)


def projections(k: Kernels, x, layer: Layer, fused_name: str, widths) -> list:
    """x @ each part of `fused_name` (`FUSED`): one matmul and a split where the layer holds
    the fused matrix (`widths`: its parts' out widths, or their count for equal parts), else
    a matmul per part; each part's LoRA delta is added to its own output."""
    parts = FUSED[fused_name]
    if fused_name not in layer:
        return [linear(k, x, layer, p) for p in parts]
    outs = split(k.matmul(x, layer[fused_name]), widths)
    return [layer.lora.add(p, out, x) for p, out in zip(parts, outs)]


def unsharded(fn):
    """`forward_hidden`'s per_shard on one device: run fn as it is."""
    return fn


def write_kv_pool(pool: KVPool, k, v, slot_mapping) -> KVPool:
    """Scatters k, v [T, KVH, Dh] into the pool, quantizing on the way into an int8 one."""
    if pool.scales is None:
        return KVPool(*write_kv_ref(pool.k, pool.v, k, v, slot_mapping))
    return KVPool(*write_kv_int8(pool.k, pool.v, *pool.scales, k, v, slot_mapping))


def attention_block(k: Kernels, layer: Layer, cfg: ModelConfig, x, rope, slot_mapping,
                    pool: KVPool, block_offset, attend, window, per_shard):
    """`rope`: this layer's (cos, sin) [T, R] (`rope.rope_tables`); `window`: its int32
    scalar from the scan, or None for models without one."""
    num_tokens = x.shape[0]
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, key, v = projections(k, x, layer, "wqkv", (q_width, kv_width, kv_width))
    if cfg.qkv_bias:
        q, key, v = q + layer["bq"], key + layer["bk"], v + layer["bv"]
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)                    # [T, H, Dh]
    key = key.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)             # [T, K, Dh]
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        key = rms_norm(key, layer["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q = apply_rope(q, *rope)
    key = apply_rope(key, *rope)
    extra = {}
    if window is not None:
        extra["window"] = window
    if cfg.attn_soft_cap is not None:
        extra["soft_cap"] = float(cfg.attn_soft_cap)

    def write_and_attend(q, key, v, pool):
        # Write first: this step's tokens attend to themselves through the pool.
        block_size = pool.k.shape[2]
        pool = write_kv_pool(pool, key, v, slot_mapping + block_offset * block_size)
        return attend(q, pool.k, pool.v, block_offset, scales=pool.scales, **extra), pool

    out, pool = per_shard(write_and_attend)(q, key, v, pool)                  # [T, H, Dh]
    out = linear(k, out.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer, "wo")
    if cfg.o_bias:
        out = out + layer["bo"]
    return out, pool


def mlp_block(k: Kernels, layer: Layer, cfg: ModelConfig, x):
    return linear(k, _activated(k, x, layer, cfg), layer, "w_down")


def _activated(k: Kernels, x, layer: Layer, cfg: ModelConfig):
    """activation(x @ gate) * (x @ up): where gate and up are one matrix with no LoRA delta of
    their own, the activation is the product's epilogue (a kernel may apply it in place)."""
    if (cfg.hidden_act == "silu" and "w_gate_up" in layer
            and not any(layer.lora.has(p) for p in FUSED["w_gate_up"])):
        return k.matmul(x, layer["w_gate_up"], epilogue=SILU_MUL)
    gate, up = projections(k, x, layer, "w_gate_up", 2)
    return activation(gate, cfg.hidden_act) * up


def moe_block(k: Kernels, layer: Layer, cfg: ModelConfig, x):
    """Routed experts, computed densely: every expert runs on every token and the router's
    top-k weights (zero elsewhere) combine them. E / k times the FLOPs of a sparse dispatch,
    but one fixed shape, no sort or gather, and each expert's matmul is `k.matmul` like any
    other. Measured on this CPU (XLA:CPU, float32, jit, median of 20; tokens grouped by expert
    with argsort + `jax.lax.ragged_dot` for the other): T=16 d=64 F=32 E=4 k=2 0.07 vs
    0.08 ms; T=256 0.17 vs 0.53 ms; T=16 d=512 F=256 E=8 2.3 vs 9.1 ms; T=256 same 66 vs 110 ms;
    T=16 d=1024 F=768 E=64 k=8 1.7 vs 4.0 s: dense wins everywhere on CPU. A GPU, where
    ragged_dot has a grouped-GEMM lowering, is unmeasured (no device was lent)."""
    logits = linear(k, x, layer, "w_router").astype(jnp.float32)          # [T, E]
    probs = ordered_softmax(logits)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)               # [T, k]
    if cfg.norm_topk_prob:
        top_w = top_w / ordered_sum(top_w, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts, dtype=jnp.float32)
                      * top_w[..., None], axis=1)                              # [T, E]
    per_expert = jax.vmap(k.matmul, in_axes=(None, 0))                           # -> [E, T, out]
    gate = per_expert(x, layer["we_gate"])                                     # [E, T, F]
    up = per_expert(x, layer["we_up"])
    down = jax.vmap(k.matmul)(activation(gate, cfg.hidden_act) * up, layer["we_down"])  # [E, T, d]
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), down)
