"""Decode attention over bf16 or float32 KV pages on CPU (`paged_decode.cc`), with the
interface of `pallas_kernels.xla_paged_attention.paged_decode_attention_xla`, its reference.

XLA:CPU runs the reference as dozens of small ops per layer (gathers, batched dots of a few
rows, masks, a fold); the kernel reads each row's keys and values once, in place, with an
online softmax, and gives each row the same result whatever the batch.

    unavailable_reason()   None where the kernel runs on this machine, else why not
    why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
                           None where it covers such a call here, else why the jnp path runs
                           (int8 pages; a soft cap; more than MAX_GROUP query heads per kv
                           head; an odd head_dim or one past MAX_HEAD_DIM)
    paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos,
                           lengths, *, scale, window, next_layer_blocks=0)
                           -> [B, H, D] in q's dtype. `next_layer_blocks`: in a pool folding
                           every layer's blocks into one axis, how far the next layer's
                           blocks lie; the kernel publishes the pages its rows read there
                           for the GEMMs before that layer to prefetch (kv_prefetch.h,
                           kv_hints.py). 0: nothing published. A hint: no result changes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import availability

SOURCE = "paged_decode.cc"
# pool element type -> (handler symbol, FFI target, q's dtype): bf16 pages are uint16 bits
_HANDLERS = {jnp.dtype(jnp.uint16): ("JaxbatchPagedDecode", "jaxbatch_paged_decode",
                                     jnp.bfloat16),
             jnp.dtype(jnp.float32): ("JaxbatchPagedDecodeF32", "jaxbatch_paged_decode_f32",
                                      jnp.float32)}
# bf16 pages and a bf16 q: the result rounded to bf16 in the kernel
_BF16_OUT = ("JaxbatchPagedDecodeBf16Out", "jaxbatch_paged_decode_bf16_out")
TARGETS = tuple(target for _, target, _ in _HANDLERS.values()) + (_BF16_OUT[1],)
NO_WINDOW = 2 ** 30
MAX_GROUP, MAX_HEAD_DIM = 16, 512


def unavailable_reason() -> str | None:
    for symbol, target in [h[:2] for h in _HANDLERS.values()] + [_BF16_OUT]:
        reason = availability.unavailable_reason(SOURCE, symbol, target)
        if reason:
            return reason
    return None


def _uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap) -> str | None:
    if jnp.dtype(pool_dtype) not in _HANDLERS:
        return f"{jnp.dtype(pool_dtype).name} pages, neither bf16 bits nor float32"
    return availability.attention_heads_uncovered(num_heads, num_kv_heads, head_dim, soft_cap,
                                                  MAX_GROUP, MAX_HEAD_DIM)


def why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap=None) -> str | None:
    return (_uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
            or unavailable_reason())


def paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos, lengths,
                           *, scale=None, window=None, next_layer_blocks=0):
    uncovered = _uncovered(k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], None)
    if uncovered or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"paged_decode: q [B, H, D] and bf16-bit or float32 pools expected, "
                         f"got {q.dtype} {q.shape}, {k_pages.dtype} {k_pages.shape}, "
                         f"{v_pages.dtype}{f' ({uncovered})' if uncovered else ''}")
    symbol, target, q_dtype = _HANDLERS[jnp.dtype(k_pages.dtype)]
    out_dtype = jnp.float32
    if q_dtype == jnp.bfloat16 and q.dtype == jnp.bfloat16:      # rounded in the kernel
        (symbol, target), out_dtype = _BF16_OUT, jnp.bfloat16
    availability.require(SOURCE, symbol, target, "paged_decode")
    window, scale = availability.attention_operands(q.shape[-1], scale, window, NO_WINDOW)
    out = jax.ShapeDtypeStruct(q.shape, out_dtype)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    # q in the keys' dtype, as the reference multiplies them
    result = jax.ffi.ffi_call(target, out)(
        q.astype(q_dtype), k_pages, v_pages, i32(item_slot), i32(item_pages),
        i32(item_first_pos), i32(lengths), window, scale,
        next_layer_blocks=np.int64(next_layer_blocks))
    return result.astype(q.dtype)
