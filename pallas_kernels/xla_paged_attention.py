"""Plain-jnp paged attention shaped for XLA on CPU: the engine's CPU path.

`reference.py` is the oracle: simple, and every slot (or sequence) there pays for the longest
block table in the batch. Here cost follows the pages each sequence actually uses, so one long
context no longer makes every slot of a decode step read a long context, and several prefill
chunks share one call without each attending over every other chunk's pages. Both functions
are checked against the oracle in tests/worker/test_xla_attention.py.

Decode, a work list. One item is (slot, up to PAGES_PER_ITEM consecutive pages of its table): the
host lists the pages in use by every slot, sorted by slot, padded with items whose slot is out
of range. The device loops over the used items, a block at a time, computing each item's
softmax over its own keys ([items, PAGES_PER_ITEM * bs] scores); a second loop then folds each
row's items together in item order.

Prefill, query tiles. Packed prefill tokens come in tiles of `PREFILL_TILE` tokens, each tile
holding tokens of one chunk only (the host pads every chunk to a multiple of the tile), and each
tile carries its own sequence's block table. A tile attends causally over those pages, a block
of pages at a time, up to the call's last query position.

Masked keys may hold anything (NaN included): masked values are zeroed before p @ V.

Sliding windows (`window`, an int32 scalar, possibly traced; None: none): a query at position
p sees keys p - window < pos <= p. Prefill starts its key loop at the block holding the
call's first key inside any query's window; decode masks the keys of its work items outside
the window (the host lists every page of a table, so the items are still visited).
`soft_cap` (Gemma 2, static): scores become cap * tanh(score / cap) before the mask.

int8 pools (`k_scales, v_scales` given, see `int8.py`): the int8 pages are converted to float32
unscaled, and the scales are applied where they cost least: a key's scale multiplies its score
column after q @ K, a value's scale multiplies its probability column before p @ V (both are
[.., span] instead of [.., span, head_dim]). Scales of masked keys are zeroed like values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# pages_as_float: a bf16 pool on CPU holds bf16 bits as uint16 (reference.py).
from pallas_kernels.reference import (_HIGHEST, BF16_BITS, _soft_cap, keys_in_order,
                                      pages_as_float)

PREFILL_TILE = 16
# Pages per decode work item: scores of one item are a [group, PAGES_PER_ITEM * block_size]
# matmul, and XLA on CPU runs a few of those far faster than many [group, block_size] ones.
PAGES_PER_ITEM = 8


# ---- host-side layout (numpy) -----------------------------------------------------------------

def num_decode_items(kv_lens, block_size: int, pages_per_item: int = PAGES_PER_ITEM) -> int:
    span = block_size * pages_per_item
    return sum(-(-int(n) // span) for n in kv_lens)


def decode_work_items(tables: list[tuple[int, list[int], int]], num_slots: int, block_size: int,
                      bucket: int, pages_per_item: int = PAGES_PER_ITEM):
    """tables: (slot, block table, kv length) per decoding sequence, where a slot is a row of
    the decode call's q (the runner passes row indices 0..n-1). Returns int32 arrays:
    item_slot [bucket] (num_slots for padding), item_pages [bucket, pages_per_item] (0, the
    null block, past a table's end), item_first_pos [bucket] (position of the item's first
    key). Only the pages holding the first kv-length tokens are listed."""
    needed = num_decode_items([kv_len for _, _, kv_len in tables], block_size, pages_per_item)
    if needed > bucket:
        raise ValueError(f"decode work list needs {needed} items; bucket {bucket} is too small")
    item_slot = np.full(bucket, num_slots, np.int32)
    item_pages = np.zeros((bucket, pages_per_item), np.int32)
    item_first_pos = np.zeros(bucket, np.int32)
    j = 0
    for slot, table, kv_len in sorted(tables, key=lambda t: t[0]):
        used = list(table[:-(-kv_len // block_size)])
        for first in range(0, len(used), pages_per_item):
            pages = used[first:first + pages_per_item]
            item_slot[j] = slot
            item_pages[j, :len(pages)] = pages
            item_first_pos[j] = first * block_size
            j += 1
    return item_slot, item_pages, item_first_pos


# ---- device ---------------------------------------------------------------------------------
# Both functions loop at run time over blocks of the work (decode: items, prefill: context
# pages) with an online softmax, for the blocks actually in use: a call's arrays can be sized
# for the longest context its rows may ever have, so one executable serves every context length
# (the runner's buckets are rows or tokens only), and a block's gathered keys and values are
# consumed while they are still in cache (35-40 % less prefill attention time on this CPU than
# gathering the whole context first). The trip count is computed on the device; on a GPU (this
# backend is the fallback where Pallas cannot lower) a while loop reads its condition back each
# iteration (not measured yet: no GPU was lent when this was written); the Pallas kernels have
# no such loop.

# Block sizes are constants, not functions of the call's size: how a row's softmax is split and
# summed must not depend on which rows share its call, or bf16 outputs differ solo and batched.
ITEMS_PER_BLOCK = 8               # decode: 8 items of 8 pages = 1024 keys a loop iteration
PREFILL_BLOCK_KEYS = 128          # prefill: keys a loop iteration, at absolute positions


def prefill_pages_per_block(block_size: int) -> int:
    return max(1, PREFILL_BLOCK_KEYS // block_size)


def _pad_to_multiple(x, multiple: int, axis: int, value):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _online_softmax_update(carry, scores_max, probs_of, combine, per_lane: bool = False):
    """One block of an online softmax. carry = (m, l, acc): running max, sum and unnormalised
    output. `probs_of(new_max)` -> the block's probabilities relative to new_max (0 where
    masked); `combine(probs)` -> (their sum, their output) in carry's shapes. `per_lane`: m
    and l have acc's shape (one copy per lane of D) instead of acc's without its last axis."""
    m, l, acc = carry
    new_m = jnp.maximum(m, scores_max)
    safe_m = jnp.where(jnp.isfinite(new_m), new_m, 0.0)       # nothing seen yet: any shift
    correction = jnp.where(jnp.isfinite(m), jnp.exp(m - safe_m), 0.0)
    block_sum, block_out = combine(probs_of(safe_m))
    return new_m, l * correction + block_sum, \
        acc * (correction if per_lane else correction[..., None]) + block_out


def _normalise(l, acc):
    return acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]


# ---- gathering pages in the layout the dots want ------------------------------------------------
# Pages are gathered as whole rows of the pool seen as [KVH * blocks, block_size * Dh] (a free
# reshape): one contiguous row per (kv head, page), landing directly in [KVH, items, keys, Dh],
# the layout of a dot batched over (kv head, item). Gathering pages[:, idx] from the 4-D pool
# instead gathers [idx, KVH, ...] slabs that XLA:CPU then transposes, element by element.

def _key_dtype(pages):
    """What q.K (and prefill's p.V) is computed in: bf16 x bf16 with float32 accumulation for
    a bf16 pool (its uint16 bits on CPU), float32 for float32 and int8 pools."""
    return jnp.bfloat16 if pages.dtype in (BF16_BITS, jnp.bfloat16) else jnp.float32


def _gather_pages(pool, page_ids):
    """pool [KVH, N, bs, *tail] (pages: tail (Dh,); int8 scales: none), page_ids [A, P] ->
    [KVH, A, P * bs, *tail], one gathered row per (kv head, page)."""
    num_kv_heads, num_blocks, *tail = pool.shape[:2] + pool.shape[3:]
    rows = jnp.arange(num_kv_heads)[:, None] * num_blocks + page_ids.reshape(1, -1)
    flat = pool.reshape(num_kv_heads * num_blocks, -1)                      # free: a bitcast
    return flat[rows].reshape((num_kv_heads, page_ids.shape[0], -1, *tail))


def _batched_dot(a, b, contract_b: int, precision):
    """a [K, A, M, c] . b [K, A, ...] contracting a's last axis with b's `contract_b` axis,
    batched over (K, A) -> [K, A, M, n] float32."""
    return jax.lax.dot_general(a, b, (((3,), (contract_b,)), ((0, 1), (0, 1))),
                               precision=precision, preferred_element_type=jnp.float32)


def _precision(dtype):
    return None if dtype == jnp.bfloat16 else _HIGHEST


def paged_decode_attention_xla(q, k_pages, v_pages, item_slot, item_pages, item_first_pos,
                               lengths, *, scale=None, k_scales=None, v_scales=None,
                               window=None, soft_cap=None):
    """q [B, H, D]; item_slot [J], item_pages [J, PPI], item_first_pos [J] int32 from
    `decode_work_items` (used items first, sorted by row, then padding); lengths [B].
    -> [B, H, D]. Scores are float32 (q.K in bf16 x bf16 -> f32 for a bf16 pool),
    probabilities and p.V float32.

    Two loops, so that a row's result depends on its own items only (batch invariance: which
    rows share a call must not change how a row's softmax is summed):
    1. over the used items, ITEMS_PER_BLOCK at a time: each item's softmax over its own keys,
       relative to its own max -> (max, sum, output) per item;
    2. over item ranks: each row folds in its k-th item's partial result, in item order."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    pages_per_item = item_pages.shape[1]
    span = pages_per_item * block_size
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    per_block = ITEMS_PER_BLOCK
    item_slot = _pad_to_multiple(item_slot, per_block, 0, batch)
    item_pages = _pad_to_multiple(item_pages, per_block, 0, 0)
    item_first_pos = _pad_to_multiple(item_first_pos, per_block, 0, 0)
    num_items = item_slot.shape[0]
    num_blocks = (jnp.sum(item_slot < batch) + per_block - 1) // per_block
    key_dtype = _key_dtype(k_pages)
    qs = jnp.swapaxes(q.reshape(batch, num_kv_heads, group, head_dim), 0, 1)   # [K, B, G, D]
    qs = qs.astype(key_dtype)

    def item_block(b, partials):
        start = b * per_block
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, per_block)
        slots, pages, first_pos = take(item_slot), take(item_pages), take(item_first_pos)
        slot = jnp.minimum(slots, batch - 1)
        key_pos = first_pos[:, None] + jnp.arange(span)[None, :]                 # [I, span]
        key_ok = (slots < batch)[:, None] & (key_pos < lengths[slot][:, None])   # [I, span]
        if window is not None:          # each row's query sits at lengths - 1
            key_ok = key_ok & (key_pos >= (lengths[slot] - window)[:, None])
        mask = key_ok[None, :, None, :]                                          # [1, I, 1, span]
        k = pages_as_float(keys_in_order(_gather_pages(k_pages, pages), k_pages.shape[2]),
                           key_dtype)                                     # [K, I, span, D]
        v = pages_as_float(_gather_pages(v_pages, pages))
        v = jnp.where(key_ok[None, :, :, None], v, 0.0)
        scores = _batched_dot(qs[:, slot], k, 3, _precision(key_dtype)) * scale   # [K, I, G, span]
        if k_scales is not None:
            scores = scores * _scales_of(_gather_pages(k_scales, pages), key_ok)
        scores = _soft_cap(scores, soft_cap)
        scores = jnp.where(mask, scores, -jnp.inf)
        item_max = jnp.max(scores, axis=-1)                                      # [K, I, G]
        shift = jnp.where(jnp.isfinite(item_max), item_max, 0.0)
        probs = jnp.where(mask, jnp.exp(scores - shift[..., None]), 0.0)
        weights = probs
        if v_scales is not None:
            weights = probs * _scales_of(_gather_pages(v_scales, pages), key_ok)
        item_out = _batched_dot(weights, v, 2, _HIGHEST)                         # [K, I, G, D]
        put = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(acc, x, start, axis=1)
        m, l, o = partials
        return put(m, item_max), put(l, jnp.sum(probs, axis=-1)), put(o, item_out)

    # Sized for every item the call can hold, not only those in use: only the items' maxima
    # and sums are [K, items, G] (initialising three [K, items, G, D] arrays in every layer
    # was a visible part of a decode step with a long max_model_len). Items not in use are
    # never read (the fold gives them weight 0 and reads item 0 instead).
    partials = (jnp.full((num_kv_heads, num_items, group), -jnp.inf),
                jnp.zeros((num_kv_heads, num_items, group)),
                jnp.zeros((num_kv_heads, num_items, group, head_dim)))
    item_m, item_l, item_o = jax.lax.fori_loop(0, num_blocks, item_block, partials)

    # Items are sorted by row: row r's are items first[r] .. first[r] + count[r] - 1.
    count = jnp.sum(item_slot[None, :] == jnp.arange(batch)[:, None], axis=1)   # [B]
    first = jnp.cumsum(count) - count
    shape = (num_kv_heads, batch, group, head_dim)

    # The fold's arithmetic is per lane of D ([K, B, G, D], each item's max and sum broadcast
    # over D): on a [K, B, G] array it would be vectorised differently for different B
    # (XLA:CPU contracts a * b + c into one rounding in some loop paths and not in others),
    # and a row's result would then depend on the batch again.
    wide = lambda x: jnp.broadcast_to(x[..., None], shape)                       # [K, B, G, D]

    def fold(rank, carry):
        has = (rank < count)[None, :, None, None]                                # [1, B, 1, 1]
        idx = jnp.where(rank < count, first + rank, 0)
        m_k = jnp.where(has, wide(item_m[:, idx]), -jnp.inf)                     # [K, B, G, D]
        return _online_softmax_update(carry, m_k, lambda new_m: jnp.exp(m_k - new_m),
                                      lambda c: (c * wide(item_l[:, idx]), c * item_o[:, idx]),
                                      per_lane=True)

    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape))
    _, l, acc = jax.lax.fori_loop(0, jnp.max(count), fold, init)
    out = jnp.swapaxes(_normalise(l[..., 0], acc), 0, 1)                          # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def _scales_of(scales, key_ok):
    """Gathered int8 scales [K, A, span] -> [K, A, 1, span], 0 where `key_ok` [A, span] is
    False (a NaN scale in an unused page must not reach arithmetic)."""
    return jnp.where(key_ok[None], scales, 0.0)[:, :, None, :]


