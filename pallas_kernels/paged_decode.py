"""Paged decode attention on GPU: a Pallas kernel (Triton backend) and its validating wrapper.

Same contract as `reference.paged_decode_attention_ref`: one query token per slot attends to the
first `lengths[b]` tokens of its pages. Pool layout [KVH, num_blocks, block_size, D].

Grid (B, KVH, num_splits). One program owns every query head that shares one KV head (GQA: the
KV tile is read once for the whole group), padded to >= 16 rows because Triton's dot needs
M >= 16. It walks its split of the block table `pages_per_compute_block` pages at a time with an
online softmax; with several splits the per-split (out, max, sum) are merged by a flash-style
combine in plain jnp. Work stops at the slot's length, so cost follows the pages in use.

Gathers are Triton masked loads: positions past the length (and page-table entries past the
table) are never read, and come back as 0, so NaN in unused or partly used pages cannot reach
the p @ V product, where 0 * NaN would be NaN.

int8 pools (`k_scales, v_scales` given, layout in `int8.py`): the kernel loads int8 tiles and
their [block_k] scales, converts the tiles to the query's dtype unscaled (exact: |value| <= 127),
and applies the scales to the [rows, block_k] scores and probabilities, not to the
[block_k, D] tiles: a key's scale multiplies its score column after q @ K^T, a value's scale
multiplies its probability column before p @ V.

Sliding windows (`window`, an int32 scalar, possibly traced): the query at position length - 1
sees keys from length - window on; each split's key loop starts there (a split wholly before
the window runs no tile), so cost follows the window, not the context. Without a window the
kernel takes no window input and is unchanged.

This module also holds the validation and the flash step shared with the ragged kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.int8 import check_scales

try:  # The Triton backend is deprecated from jax 0.11 and will be removed (see DESIGN.md).
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIN_DOT_DIM = 16          # Triton's tl.dot needs every dimension >= 16
# Enough programs to fill an H200 (132 SMs) several times over when splitting long contexts.
_TARGET_PROGRAMS = 1024


# ---------------------------------------------------------------------------------------------
# Validation shared by the wrappers: shapes are static, so these run once at trace time.

def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_rank(name, x, rank):
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {jnp.shape(x)}")


def check_int32(name, x, shape):
    if jnp.shape(x) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {jnp.shape(x)}")
    if jnp.result_type(x) != jnp.int32:
        raise ValueError(f"{name} must be int32, got {jnp.result_type(x)}")


def check_kv_pool(k_pages, v_pages, *, require_pow2=True, k_scales=None, v_scales=None):
    """k_pages, v_pages: [KVH, num_blocks, block_size, head_dim], same shape and dtype; float32
    or bfloat16, or int8 with both k_scales and v_scales [KVH, num_blocks, block_size] float32."""
    check_rank("k_pages", k_pages, 4)
    check_rank("v_pages", v_pages, 4)
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ in dtype")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("an int8 pool needs both k_scales and v_scales")
    if k_scales is not None:
        check_scales(k_pages, k_scales, "k")
        check_scales(v_pages, v_scales, "v")
    elif k_pages.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"KV dtype must be float32 or bfloat16 (or int8 with scales), got "
                         f"{k_pages.dtype}")
    _, _, block_size, head_dim = k_pages.shape
    if require_pow2:  # Triton blocks must be powers of two
        if not _is_pow2(block_size):
            raise ValueError(f"page size must be a power of two, got {block_size}")
        if not _is_pow2(head_dim) or head_dim < MIN_DOT_DIM:
            raise ValueError(f"head_dim must be a power of two >= {MIN_DOT_DIM}, got {head_dim}")


def check_query(q, k_pages):
    """q: [tokens, H, D] with H a multiple of KVH and the pool's head_dim and dtype."""
    check_rank("q", q, 3)
    num_kv_heads, _, _, head_dim = k_pages.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != KV head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_pages.dtype == jnp.int8:      # int8 pool: q sets the compute dtype
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    elif q.dtype != k_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} != KV dtype {k_pages.dtype}")


