"""Ragged paged attention on GPU (prefill chunks and decode tokens in one call): a Pallas kernel
(Triton backend) and its validating wrapper.

Same contract as `reference.ragged_paged_attention_ref` (the TPU ragged-paged-attention one):
q [T, H, D] packs the query tokens of `num_seqs` sequences, sequence i owning tokens
cu_q_lens[i]:cu_q_lens[i+1]; its chunk's KV is already in the pool, so query token j of a chunk
of length q_len sits at position kv_lens[i] - q_len + j and attends causally up to it.

Grid (num_q_blocks, KVH). A q block is `block_q` consecutive tokens of ONE sequence, so all its
rows share the same pages; its rows are (token, head of the KV group) pairs, block_q x G_pad,
G padded to a power of two. Block b of the grid maps to sequence s with
    first_block(s) = cu_q_lens[s] // block_q + s,
which gives each sequence ceil(q_len / block_q) blocks (plus at most one idle one) and bounds the
grid by T // block_q + S for any split of T tokens; the map is computed in jnp before the call
(Triton has no scalar prefetch). Each program walks the sequence's keys up to its last query
position, `pages_per_compute_block` pages per tile, with an online softmax and a causal mask.

Tokens that no program owns (padding past cu_q_lens[num_seqs]) keep the zeros of the output
buffer, which is passed in and aliased to the output.

Sliding windows (`window`, an int32 scalar, possibly traced): a query at position p sees keys
p - window < pos <= p; each program's key loop starts at its first query's window, so a long
chunk's early keys are never loaded by its late blocks.
int8 pools (`k_scales, v_scales`): int8 tiles and their scales are loaded and applied in the
flash step exactly as in the decode kernel (`paged_decode.py`'s module doc).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.paged_decode import (
    MIN_DOT_DIM, check_int32, check_kv_pool, check_query, check_rank, compiler_params,
    compute_block_pages, dot_precision, flash_finish, flash_init, flash_step, load_kv_tile,
    next_pow2, pltriton)

_TARGET_ROWS = 64       # query rows (tokens x padded group) per program


def _ragged_kernel(block_seq_ref, block_first_ref, cu_ref, kv_lens_ref, pages_ref, q_ref,
                   k_ref, v_ref, *refs, group, group_pad, block_q, block_k,
                   scale, soft_cap, precision, quantized, windowed):
    # A windowed call passes the window [1] first; int8 pools pass (k_scales, v_scales) after
    # the pages; then the zeros input and the output.
    window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    scale_refs = refs[:2] if quantized else None
    o_ref = refs[-1]
    blk, kv_head = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    seq = block_seq_ref[blk]
    first = block_first_ref[blk]                      # first token of this block, within the chunk
    q_start = cu_ref[seq]
    q_len = cu_ref[seq + 1] - q_start
    kv_len = kv_lens_ref[seq]
    ctx_len = jnp.minimum(kv_len, pages_ref.shape[1] * block_size)   # keys that exist

    r = jnp.arange(block_q * group_pad, dtype=jnp.int32)    # row = (token, head in group)
    tok = first + r // group_pad
    g = r % group_pad
    row_ok = (tok < q_len) & (g < group)
    q_pos = kv_len - q_len + tok                             # absolute position of each query
    d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    qo_idx = ((q_start + tok)[:, None], (kv_head * group + g)[:, None], d)
    q = pltriton.load(q_ref.at[qo_idx], mask=row_ok[:, None], other=0)      # [rows, D]

    # Keys up to the block's last query position; none for an idle block.
    rows_here = jnp.clip(q_len - first, 0, block_q)
    end_key = jnp.where(rows_here > 0,
                        jnp.minimum(ctx_len, kv_len - q_len + first + rows_here), 0)
    start_key = 0
    if windowed:                        # the block's first query sees no key before this
        start_key = jnp.maximum(kv_len - q_len + first - window_ref[0] + 1, 0)
    num_tiles = (jnp.maximum(end_key - start_key, 0) + block_k - 1) // block_k

    def body(i, carry):
        k, v, k_pos, k_ok, kv_scales = load_kv_tile(k_ref, v_ref, pages_ref, seq, kv_head,
                                                    start_key + i * block_k, end_key, block_k,
                                                    scale_refs)
        mask = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        if windowed:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - window_ref[0])
        return flash_step(carry, q, k, v, mask, scale=scale, soft_cap=soft_cap,
                          precision=precision, kv_scales=kv_scales)

    acc, _, l = jax.lax.fori_loop(0, num_tiles, body, flash_init(block_q * group_pad, head_dim))
    pltriton.store(o_ref.at[qo_idx], flash_finish(acc, l).astype(o_ref.dtype),
                   mask=row_ok[:, None])


def _block_map(cu_q_lens, num_seqs, block_q, num_blocks):
    """Sequence and first in-chunk token of every grid block, plus cu_q_lens with the entries
    past num_seqs flattened (those sequences then own no tokens, whatever the padding held)."""
    max_seqs = cu_q_lens.shape[0] - 1
    cu = jnp.where(jnp.arange(max_seqs + 1) <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])
    first_block = cu[:-1] // block_q + jnp.arange(max_seqs, dtype=jnp.int32)    # [S], increasing
    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_block, blocks, side="right") - 1, 0, max_seqs - 1)
    first = (blocks - first_block[seq]) * block_q
    return seq.astype(jnp.int32), first.astype(jnp.int32), cu


def ragged_launch_config(num_tokens, max_seqs, group, pages_per_seq, block_size, block_q=None,
                         pages_per_compute_block=None):
    """(tokens per q block, padded group, pages per KV tile, number of q blocks)."""
    group_pad = next_pow2(group)
    if block_q is None:
        block_q = max(1, _TARGET_ROWS // group_pad)
    elif block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    if block_q * group_pad < MIN_DOT_DIM:
        raise ValueError(f"block_q={block_q} x padded group {group_pad} gives fewer than "
                         f"{MIN_DOT_DIM} rows, Triton's minimum")
    pages_per_block = compute_block_pages(pages_per_compute_block, block_size, pages_per_seq,
                                          target_tokens=64)
    return block_q, group_pad, pages_per_block, num_tokens // block_q + max_seqs


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "block_q", "pages_per_compute_block", "num_warps", "num_stages",
    "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           scale=None, soft_cap=None, block_q=None, pages_per_compute_block=None,
                           num_warps=4, num_stages=2, interpret=False, k_scales=None,
                           v_scales=None, window=None):
    """q [T, H, D]; k/v_pages [KVH, N, bs, D]; kv_lens [S] int32; page_indices [S, P] int32;
    cu_q_lens [S + 1] int32; num_seqs int32 scalar or [1]; for an int8 pool, k/v_scales
    [KVH, N, bs] float32; `window` None or an int32 scalar. Returns [T, H, D] in q's dtype, zeros for padding tokens."""
    check_kv_pool(k_pages, v_pages, k_scales=k_scales, v_scales=v_scales)
    check_query(q, k_pages)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_rank("page_indices", page_indices, 2)
    max_seqs, pages_per_seq = page_indices.shape
    check_int32("page_indices", page_indices, (max_seqs, pages_per_seq))
    check_int32("kv_lens", kv_lens, (max_seqs,))
    check_int32("cu_q_lens", cu_q_lens, (max_seqs + 1,))
    if jnp.shape(num_seqs) not in ((), (1,)) or jnp.result_type(num_seqs) != jnp.int32:
        raise ValueError(f"num_seqs must be an int32 scalar or [1], got shape "
                         f"{jnp.shape(num_seqs)} dtype {jnp.result_type(num_seqs)}")
    if max_seqs == 0 or pages_per_seq == 0:
        raise ValueError("page_indices must have at least one sequence and one page")

    group = num_heads // num_kv_heads
    block_q, group_pad, pages_per_block, num_blocks = ragged_launch_config(
        num_tokens, max_seqs, group, pages_per_seq, block_size, block_q, pages_per_compute_block)
    block_seq, block_first, cu = _block_map(
        cu_q_lens, jnp.asarray(num_seqs, jnp.int32).reshape(()), block_q, num_blocks)
    kernel = functools.partial(
        _ragged_kernel, group=group, group_pad=group_pad, block_q=block_q,
        block_k=pages_per_block * block_size,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap), precision=dot_precision(q.dtype),
        quantized=k_scales is not None, windowed=window is not None)
    zeros = jnp.zeros_like(q)
    window_args = () if window is None else (jnp.asarray(window, jnp.int32).reshape(1),)
    inputs = (block_seq, block_first, cu, kv_lens, page_indices, q, k_pages, v_pages,
              *window_args, *(() if k_scales is None else (k_scales, v_scales)), zeros)
    return pl.pallas_call(
        kernel, grid=(num_blocks, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        # The output starts as `zeros` (the last input): padding tokens stay 0.
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="jaxbatch_ragged_paged_attention",
    )(*inputs)
