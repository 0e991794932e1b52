"""Prefill attention over bf16 KV pages on CPU (`paged_prefill.cc`), with the interface of
`pallas_kernels.xla_paged_attention.tiled_prefill_attention_xla`, its reference.

XLA:CPU runs the reference as a loop of gathers, batched dots, masks and exponentials per
block of keys, each op a pass over memory; the kernel walks each tile's keys once per block of
16 rows (tokens x query heads), in place, with an online softmax, up to the block's last
position only.

    unavailable_reason()   None where the kernel runs on this machine, else why not
    why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
                           None where it covers such a call here, else why the jnp path runs
                           (float32 or int8 pages; a soft cap; more than MAX_GROUP query heads
                           per kv head; an odd head_dim or one past MAX_HEAD_DIM)
    paged_prefill_attention(q, k_pages, v_pages, query_pos, tile_pages, *, scale, window)
                           -> [T, H, D] in q's dtype
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import availability

SOURCE = "paged_prefill.cc"
SYMBOL, TARGET = "JaxbatchPagedPrefill", "jaxbatch_paged_prefill"
# a bf16 q: the result rounded to bf16 in the kernel
BF16_OUT_SYMBOL, BF16_OUT_TARGET = "JaxbatchPagedPrefillBf16Out", "jaxbatch_paged_prefill_bf16_out"
TARGETS = (TARGET, BF16_OUT_TARGET)
NO_WINDOW = 2 ** 30
MAX_GROUP, MAX_HEAD_DIM = 16, 512


def unavailable_reason() -> str | None:
    return (availability.unavailable_reason(SOURCE, SYMBOL, TARGET)
            or availability.unavailable_reason(SOURCE, BF16_OUT_SYMBOL, BF16_OUT_TARGET))


def _uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap) -> str | None:
    if jnp.dtype(pool_dtype) != jnp.uint16:
        return f"{jnp.dtype(pool_dtype).name} pages, not bf16 bits"
    return availability.attention_heads_uncovered(num_heads, num_kv_heads, head_dim, soft_cap,
                                                  MAX_GROUP, MAX_HEAD_DIM)


def why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap=None) -> str | None:
    return (_uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
            or unavailable_reason())


def paged_prefill_attention(q, k_pages, v_pages, query_pos, tile_pages, *, scale=None,
                            window=None):
    uncovered = _uncovered(k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], None)
    tiles = tile_pages.shape[0]
    if (uncovered or v_pages.dtype != k_pages.dtype or tiles == 0 or q.shape[0] % tiles
            or query_pos.shape != q.shape[:1]):
        raise ValueError(f"paged_prefill: q [T, H, D], query_pos [T], tile_pages [tiles, P] "
                         f"with T a multiple of tiles and bf16-bit pools expected, got "
                         f"{q.dtype} {q.shape}, {query_pos.shape}, {tile_pages.shape}, "
                         f"{k_pages.dtype} {k_pages.shape}, {v_pages.dtype}"
                         f"{f' ({uncovered})' if uncovered else ''}")
    symbol, target, out_dtype = SYMBOL, TARGET, jnp.float32
    if q.dtype == jnp.bfloat16:
        symbol, target, out_dtype = BF16_OUT_SYMBOL, BF16_OUT_TARGET, jnp.bfloat16
    availability.require(SOURCE, symbol, target, "paged_prefill")
    window, scale = availability.attention_operands(q.shape[-1], scale, window, NO_WINDOW)
    out = jax.ShapeDtypeStruct(q.shape, out_dtype)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    result = jax.ffi.ffi_call(target, out)(
        q.astype(jnp.bfloat16), k_pages, v_pages, i32(query_pos), i32(tile_pages), window,
        scale)
    return result.astype(q.dtype)
