"""Plain-jnp paged attention: the oracle for every Pallas kernel and the CPU path of the engine.

Shared layout (the same as JAX's shipped `pallas.ops.gpu.paged_attention`):

    k_pages, v_pages : [num_kv_heads, num_blocks, block_size, head_dim]   one layer of the pool
    block 0          : the null block; unused block-table entries and padded tokens point at it

except that a bf16-bits (uint16) pool keeps each page's keys in groups (`key_group`), each
stored dim-pair-major; `keys_in_order` undoes that for whatever gathers them.

Masked positions may hold anything (NaN included): every masked score *and* value is replaced
before it meets arithmetic, because 0 * NaN is NaN.

int8 pools (`pallas_kernels/int8.py`) pass `k_scales, v_scales` [KVH, num_blocks, block_size]:
the oracle simply dequantizes the pages it gathers to float32 and proceeds as for a float pool.

`window` (an int32 scalar, possibly traced; None: no window): a query at position p attends to
keys at positions p - window < pos <= p, Hugging Face's sliding-window mask.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST

# A bf16 pool on CPU is stored as its bit patterns (issue 27): XLA:CPU has no bf16 scatter or
# gather and converts their whole operand (the pool, every layer) to float32 around each one.
# Integer ones are native. The policy lives in jaxbatch/model/precision.py (kv_pool_dtype).
BF16_BITS = jnp.uint16

# A uint16 pool's keys, page by page in groups of key_group(block_size) keys, each group stored
# dim-pair-major: [D/2][group][2], key i's dims (2p, 2p + 1) at (p * group + i) * 2 of the
# group. One vector load then holds one dim pair of 16 keys, so CPU decode's q.K is dots
# against a broadcast pair of q with one key per lane, and no per-key horizontal sums
# (cpu_kernels/paged_decode.cc). Values, and every other pool, stay [bs][D].
KEY_GROUP = 16


def key_group(block_size: int) -> int:
    if block_size > KEY_GROUP and block_size % KEY_GROUP:
        raise ValueError(f"a bf16-bits pool's pages hold up to {KEY_GROUP} keys or a multiple "
                         f"of {KEY_GROUP} (its keys are stored in groups), got {block_size}")
    return min(KEY_GROUP, block_size)


def keys_grouped(pages) -> bool:
    """Whether keys in `pages` (a pool or pages gathered from one) are stored in groups."""
    return pages.dtype == BF16_BITS and pages.shape[-1] % 2 == 0


def keys_in_order(pages, block_size: int):
    """Keys [..., S, D] gathered from a pool of `block_size`-token pages (S a multiple of it),
    as stored -> in key order."""
    return _swap_in_groups(pages, block_size, stored=True)


def keys_as_stored(pages, block_size: int):
    """keys_in_order's inverse: keys [..., S, D] in key order -> as a uint16 pool stores them."""
    return _swap_in_groups(pages, block_size, stored=False)


