"""The xla backend: plain jnp shaped for XLA on a CPU (`pallas_kernels/xla_paged_attention.py`).

Decode attends over work items, (row, a few pages) each, and prefill over query tiles that each
carry their sequence's block table. Both loop at run time over the context actually in use, so
the context length is no part of a call's shape: one executable per decode row count (items
sized for every row at full length) and per prefill token count (tables spanning
max_pages_per_seq).
"""
from __future__ import annotations

import jax
import numpy as np

from cpu_kernels import paged_decode, paged_prefill
from jaxbatch.worker.attention.base import AttentionBackend, scale_kwargs
from pallas_kernels import xla_paged_attention
from pallas_kernels.xla_paged_attention import PAGES_PER_ITEM, PREFILL_TILE, decode_work_items


class WorkListBackend(AttentionBackend):
    name = "xla"
    prefill_align = PREFILL_TILE
    intermediate_prefill_buckets = True
    mixed_calls = True          # one decode size per row count, one prefill size per token count

    def decode_sizes(self, layout, rows):
        return [layout.decode_item_capacity(rows)]

    def prefill_sizes(self, layout, tokens):
        return [layout.max_page_bucket]

    def prefill_pages(self, layout, tokens, chunks):
        return layout.max_page_bucket

    def decode_metadata(self, layout, entries, rows, lengths):
        items = layout.decode_item_capacity(rows)
        meta = decode_work_items([(i, e[4], e[3] + 1) for i, e in enumerate(entries)],
                                 rows, layout.cfg.block_size, items) + (lengths,)
        return meta, items

    def prefill_metadata(self, chunks, q_starts, tables, query_pos, tokens, pages):
        # Every tile of a chunk carries its sequence's block table.
        tile_pages = np.zeros((tokens // PREFILL_TILE, pages), np.int32)      # [T / tile, P]
        for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
            last = q0 + len(chunk.token_ids) - 1
            tile_pages[q0 // PREFILL_TILE:last // PREFILL_TILE + 1] = tables[i]
        return (query_pos, tile_pages)

    def placeholder_decode_metadata(self, rows, size):
        return (np.full(size, rows, np.int32),                          # every item is padding
                np.zeros((size, PAGES_PER_ITEM), np.int32), np.zeros(size, np.int32),
                np.zeros(rows, np.int32))

    def placeholder_prefill_metadata(self, tokens, pages, chunks):
        return (np.full(tokens, -1, np.int32),
                np.zeros((tokens // PREFILL_TILE, pages), np.int32))

    def decode_attend(self, meta, scale):
        """meta = (item_slot [J], item_pages [J, PPI], item_first_pos [J], lengths [B])"""
        item_slot, item_pages, item_first_pos, lengths = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: (
            _kernel_or_jnp(paged_decode.why_not, paged_decode.paged_decode_attention,
                           xla_paged_attention.paged_decode_attention_xla,
                           (q, k_pages, v_pages, item_slot, item_pages + off, item_first_pos,
                            lengths), scale, scales, window, soft_cap))

    def decode_kernel(self, pool_dtype, model_cfg) -> str:
        reason = paged_decode.why_not(pool_dtype, model_cfg.num_heads, model_cfg.num_kv_heads,
                                      model_cfg.head_dim, model_cfg.attn_soft_cap)
        return f"jnp work lists ({reason})" if reason else "cpu_kernels.paged_decode"

    def prefill_kernel(self, pool_dtype, model_cfg) -> str:
        reason = paged_prefill.why_not(pool_dtype, model_cfg.num_heads, model_cfg.num_kv_heads,
                                       model_cfg.head_dim, model_cfg.attn_soft_cap)
        return f"jnp query tiles ({reason})" if reason else "cpu_kernels.paged_prefill"

    def prefill_attend(self, meta, scale):
        """meta = (query_pos [T], tile_pages [T / PREFILL_TILE, P])"""
        query_pos, tile_pages = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: (
            _kernel_or_jnp(paged_prefill.why_not, paged_prefill.paged_prefill_attention,
                           xla_paged_attention.tiled_prefill_attention_xla,
                           (q, k_pages, v_pages, query_pos, tile_pages + off), scale, scales,
                           window, soft_cap))


def _kernel_or_jnp(why_not, kernel_fn, jnp_fn, args, scale, scales, window, soft_cap):
    """A `cpu_kernels` attention kernel (`kernel_fn`) where it covers this call's pool and
    heads on this machine (`why_not` is None): one custom call per layer instead of XLA's loop
    of small ops. The same function lowered for another platform, and any call the kernel does
    not cover (int8 pools, the only ones with scales, among them), keep `jnp_fn`."""
    q, k_pages = args[0], args[1]
    jnp_path = lambda *a: jnp_fn(*a, scale=scale, **scale_kwargs(scales, window, soft_cap))
    if why_not(k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], soft_cap):
        return jnp_path(*args)
    kernel = lambda *a: kernel_fn(*a, scale=scale, window=window)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=jnp_path)