def compute_block_pages(pages_per_compute_block, block_size, pages_per_seq, target_tokens):
    """Pages per KV tile: a power of two giving >= 16 keys, no larger than the table needs."""
    if pages_per_compute_block is None:
        pages = max(1, target_tokens // block_size)
        pages = min(pages, next_pow2(pages_per_seq))
        return max(pages, -(-MIN_DOT_DIM // block_size))
    if not _is_pow2(pages_per_compute_block):
        raise ValueError(f"pages_per_compute_block must be a power of two, got "
                         f"{pages_per_compute_block}")
    if pages_per_compute_block * block_size < MIN_DOT_DIM:
        raise ValueError(f"a KV tile of {pages_per_compute_block} pages x {block_size} tokens is "
                         f"below Triton's minimum of {MIN_DOT_DIM} keys")
    return pages_per_compute_block


def compiler_params(num_warps, num_stages):
    if pltriton is None:
        raise NotImplementedError("this jax has no Pallas Triton backend "
                                  "(jax.experimental.pallas.triton)")
    # Passing Triton params is what selects the Triton backend (plain pallas_call -> Mosaic GPU).
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------
# Kernel pieces shared with the ragged kernel.

def dot_precision(dtype):
    # float32 must not silently drop to TF32 (the default on GPU): HIGHEST gives IEEE fp32.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def flash_step(carry, q, k, v, mask, *, scale, soft_cap, precision, kv_scales=None):
    """One online-softmax step over a tile of keys.

    q [R, D]; k, v [K, D] (masked keys already loaded as 0); mask broadcastable to [R, K];
    carry = (acc [R, D] f32 unnormalised, m [R] running max, l [R] running sum).
    kv_scales: None, or (k_scale [K], v_scale [K]) f32 for int8 k, v (masked keys' scales 0).
    """
    acc, m_prev, l_prev = carry
    if kv_scales is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)      # int8 -> q's dtype is exact
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale       # [R, K]
    if kv_scales is not None:
        s = s * kv_scales[0][None, :]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    # A row that has seen no valid key yet keeps m = -inf; subtract 0 then so exp() stays NaN-free.
    m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_sub)
    p = jnp.exp(s - m_sub[:, None])
    l_new = alpha * l_prev + p.sum(axis=1)
    if kv_scales is not None:
        p = p * kv_scales[1][None, :]                 # the denominator keeps unscaled p
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)               # [R, D]
    return alpha[:, None] * acc + pv, m_new, l_new


def flash_init(rows, head_dim):
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def flash_finish(acc, l):
    """Normalised output; rows that saw no key (l == 0, acc == 0) give zeros."""
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def load_kv_tile(k_ref, v_ref, table_ref, seq, kv_head, first_key, num_keys, block_k,
                 scale_refs=None):
    """Gathers keys first_key .. first_key + block_k of sequence `seq` through its page table.

    Keys at or past `num_keys` are not read (masked load) and come back as 0.
    Returns k, v [block_k, D], the key positions [block_k], their validity [block_k], and
    with `scale_refs` = (k_scales_ref, v_scales_ref) of an int8 pool, their scales
    ([block_k] each, 0 where not read), else None.
    """
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    pos = first_key + jnp.arange(block_k, dtype=jnp.int32)
    valid = pos < num_keys
    page = pltriton.load(table_ref.at[seq, pos // block_size], mask=valid, other=0)   # [K]
    idx = (kv_head, page[:, None], (pos % block_size)[:, None],
           jnp.arange(head_dim, dtype=jnp.int32)[None, :])
    k = pltriton.load(k_ref.at[idx], mask=valid[:, None], other=0)                   # [K, D]
    v = pltriton.load(v_ref.at[idx], mask=valid[:, None], other=0)
    scales = None
    if scale_refs is not None:
        sidx = (kv_head, page, pos % block_size)
        scales = tuple(pltriton.load(r.at[sidx], mask=valid, other=0.0) for r in scale_refs)
    return k, v, pos, valid, scales


# ---------------------------------------------------------------------------------------------
# Decode kernel.

def _decode_kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, *refs, group, rows,
                   pages_per_block, pages_per_split, scale, soft_cap, precision, quantized,
                   windowed):
    # A windowed call passes the window [1] first; int8 pools pass (k_scales, v_scales)
    # after the pages; then come the outputs.
    window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    scale_refs, out_refs = (refs[:2], refs[2:]) if quantized else (None, refs)
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    block_k = pages_per_block * block_size
    # Keys past the table do not exist (the reference reads exactly P pages).
    length = jnp.minimum(lengths_ref[b], tables_ref.shape[1] * block_size)

    g = jnp.arange(rows, dtype=jnp.int32)                 # query rows = heads of this KV group
    row_ok = g < group
    q_idx = (b, (kv_head * group + g)[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :])
    q = pltriton.load(q_ref.at[q_idx], mask=row_ok[:, None], other=0)        # [rows, D]

    split_key = split * pages_per_split * block_size
    end_key = jnp.minimum(length, split_key + pages_per_split * block_size)
    first_key = split_key
    if windowed:                        # keys before length - window are outside the window
        first_key = jnp.maximum(split_key, length - window_ref[0])
    num_tiles = (jnp.maximum(end_key - first_key, 0) + block_k - 1) // block_k

    def body(i, carry):
        k, v, _, valid, kv_scales = load_kv_tile(k_ref, v_ref, tables_ref, b, kv_head,
                                                 first_key + i * block_k, end_key, block_k,
                                                 scale_refs)
        return flash_step(carry, q, k, v, valid[None, :], scale=scale, soft_cap=soft_cap,
                          precision=precision, kv_scales=kv_scales)

    acc, m, l = jax.lax.fori_loop(0, num_tiles, body, flash_init(rows, head_dim))
    out = flash_finish(acc, l)
    if len(out_refs) == 1:          # single split: write the final answer straight to [B, H, D]
        (o_ref,) = out_refs
        pltriton.store(o_ref.at[q_idx], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:                           # partials [B, KVH, S, rows, (D)] for the combine
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[b, kv_head, split], out)
        pltriton.store(m_ref.at[b, kv_head, split], m)
        pltriton.store(l_ref.at[b, kv_head, split], l)


def _combine_splits(out, m, l):
    """out [B, KVH, S, R, D] normalised per split; m, l [B, KVH, S, R] -> [B, KVH, R, D] f32."""
    m_all = m.max(axis=2, keepdims=True)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)      # every split empty: weights 0
    w = l * jnp.exp(m - m_all)                               # empty split: l = 0, exp(-inf) = 0
    denom = w.sum(axis=2)
    num = jnp.einsum("bksr,bksrd->bkrd", w, out, precision=jax.lax.Precision.HIGHEST)
    return num / jnp.where(denom > 0, denom, 1.0)[..., None]


