"""The xla backend: plain jnp shaped for XLA on a CPU (`pallas_kernels/xla_paged_attention.py`).

Decode attends over work items, (row, a few pages) each, and prefill over query tiles that each
carry their sequence's block table. Both loop at run time over the context actually in use, so
the context length is no part of a call's shape: one executable per decode row count (items
sized for every row at full length) and per prefill token count (tables spanning
max_pages_per_seq).

Its prefill layout follows the kernel that will read it (`for_pool`). Every chunk's tokens
must start a query tile of their own. Where the C++ prefill kernel runs (bf16 pools on a CPU
that builds it), the call packs tokens back to back, as the model's matmuls want them, and
attention alone gathers q into the tiled layout (`tiled_rows` rows: up to PREFILL_TILE - 1
rows of padding per chunk) and its result back out: the kernel skips a tile of padding, so
the matmuls compute no padding tokens and attention none either. Elsewhere (float32 and int8
pools, other platforms) the jnp tiles compute every row they are given, so the call itself
starts each chunk on a tile (`prefill_align`): no gathers, and only its bucket's padding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import paged_decode, paged_prefill
from jaxbatch.worker.attention.base import AttentionBackend, scale_kwargs
from pallas_kernels import xla_paged_attention
from pallas_kernels.xla_paged_attention import PAGES_PER_ITEM, PREFILL_TILE, decode_work_items


def tiled_rows(tokens: int, chunks: int) -> int:
    """Rows of the tiled layout of a prefill call of `tokens` tokens in at most `chunks`
    chunks: each chunk starts a tile, so it may leave up to PREFILL_TILE - 1 rows unused."""
    rows = tokens + (PREFILL_TILE - 1) * min(chunks, tokens)
    return -(-rows // PREFILL_TILE) * PREFILL_TILE


class WorkListBackend(AttentionBackend):
    name = "xla"
    mixed_calls = True          # one decode size per row count, one prefill size per token count

    def __init__(self, packed_prefill: bool = False, num_layers: int = 0):
        self.packed_prefill = packed_prefill
        # The pool's layers (0: unknown): the C++ decode kernel tells the GEMMs after it which
        # pages the next layer reads (cpu_kernels/kv_hints.py), num_blocks further on.
        self.num_layers = num_layers
        self.prefill_align = 1 if packed_prefill else PREFILL_TILE
        # Aligned calls keep the 1.5x steps, every one a whole number of tiles (40 and 56
        # are not), and the executables of the layout they had before packing.
        self.prefill_bucket_quarters = (5, 6, 7) if packed_prefill else (6,)

    def for_pool(self, pool_dtype, model_cfg):
        reason = _prefill_kernel_reason(pool_dtype, model_cfg)
        return WorkListBackend(packed_prefill=reason is None and jax.default_backend() == "cpu",
                               num_layers=model_cfg.num_layers)

    def prefill_rows(self, tokens: int) -> int:
        """Rows of the tiled layout attention reads for a call of `tokens` tokens."""
        rows = tiled_rows(tokens, self.chunks_per_call) if self.packed_prefill else tokens
        # An aligned call's bucket that is not whole tiles would split into tiles of another
        # size, silently.
        assert rows % PREFILL_TILE == 0, f"{tokens} tokens are not whole {PREFILL_TILE}-row tiles"
        return rows

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
        # The tiled layout: each chunk from the start of a tile, every tile of a chunk carrying
        # its sequence's block table. Aligned calls are that layout already (row = token, so
        # query_pos is its positions); packed ones add the gathers into it and back. An index
        # past the end of what it indexes gathers zeros: padding rows get no query, padding
        # tokens no attention output.
        packed, rows = self.packed_prefill, self.prefill_rows(tokens)
        tile_pages = np.zeros((rows // PREFILL_TILE, pages), np.int32)       # [R / tile, P]
        if packed:
            tile_pos = np.full(rows, -1, np.int32)                           # [R]
            row_token = np.full(rows, tokens, np.int32)  # [R] the token at each row
            token_row = np.full(tokens, rows, np.int32)  # [T] the row of each token
        r = 0
        for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
            n = len(chunk.token_ids)
            tile_pages[r // PREFILL_TILE:(r + n - 1) // PREFILL_TILE + 1] = tables[i]
            if packed:
                tile_pos[r:r + n] = query_pos[q0:q0 + n]
                row_token[r:r + n] = np.arange(q0, q0 + n)
                token_row[q0:q0 + n] = np.arange(r, r + n)
            r += -(-n // PREFILL_TILE) * PREFILL_TILE
        return (tile_pos, tile_pages, row_token, token_row) if packed else (query_pos, tile_pages)

    def placeholder_decode_metadata(self, rows, size):
        return (np.full(size, rows, np.int32),                          # every item is padding
                np.zeros((size, PAGES_PER_ITEM), np.int32), np.zeros(size, np.int32),
                np.zeros(rows, np.int32))

    def placeholder_prefill_metadata(self, tokens, pages, chunks):
        rows = self.prefill_rows(tokens)
        tiled = (np.full(rows, -1, np.int32), np.zeros((rows // PREFILL_TILE, pages), np.int32))
        if not self.packed_prefill:
            return tiled
        return tiled + (np.full(rows, tokens, np.int32), np.full(tokens, rows, np.int32))

    def decode_attend(self, meta, scale):
        """meta = (item_slot [J], item_pages [J, PPI], item_first_pos [J], lengths [B])"""
        item_slot, item_pages, item_first_pos, lengths = meta

        def attend(q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None):
            kernel = functools.partial(paged_decode.paged_decode_attention,
                                       next_layer_blocks=self.next_layer_blocks(k_pages))
            return _kernel_or_jnp(paged_decode.why_not, kernel,
                                  xla_paged_attention.paged_decode_attention_xla,
                                  (q, k_pages, v_pages, item_slot, item_pages + off,
                                   item_first_pos, lengths), scale, scales, window, soft_cap)
        return attend

    def next_layer_blocks(self, k_pages) -> int:
        """How far the next layer's blocks lie in the folded pool (0: unknown)."""
        return k_pages.shape[1] // self.num_layers if self.num_layers else 0

    def decode_kernel(self, pool_dtype, model_cfg) -> str:
        reason = paged_decode.why_not(pool_dtype, model_cfg.num_heads, model_cfg.num_kv_heads,
                                      model_cfg.head_dim, model_cfg.attn_soft_cap)
        return f"jnp work lists ({reason})" if reason else "cpu_kernels.paged_decode"

    def prefill_kernel(self, pool_dtype, model_cfg) -> str:
        reason = _prefill_kernel_reason(pool_dtype, model_cfg)
        return f"jnp query tiles ({reason})" if reason else "cpu_kernels.paged_prefill"

    def prefill_attend(self, meta, scale):
        """meta = (tile_pos [R], tile_pages [R / PREFILL_TILE, P]), the tiled layout's
        positions and tables, and with packed prefill (row_token [R], token_row [T]), the two
        gathers between the call's tokens and it (R = T without)."""
        tile_pos, tile_pages, *gathers = meta

        def attend(q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None):
            if gathers:
                q = jnp.take(q, gathers[0], axis=0, mode="fill", fill_value=0)    # [R, H, D]
            out = _kernel_or_jnp(paged_prefill.why_not, paged_prefill.paged_prefill_attention,
                                 xla_paged_attention.tiled_prefill_attention_xla,
                                 (q, k_pages, v_pages, tile_pos, tile_pages + off), scale,
                                 scales, window, soft_cap)
            if gathers:
                out = jnp.take(out, gathers[1], axis=0, mode="fill", fill_value=0)  # [T, H, D]
            return out
        return attend

    def __repr__(self) -> str:
        return (f"WorkListBackend({self.name!r}, packed_prefill={self.packed_prefill}, "
                f"num_layers={self.num_layers})")


def _prefill_kernel_reason(pool_dtype, model_cfg) -> str | None:
    """Why the C++ prefill kernel does not cover a pool of `pool_dtype` here, or None."""
    return paged_prefill.why_not(pool_dtype, model_cfg.num_heads, model_cfg.num_kv_heads,
                                 model_cfg.head_dim, model_cfg.attn_soft_cap)


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
