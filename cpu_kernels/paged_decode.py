"""Decode attention over bf16 KV pages on CPU (`paged_decode.cc`), with the interface of
`pallas_kernels.xla_paged_attention.paged_decode_attention_xla`, its reference.

XLA:CPU runs the reference as dozens of small ops per layer (gathers, batched dots of a few
rows, masks, a fold); the kernel reads each row's keys and values once, in place, with an
online softmax, and gives each row the same result whatever the batch.

    unavailable_reason()   None where the kernel runs on this machine, else why not
    why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
                           None where it covers such a call here, else why the jnp path runs
                           (pages not bf16 bits: float32 or int8; a soft cap; more than
                           MAX_GROUP query heads per kv head; head_dim past MAX_HEAD_DIM)
    paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos,
                           lengths, *, scale, window)  -> [B, H, D] in q's dtype
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import availability

SOURCE, SYMBOL, TARGET = "paged_decode.cc", "JaxbatchPagedDecode", "jaxbatch_paged_decode"
NO_WINDOW = 2 ** 30
MAX_GROUP, MAX_HEAD_DIM = 16, 512


def unavailable_reason() -> str | None:
    return availability.unavailable_reason(SOURCE, SYMBOL, TARGET)


def _uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap) -> str | None:
    if jnp.dtype(pool_dtype) != jnp.uint16:
        return f"{jnp.dtype(pool_dtype).name} pages, not bf16 bits"
    if soft_cap is not None:
        return "attention soft cap"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        return f"{num_heads} heads over {num_kv_heads} kv heads, head_dim {head_dim}"
    return None


def why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap=None) -> str | None:
    return (_uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
            or unavailable_reason())


def paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos, lengths,
                           *, scale=None, window=None):
    uncovered = _uncovered(k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], None)
    if uncovered or q.dtype != jnp.bfloat16:
        raise ValueError(f"paged_decode: bf16 q [B, H, D] and a uint16 pool expected, got "
                         f"{q.dtype} {q.shape}, {k_pages.dtype} {k_pages.shape}"
                         f"{f' ({uncovered})' if uncovered else ''}")
    reason = availability.register(SOURCE, SYMBOL, TARGET)
    if reason:
        raise RuntimeError(f"paged_decode cannot run here: {reason}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    scale = jnp.full((1,), scale, jnp.float32)             # an operand: it may be traced
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    result = jax.ffi.ffi_call(TARGET, out)(
        q, k_pages, v_pages, i32(item_slot), i32(item_pages), i32(item_first_pos), i32(lengths),
        window, scale)
    return result.astype(q.dtype)