def decode_launch_config(batch, num_kv_heads, pages_per_seq, block_size,
                         pages_per_compute_block=None, num_splits=None):
    """(pages per tile, number of splits, pages per split) used for a given shape."""
    pages_per_block = compute_block_pages(pages_per_compute_block, block_size, pages_per_seq,
                                          target_tokens=64)
    num_blocks = -(-pages_per_seq // pages_per_block)
    if num_splits is None:
        num_splits = -(-_TARGET_PROGRAMS // (batch * num_kv_heads))
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = -(-num_blocks // num_splits)
    num_splits = -(-num_blocks // blocks_per_split)        # no split may start past the table
    return pages_per_block, num_splits, blocks_per_split * pages_per_block


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "pages_per_compute_block", "num_splits", "num_warps", "num_stages",
    "interpret"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                           soft_cap=None, pages_per_compute_block=None, num_splits=None,
                           num_warps=4, num_stages=2, interpret=False, k_scales=None,
                           v_scales=None, window=None):
    """q [B, H, D]; k/v_pages [KVH, N, bs, D]; block_tables [B, P] int32; lengths [B] int32;
    for an int8 pool, k/v_scales [KVH, N, bs] float32; `window` None or an int32 scalar.

    Returns [B, H, D] in q's dtype (zeros for length-0 slots). `num_splits` (default: enough
    programs to fill the GPU) splits each slot's pages over several programs.
    """
    check_kv_pool(k_pages, v_pages, k_scales=k_scales, v_scales=v_scales)
    check_query(q, k_pages)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_rank("block_tables", block_tables, 2)
    check_int32("block_tables", block_tables, (batch, block_tables.shape[1]))
    check_int32("lengths", lengths, (batch,))
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have at least one page per slot")

    group = num_heads // num_kv_heads
    rows = max(MIN_DOT_DIM, next_pow2(group))               # Triton dot: M >= 16, power of two
    pages_per_block, splits, pages_per_split = decode_launch_config(
        batch, num_kv_heads, block_tables.shape[1], block_size, pages_per_compute_block,
        num_splits)
    kernel = functools.partial(
        _decode_kernel, group=group, rows=rows, pages_per_block=pages_per_block,
        pages_per_split=pages_per_split, scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap), precision=dot_precision(q.dtype),
        quantized=k_scales is not None, windowed=window is not None)
    scale_args = () if k_scales is None else (k_scales, v_scales)
    window_args = () if window is None else (jnp.asarray(window, jnp.int32).reshape(1),)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch, num_heads, head_dim), q.dtype)
    else:
        part = (batch, num_kv_heads, splits, rows)
        out_shape = (jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32))
    result = pl.pallas_call(
        kernel, grid=(batch, num_kv_heads, splits), out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="jaxbatch_paged_decode",
    )(lengths, block_tables, q, k_pages, v_pages, *window_args, *scale_args)
    if splits == 1:
        return result
    out = _combine_splits(*result)[:, :, :group]                # [B, KVH, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