def _swap_in_groups(pages, block_size: int, stored: bool):
    """Each group of keys seen as [D/2][group][2] (`stored`) or [group][D/2][2], its two outer
    axes swapped."""
    if not keys_grouped(pages):
        return pages
    group, (*lead, keys, dim) = key_group(block_size), pages.shape
    outer = (dim // 2, group) if stored else (group, dim // 2)
    grouped = pages.reshape(*lead, keys // group, *outer, 2)
    return jnp.swapaxes(grouped, -3, -2).reshape(*lead, keys, dim)


def to_pool_dtype(x, pages_dtype):
    """Values -> what a pool of `pages_dtype` stores (bf16's bits for a uint16 pool)."""
    if pages_dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(pages_dtype)


def pages_as_float(pages, dtype=jnp.float32):
    """Gathered pages -> `dtype` (a uint16 pool holds bf16 bits)."""
    if pages.dtype == BF16_BITS:
        pages = jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return pages.astype(dtype)


def write_kv_ref(k_pages, v_pages, k, v, slot_mapping):
    """Scatters one step's keys/values into the pool.

    k, v: [T, num_kv_heads, head_dim]; slot_mapping: [T] int32 = block * block_size + offset.
    Padded tokens carry a slot inside block 0, where writes are harmless.
    """
    block_size = k_pages.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indices (blocks, offsets) are adjacent, so the indexed view is [KVH, T, D].
    if keys_grouped(k_pages):
        k_pages = _write_grouped_keys(k_pages, k, blocks, offsets)
    else:
        k_pages = k_pages.at[:, blocks, offsets].set(
            to_pool_dtype(jnp.swapaxes(k, 0, 1), k_pages.dtype))
    v_pages = v_pages.at[:, blocks, offsets].set(
        to_pool_dtype(jnp.swapaxes(v, 0, 1), v_pages.dtype))
    return k_pages, v_pages


def _write_grouped_keys(k_pages, k, blocks, offsets):
    """write_kv_ref's keys into a pool that stores them in groups (see KEY_GROUP)."""
    heads, num_blocks, block_size, dim = k_pages.shape
    group = key_group(block_size)
    grouped = k_pages.reshape(heads, num_blocks, block_size // group, dim // 2, group, 2)
    # Advanced indices split by a slice: the indexed view is [T, KVH, D / 2, 2].
    pairs = to_pool_dtype(k, k_pages.dtype).reshape(k.shape[0], heads, dim // 2, 2)
    grouped = grouped.at[:, blocks, offsets // group, :, offsets % group].set(pairs)
    return grouped.reshape(k_pages.shape)


def _gather(pages, scales, index, keys=False):
    """pages[:, index] as float32, dequantized with its scales when the pool is int8; `keys`:
    the pages hold keys (in key order whatever the pool's layout)."""
    if scales is None:
        gathered = pages[:, index]
        return pages_as_float(keys_in_order(gathered, pages.shape[2]) if keys else gathered)
    return pages[:, index].astype(jnp.float32) * scales[:, index][..., None]


def _soft_cap(scores, soft_cap):
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _masked_softmax(scores, mask):
    """scores, mask: [..., T] -> (unnormalised probs [..., T], denominator [..., 1]). Rows with
    no valid key get all-zero probs and a tiny denominator, so they come out as zeros."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    return probs, jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)


def paged_decode_attention_ref(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                               soft_cap=None, k_scales=None, v_scales=None, window=None):
    """One query token per sequence attending to its first `lengths[b]` cached tokens.

    q: [B, H, D]; block_tables: [B, P] int32; lengths: [B] int32 (0 = empty slot -> zeros).
    Returns [B, H, D] in q's dtype. Only the P pages named by the block table are read.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    context = pages_per_seq * block_size

    k = _gather(k_pages, k_scales, block_tables, keys=True).reshape(num_kv_heads, batch, context,
                                                                     head_dim)
    v = _gather(v_pages, v_scales, block_tables).reshape(num_kv_heads, batch, context, head_dim)
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    mask = jnp.arange(context)[None, :] < lengths[:, None]                    # [B, ctx]
    if window is not None:              # the query sits at lengths - 1
        mask = mask & (jnp.arange(context)[None, :] >= lengths[:, None] - window)
    v = jnp.where(mask[None, :, :, None], v, 0.0)

    scores = jnp.einsum("bkgd,kbtd->bkgt", qg, k, precision=_HIGHEST) * scale
    scores = _soft_cap(scores, soft_cap)
    probs, denom = _masked_softmax(scores, mask[:, None, None, :])
    out = jnp.einsum("bkgt,kbtd->bkgd", probs, v, precision=_HIGHEST) / denom
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def ragged_query_layout(cu_q_lens, kv_lens, num_seqs, num_tokens):
    """For each of `num_tokens` packed query tokens: its sequence, absolute position, validity.

    Sequence i owns tokens cu_q_lens[i]:cu_q_lens[i+1]; its last query token sits at position
    kv_lens[i] - 1 (the chunk's KV is already in the pool).
    """
    num_seqs = jnp.asarray(num_seqs).reshape(())
    max_seqs = kv_lens.shape[0]
    token = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_q_lens[1:], token, side="right")
    valid = (token < cu_q_lens[num_seqs]) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, max_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    return seq, position, valid


def ragged_paged_attention_ref(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, scale=None, soft_cap=None, k_scales=None, v_scales=None,
                               window=None):
    """Packed queries of several sequences (prefill chunks and decode tokens mixed), causal
    within each sequence, over each sequence's pages.

    q: [T, H, D] (T padded to a bucket); kv_lens: [S]; page_indices: [S, P]; cu_q_lens: [S + 1];
    num_seqs: scalar or [1]. Tokens past cu_q_lens[num_seqs] are padding and give zeros.
    Cost is T x S x P x block_size scores: fine as an oracle and for one long chunk (S = 1).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    context = pages_per_seq * block_size

    seq, position, valid = ragged_query_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    # Keys of all sequences side by side: [KVH, S * ctx, D].
    flat = page_indices.reshape(-1)
    k = _gather(k_pages, k_scales, flat, keys=True).reshape(num_kv_heads, max_seqs * context,
                                                             head_dim)
    v = _gather(v_pages, v_scales, flat).reshape(num_kv_heads, max_seqs * context, head_dim)
    key_seq = jnp.repeat(jnp.arange(max_seqs), context)
    key_pos = jnp.tile(jnp.arange(context), max_seqs)
    # Sequences past num_seqs are padding: their pages may hold anything (NaN included).
    key_valid = (key_pos < kv_lens[key_seq]) & (key_seq < jnp.asarray(num_seqs).reshape(()))
    mask = ((key_seq[None, :] == seq[:, None]) & (key_pos[None, :] <= position[:, None])
            & key_valid[None, :] & valid[:, None])                             # [T, S*ctx]
    if window is not None:
        mask = mask & (key_pos[None, :] > position[:, None] - window)
    v = jnp.where(key_valid[None, :, None], v, 0.0)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("tkgd,ksd->tkgs", qg, k, precision=_HIGHEST) * scale
    scores = _soft_cap(scores, soft_cap)
    probs, denom = _masked_softmax(scores, mask[:, None, None, :])
    out = jnp.einsum("tkgs,ksd->tkgd", probs, v, precision=_HIGHEST) / denom
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
