"""Decode attention over bf16 KV pages on CPU (`paged_decode.cc`), with the interface of
`pallas_kernels.xla_paged_attention.paged_decode_attention_xla`, its reference.

XLA:CPU runs the reference as dozens of small ops per layer (gathers, batched dots of a few
rows, masks, a fold); the kernel reads each row's keys and values once, in place, with an
online softmax, and gives each row the same result whatever the batch.

    unavailable_reason()   None where the kernel runs here
    supports(q, k_pages, k_scales, soft_cap)   whether it covers this call (bf16 q, a pool of
                                               bf16 bits, no int8 scales, no soft cap, at most
                                               MAX_GROUP query heads per kv head)
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


def supports(q, k_pages, k_scales=None, soft_cap=None) -> bool:
    num_heads, head_dim = q.shape[1:]
    return (k_pages.dtype == jnp.uint16 and k_scales is None and soft_cap is None
            and q.dtype == jnp.bfloat16 and num_heads % k_pages.shape[0] == 0
            and num_heads // k_pages.shape[0] <= MAX_GROUP and head_dim <= MAX_HEAD_DIM)


def paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos, lengths,
                           *, scale=None, window=None):
    if not supports(q, k_pages):
        raise ValueError(f"paged_decode: bf16 q [B, H, D] and a uint16 pool expected, got "
                         f"{q.dtype} {q.shape}, {k_pages.dtype} {k_pages.shape}")
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
