"""Layers every family is built from: the one matmul, norms, activations, the attention block
(q/k norms, RoPE, KV write, paged attention), the dense MLP and the routed MoE block.

Every weight matmul goes through `_dense` (or `_matmul`, its per-layer-layout front): the
dtype policy of the dots (int8 weights, bf16 x bf16 with float32 accumulation) is decided in
that one place for every family.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from cpu_kernels import add_rms_norm as cpu_add_rms_norm
from cpu_kernels import packed_gemm
from jaxbatch.model import precision
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.fused import FUSED, split
from jaxbatch.model.lora_delta import lora_delta
from jaxbatch.model.quantize import int8_matmul, is_quantized
from jaxbatch.model.rope import apply_rope
from pallas_kernels.int8 import write_kv_int8
from pallas_kernels.ordered_sum import ordered_softmax, ordered_sum
from pallas_kernels.reference import write_kv_ref

# attend(q [T, H, Dh], k_pages, v_pages, block_offset int32 scalar, scales=None, window=None,
#        soft_cap=None) -> [T, H, Dh]; window and soft_cap are passed only by models with them.
AttendFn = Callable[..., jnp.ndarray]


def _dense(x, weight):
    """Every matmul of the model: int8 weights, or the dtype policy of `precision.dense`."""
    return int8_matmul(x, weight) if is_quantized(weight) else precision.dense(x, weight)


def _matmul(x, weight, index, lora=None):
    """x @ this layer's weight: `weight` is the layer's [in, out] slice (stacked layout) or the
    tuple of every layer's weight (per-layer layout, chosen by `index`); int8 or float.
    `lora`: (A [S, r, in], B [S, r, out], one_hot [T, S]) of this layer's adapter pool
    (jaxbatch/lora/), whose delta is added; None (no LoRA engine) traces exactly as before."""
    return _add_lora(_matmul_base(x, weight, index), x, lora)


def _add_lora(out, x, lora):
    if lora is None:
        return out
    return (out.astype(jnp.float32) + lora_delta(x, *lora)).astype(out.dtype)


def _projections(x, layer, fused_name: str, widths, index) -> list:
    """x @ each part of `fused_name` (`fused.FUSED`): one dot and a split where the layer
    holds the fused matrix (`widths`: its parts' out widths, or their count for equal
    parts), else a dot per part; each part's LoRA delta is added to its own output."""
    parts = FUSED[fused_name]
    if fused_name not in layer:
        return [_matmul(x, layer[p], index, layer.get(f"lora_{p}")) for p in parts]
    outs = split(_matmul_base(x, layer[fused_name], index), widths)
    return [_add_lora(out, x, layer.get(f"lora_{p}")) for p, out in zip(parts, outs)]


def _matmul_base(x, weight, index, fn=None):
    """fn(x, this layer's weight), `_dense` by default."""
    fn = fn or _dense
    if not isinstance(weight, tuple):
        return fn(x, weight)
    if len(weight) == 1:
        return fn(x, weight[0])
    return jax.lax.switch(index, [lambda x, w=w: fn(x, w) for w in weight], x)


def unsharded(fn):
    """`forward_hidden`'s per_shard on one device: run fn as it is."""
    return fn


def rms_norm(x, weight, eps, offset: float = 0.0):
    """Scales by (offset + weight): Gemma stores w with offset 1 meaning identity."""
    x32 = x.astype(jnp.float32)
    mean_square = ordered_sum(x32 * x32, keepdims=True) / x.shape[-1]           # batch-invariant
    normed = x32 * jnp.reciprocal(jnp.sqrt(mean_square + eps))
    return (normed * (weight.astype(jnp.float32) + offset)).astype(x.dtype)