def tiled_prefill_attention_xla(q, k_pages, v_pages, query_pos, tile_pages, *, scale=None,
                                k_scales=None, v_scales=None, window=None, soft_cap=None):
    """q [T, H, D] with T = num_tiles * PREFILL_TILE; query_pos [T] (absolute position, -1 for
    padding, which gives zeros); tile_pages [num_tiles, P]: the block table of the sequence
    each tile belongs to. Causal: a query attends to keys at positions <= its own.
    Loops over the call's context in blocks of `prefill_pages_per_block(block_size)` pages,
    up to the largest query position. A (kv head, tile) pair is one dot of its tile * G query
    rows against the block's keys. Scores, softmax and its sums are float32; with a bf16 pool
    both dots are bf16 x bf16 -> f32 (the probabilities rounded to bf16 for p.V, as
    FlashAttention does), faster than a float32 p.V on this CPU; decode's much smaller p.V
    dots (G rows each) were slower in bf16, so decode keeps float32 (docs/BENCHMARKS.md)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_tiles = tile_pages.shape[0]
    tile = num_tokens // num_tiles
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    per_block = prefill_pages_per_block(block_size)
    span = per_block * block_size
    tile_pages = _pad_to_multiple(tile_pages, per_block, 1, 0)
    num_blocks = (jnp.max(query_pos) + span) // span           # 0 when every query is padding
    first_block = 0
    if window is not None:              # no key before the lowest query's window is needed
        lowest = jnp.min(jnp.where(query_pos >= 0, query_pos, jnp.iinfo(jnp.int32).max))
        first_block = jnp.minimum(jnp.maximum(lowest - window + 1, 0) // span, num_blocks)
    pos = query_pos.reshape(num_tiles, tile)
    tile_last = jnp.max(pos, axis=1)
    key_dtype = _key_dtype(k_pages)
    # Rows of a (kv head, tile) dot: its queries times its group's heads, query-major, so the
    # transpose moves whole [G, D] runs (head-major rows made it a strided copy, 10 % of a chunk).
    qt = q.reshape(num_tiles, tile, num_kv_heads, group * head_dim).astype(key_dtype)
    qt = jnp.transpose(qt, (2, 0, 1, 3)).reshape(num_kv_heads, num_tiles, tile * group,
                                                 head_dim)                       # [K, N, tq*G, D]
    row_pos = jnp.repeat(pos, group, axis=1)                                     # [N, tq*G]

    def block(b, carry):
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, b * per_block, per_block, axis=1)
        key_pos = b * span + jnp.arange(span)
        key_used = key_pos[None, :] <= tile_last[:, None]                         # [N, span]
        mask = key_pos[None, None, :] <= row_pos[:, :, None]                      # [N, tq*G, span]
        if window is not None:
            mask = mask & (key_pos[None, None, :] > row_pos[:, :, None] - window)
        mask = mask[None]
        k = pages_as_float(keys_in_order(_gather_pages(k_pages, pages), k_pages.shape[2]),
                           key_dtype)                                     # [K, N, span, D]
        v = pages_as_float(_gather_pages(v_pages, pages), key_dtype)
        v = jnp.where(key_used[None, :, :, None], v, jnp.zeros((), key_dtype))
        scores = _batched_dot(qt, k, 3, _precision(key_dtype)) * scale           # [K, N, tq*G, span]
        if k_scales is not None:
            scores = scores * _scales_of(_gather_pages(k_scales, pages), key_used)
        scores = _soft_cap(scores, soft_cap)
        scores = jnp.where(mask, scores, -jnp.inf)

        def probs_of(new_max):                                                    # [K, N, tq*G]
            return jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)

        def combine(probs):
            weights = probs
            if v_scales is not None:
                weights = probs * _scales_of(_gather_pages(v_scales, pages), key_used)
            return jnp.sum(probs, axis=-1), _batched_dot(weights.astype(key_dtype), v, 2,
                                                         _precision(key_dtype))

        return _online_softmax_update(carry, jnp.max(scores, axis=-1), probs_of, combine)

    shape = (num_kv_heads, num_tiles, tile * group)
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    _, l, acc = jax.lax.fori_loop(first_block, num_blocks, block, init)
    out = _normalise(l, acc).reshape(num_kv_heads, num_tiles, tile, group * head_dim)
    out = jnp.transpose(out, (1, 2, 0, 3))                                        # [N, tq, K, G*D]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
