"""Plain-jnp paged attention shaped for XLA on CPU: the engine's CPU path.

`reference.py` is the oracle: simple, and every slot (or sequence) there pays for the longest
block table in the batch. Here cost follows the pages each sequence actually uses, so one long
context no longer makes every slot of a decode step read a long context, and several prefill
chunks share one call without each attending over every other chunk's pages. Both functions
are checked against the oracle in tests/test_kernels.py.

Decode, a work list. One item is (slot, up to PAGES_PER_ITEM consecutive pages of its table): the
host lists the pages in use by every slot, sorted by slot, padded to a bucket with items whose
slot is out of range. Scores are [items, PAGES_PER_ITEM * bs]; the per-slot softmax is assembled with a one-hot [slots, items] matmul, which XLA
on CPU runs far faster than a scatter.

Prefill, query tiles. Packed prefill tokens come in tiles of `PREFILL_TILE` tokens, each tile
holding tokens of one chunk only (the host pads every chunk to a multiple of the tile), and each
tile carries its own sequence's block table. A tile attends causally over those pages.

Masked keys may hold anything (NaN included): masked values are zeroed before p @ V.

int8 pools (`k_scales, v_scales` given, see `int8.py`): the int8 pages are converted to float32
unscaled, and the scales are applied where they cost least: a key's scale multiplies its score
column after q @ K, a value's scale multiplies its probability column before p @ V (both are
[.., span] instead of [.., span, head_dim]). Scales of masked keys are zeroed like values.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import _HIGHEST

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

def paged_decode_attention_xla(q, k_pages, v_pages, item_slot, item_pages, item_first_pos,
                               lengths, *, scale=None, k_scales=None, v_scales=None):
    """q [B, H, D]; item_slot [J], item_pages [J, PPI], item_first_pos [J] int32 from
    `decode_work_items`; lengths [B]. -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_items, pages_per_item = item_pages.shape
    span = pages_per_item * block_size
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale

    item_valid = item_slot < batch
    slot = jnp.minimum(item_slot, batch - 1)
    key_pos = item_first_pos[:, None] + jnp.arange(span)[None, :]              # [J, span]
    key_ok = item_valid[:, None] & (key_pos < lengths[slot][:, None])          # [J, span]
    k = k_pages[:, item_pages].reshape(num_kv_heads, num_items, span, head_dim)
    v = v_pages[:, item_pages].reshape(num_kv_heads, num_items, span, head_dim)
    k = k.astype(jnp.float32)
    v = jnp.where(key_ok[None, :, :, None], v.astype(jnp.float32), 0.0)
    qi = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)[slot]  # [J, K, G, D]

    scores = jnp.einsum("jkgd,kjtd->jkgt", qi, k, precision=_HIGHEST) * scale  # [J, K, G, span]
    if k_scales is not None:
        scores = scores * _item_scales(k_scales, item_pages, key_ok)
    scores = jnp.where(key_ok[:, None, None, :], scores, -jnp.inf)
    onehot = item_slot[None, :] == jnp.arange(batch)[:, None]                 # [B, J]
    # The softmax of a slot spans all its items: shift every item by its slot's max.
    item_max = jnp.max(scores, axis=-1)                                        # [J, K, G]
    slot_max = jnp.max(jnp.where(onehot[:, :, None, None], item_max[None], -jnp.inf), axis=1)
    slot_max = jnp.where(jnp.isfinite(slot_max), slot_max, 0.0)                # [B, K, G]
    probs = jnp.where(key_ok[:, None, None, :], jnp.exp(scores - slot_max[slot][..., None]), 0.0)
    onehot = onehot.astype(jnp.float32)
    weights = probs if v_scales is None else probs * _item_scales(v_scales, item_pages, key_ok)
    item_out = jnp.einsum("jkgt,kjtd->jkgd", weights, v, precision=_HIGHEST)   # [J, K, G, D]
    out = jnp.einsum("bj,jkgd->bkgd", onehot, item_out, precision=_HIGHEST)
    denom = jnp.einsum("bj,jkg->bkg", onehot, jnp.sum(probs, axis=-1), precision=_HIGHEST)
    out = out / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)[..., None]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def _item_scales(scales, pages, key_ok):
    """scales [KVH, N, bs] gathered for pages [J, P] -> [J, KVH, 1, P * bs], 0 where masked
    (a NaN scale in an unused page must not reach arithmetic)."""
    num_items, pages_per_item = pages.shape
    s = scales[:, pages].reshape(scales.shape[0], num_items, -1)              # [KVH, J, span]
    s = jnp.where(key_ok[None], s, 0.0)
    return jnp.swapaxes(s, 0, 1)[:, :, None, :]


def tiled_prefill_attention_xla(q, k_pages, v_pages, query_pos, tile_pages, *, scale=None,
                                k_scales=None, v_scales=None):
    """q [T, H, D] with T = num_tiles * PREFILL_TILE; query_pos [T] (absolute position, -1 for
    padding, which gives zeros); tile_pages [num_tiles, P]: the block table of the sequence
    each tile belongs to. Causal: a query attends to keys at positions <= its own."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_tiles, pages = tile_pages.shape
    tile = num_tokens // num_tiles
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    context = pages * block_size

    k = k_pages[:, tile_pages].reshape(num_kv_heads, num_tiles, context, head_dim)
    v = v_pages[:, tile_pages].reshape(num_kv_heads, num_tiles, context, head_dim)
    pos = query_pos.reshape(num_tiles, tile)
    mask = jnp.arange(context)[None, None, :] <= pos[:, :, None]              # [N, tq, ctx]
    key_used = jnp.arange(context)[None, :] <= jnp.max(pos, axis=1)[:, None]  # [N, ctx]
    v = jnp.where(key_used[None, :, :, None], v.astype(jnp.float32), 0.0)
    qt = q.reshape(num_tiles, tile, num_kv_heads, group, head_dim).astype(jnp.float32)

    scores = jnp.einsum("nqkgd,kntd->nkgqt", qt, k.astype(jnp.float32),
                        precision=_HIGHEST) * scale                            # [N, K, G, tq, ctx]
    if k_scales is not None:
        scores = scores * _tile_scales(k_scales, tile_pages, key_used)
    mask = mask[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    probs = probs / denom
    if v_scales is not None:
        probs = probs * _tile_scales(v_scales, tile_pages, key_used)
    out = jnp.einsum("nkgqt,kntd->nqkgd", probs, v, precision=_HIGHEST)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _tile_scales(scales, tile_pages, key_used):
    """scales [KVH, N, bs] gathered for tile_pages [N_tiles, P] -> [N_tiles, KVH, 1, 1, ctx],
    0 past the tile's last query position (unused pages may hold NaN scales)."""
    num_tiles = tile_pages.shape[0]
    s = scales[:, tile_pages].reshape(scales.shape[0], num_tiles, -1)         # [KVH, N, ctx]
    s = jnp.where(key_used[None], s, 0.0)
    return jnp.swapaxes(s, 0, 1)[:, :, None, None, :]
