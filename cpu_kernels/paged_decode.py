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
    `amx` (bf16 pages):    q.K and p.V met by the CPU's AMX tiles (`tdpbf16ps`, decode_amx.h)
                           instead of AVX512-BF16; `amx_why_not(...)` says where they cannot
                           run. The softmax between them is the same; a row's sums are taken
                           in a fixed order either way (batch invariance holds for each), the
                           two agree to float32 rounding.
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
_AMX_HANDLERS = (_HANDLERS[jnp.dtype(jnp.uint16)][:2], _BF16_OUT)
TARGETS += tuple(availability.amx_variant(*handler)[1] for handler in _AMX_HANDLERS)
NO_WINDOW = 2 ** 30
MAX_GROUP, MAX_HEAD_DIM = 16, 512
AMX_KEYS, AMX_DIMS = 16, 32      # the AMX variant: pages of a multiple of 16 keys, dims of 32
# Query heads per kv head from which the tiles beat AVX512 (docs/BENCHMARKS.md, decode attention
# alone): the AVX512 loop's arithmetic grows with the group and bounds it from about 8 heads; in
# smaller groups the KV read bounds both, and the tiles' round trips through L1 cost more.
AMX_FASTER_FROM_GROUP = 8


def unavailable_reason() -> str | None:
    for symbol, target in [h[:2] for h in _HANDLERS.values()] + [_BF16_OUT]:
        reason = availability.unavailable_reason(SOURCE, symbol, target)
        if reason:
            return reason
    amx_why_not()           # registers the AMX variants where they run (a stored step may call one)
    return None


def amx_why_not(pool_dtype=jnp.uint16, block_size=AMX_KEYS, head_dim=AMX_DIMS) -> str | None:
    """None where the AMX variant runs here for such pages, else why not."""
    if jnp.dtype(pool_dtype) != jnp.uint16:
        return f"{jnp.dtype(pool_dtype).name} pages (AMX tiles take bf16)"
    if block_size % AMX_KEYS or head_dim % AMX_DIMS:
        return (f"pages of {block_size} keys and a head dim of {head_dim} (the tiles take "
                f"multiples of {AMX_KEYS} and {AMX_DIMS})")
    return availability.amx_variants_why_not(SOURCE, _AMX_HANDLERS)


def _uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap) -> str | None:
    if jnp.dtype(pool_dtype) not in _HANDLERS:
        return f"{jnp.dtype(pool_dtype).name} pages, neither bf16 bits nor float32"
    return availability.attention_heads_uncovered(num_heads, num_kv_heads, head_dim, soft_cap,
                                                  MAX_GROUP, MAX_HEAD_DIM)


def why_not(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap=None) -> str | None:
    return (_uncovered(pool_dtype, num_heads, num_kv_heads, head_dim, soft_cap)
            or unavailable_reason())


def paged_decode_attention(q, k_pages, v_pages, item_slot, item_pages, item_first_pos, lengths,
                           *, scale=None, window=None, next_layer_blocks=0, amx=False):
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
    if amx:
        reason = amx_why_not(k_pages.dtype, k_pages.shape[2], q.shape[2])
        if reason:
            raise ValueError(f"paged_decode's AMX variant cannot run here: {reason}")
        symbol, target = availability.amx_variant(symbol, target)
    window, scale = availability.attention_operands(q.shape[-1], scale, window, NO_WINDOW)
    out = jax.ShapeDtypeStruct(q.shape, out_dtype)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    # q in the keys' dtype, as the reference multiplies them
    result = jax.ffi.ffi_call(target, out)(
        q.astype(q_dtype), k_pages, v_pages, i32(item_slot), i32(item_pages),
        i32(item_first_pos), i32(lengths), window, scale,
        next_layer_blocks=np.int64(next_layer_blocks))
    return result.astype(q.dtype)