def add_rms_norm(x, h, weight, eps, offset: float = 0.0, kernel: bool = False):
    """(x + h, rms_norm(x + h)): a residual add and the norm after it. Narrower than float32
    (bf16), the sum is rounded to its dtype before the norm, as Hugging Face's forward rounds
    it: XLA would fuse the add into the norm's float32 math and skip that rounding. `kernel`:
    where it runs (bf16, `cpu_kernels.add_rms_norm`), one CPU kernel call for both; it rounds
    as this does, but takes the IEEE square root and division where XLA:CPU takes its own
    approximations (so a normed value may differ by a bf16 step); other platforms lower the
    same call to the jnp form."""
    def two_steps(x, h, weight):
        if x.dtype == jnp.float32:
            total = x + h
            return total, rms_norm(total, weight, eps, offset)
        info = jnp.finfo(x.dtype)
        total = jax.lax.reduce_precision(x.astype(jnp.float32) + h.astype(jnp.float32),
                                         exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return total.astype(x.dtype), rms_norm(total, weight, eps, offset).astype(x.dtype)
    if not (kernel and x.dtype == jnp.bfloat16 and cpu_add_rms_norm.unavailable_reason() is None):
        return two_steps(x, h, weight)
    fused = lambda x, h, w: tuple(cpu_add_rms_norm.add_rms_norm(x, h, w, eps, offset))
    return jax.lax.platform_dependent(x, h, weight, cpu=fused, default=two_steps)


def activation(gate, kind: str):
    g32 = gate.astype(jnp.float32)
    if kind == "gelu_tanh":                 # torch's gelu(approximate="tanh")
        return jax.nn.gelu(g32, approximate=True).astype(gate.dtype)
    return (gate * (1.0 / (1.0 + jnp.exp(-g32)))).astype(gate.dtype)


def write_kv_pool(pool: tuple, k, v, slot_mapping) -> tuple:
    """Scatters k, v [T, KVH, Dh] into a float pool (k, v) or an int8 pool (k, v, k_scales,
    v_scales), quantizing on the way in."""
    if len(pool) == 2:
        return write_kv_ref(*pool, k, v, slot_mapping)
    return write_kv_int8(*pool, k, v, slot_mapping)


def attention_block(layer, cfg: ModelConfig, x, rope, slot_mapping, pool, index,
                    block_offset, attend, window, per_shard):
    """`rope`: this layer's (cos, sin) [T, R] (`rope.rope_tables`); `window`: its int32
    scalar from the scan, or None for models without one."""
    num_tokens = x.shape[0]
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = _projections(x, layer, "wqkv", (q_width, kv_width, kv_width), index)
    if cfg.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)                    # [T, H, Dh]
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)                 # [T, K, Dh]
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)
    extra = {}
    if window is not None:
        extra["window"] = window
    if cfg.attn_soft_cap is not None:
        extra["soft_cap"] = float(cfg.attn_soft_cap)

    def write_and_attend(q, k, v, *pool):
        # Write first: this step's tokens attend to themselves through the pool.
        block_size = pool[0].shape[2]
        pool = write_kv_pool(pool, k, v, slot_mapping + block_offset * block_size)
        scales = pool[2:] if len(pool) == 4 else None
        return (attend(q, pool[0], pool[1], block_offset, scales=scales, **extra),) + tuple(pool)

    out, *pool = per_shard(write_and_attend)(q, k, v, *pool)                  # [T, H, Dh]
    pool = tuple(pool)
    out = _matmul(out.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer["wo"], index,
                  layer.get("lora_wo"))
    if cfg.o_bias:
        out = out + layer["bo"]
    return out, pool


def mlp_block(layer, cfg: ModelConfig, x, index):
    return _matmul(_activated(x, layer, cfg, index), layer["w_down"], index,
                   layer.get("lora_w_down"))


# Calls of at least this many tokens take silu * up as the GEMM's epilogue (`_activated`).
# In a call of a few decode rows the epilogue's exponentials and divisions cost about what
# XLA's separate elementwise op costs there; in prefill calls the op costs more than the
# epilogue (docs/BENCHMARKS.md, 2026-12-05 morning).
SILU_EPILOGUE_MIN_ROWS = 32


def _activated(x, layer, cfg: ModelConfig, index):
    """activation(x @ gate) * (x @ up). Where the layer's fused [gate | up] matrix is packed
    for our bf16 GEMM kernel (silu, no LoRA on gate or up, a call of at least
    SILU_EPILOGUE_MIN_ROWS tokens), one kernel call whose epilogue applies the activation
    (`packed_gemm.silu_mul`: the same bits as the two steps below, without their [T, 2 I]
    intermediate); else the GEMM, then the activation."""
    w = layer.get("w_gate_up")
    if (cfg.hidden_act == "silu" and x.dtype == jnp.bfloat16 and isinstance(w, tuple)
            and x.shape[0] >= SILU_EPILOGUE_MIN_ROWS
            and all(precision.is_packed(p) for p in w)
            and not any(f"lora_{p}" in layer for p in FUSED["w_gate_up"])
            and packed_gemm.silu_mul_why_not(w[0][precision.PACKED]) is None):
        return _matmul_base(x, w, index, precision.silu_mul)
    gate, up = _projections(x, layer, "w_gate_up", 2, index)
    return activation(gate, cfg.hidden_act) * up


def moe_block(layer, cfg: ModelConfig, x, index):
    """Routed experts, computed densely: every expert runs on every token and the router's
    top-k weights (zero elsewhere) combine them. E / k times the FLOPs of a sparse dispatch,
    but one fixed shape, no sort or gather, and each expert's matmul is `_dense` like any
    other. Measured on this CPU (XLA:CPU, float32, jit, median of 20; tokens grouped by expert
    with argsort + `jax.lax.ragged_dot` for the other): T=16 d=64 F=32 E=4 k=2 0.07 vs
    0.08 ms; T=256 0.17 vs 0.53 ms; T=16 d=512 F=256 E=8 2.3 vs 9.1 ms; T=256 same 66 vs 110 ms;
    T=16 d=1024 F=768 E=64 k=8 1.7 vs 4.0 s: dense wins everywhere on CPU. A GPU, where
    ragged_dot has a grouped-GEMM lowering, is unmeasured (no device was lent)."""
    logits = _matmul(x, layer["w_router"], index).astype(jnp.float32)          # [T, E]
    probs = ordered_softmax(logits)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)               # [T, k]
    if cfg.norm_topk_prob:
        top_w = top_w / ordered_sum(top_w, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts, dtype=jnp.float32)
                      * top_w[..., None], axis=1)                              # [T, E]
    per_expert = jax.vmap(_dense, in_axes=(None, 0))                           # -> [E, T, out]
    gate = per_expert(x, layer["we_gate"])                                     # [E, T, F]
    up = per_expert(x, layer["we_up"])
    down = jax.vmap(_dense)(activation(gate, cfg.hidden_act) * up, layer["we_down"])  # [E, T, d]
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), down)
