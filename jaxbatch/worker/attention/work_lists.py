"""The xla backend: plain jnp shaped for XLA on a CPU (`pallas_kernels/xla_paged_attention.py`).

Decode attends over work items, (row, a few pages) each, and prefill over query tiles that each
carry their sequence's block table. Both loop at run time over the context actually in use, so
the context length is no part of a call's shape: one executable per decode row count (items
sized for every row at full length) and per prefill token count (tables spanning
max_pages_per_seq).

Its kernels are the engine's (`worker/kernels.py` hands them over, `with_kernels`): a decode
and a prefill attention function each, or None for the jnp forms here. Its prefill layout
follows the prefill kernel it was handed. Every chunk's tokens must start a query tile of
their own. With a prefill kernel (the C++ one skips whole tiles of padding) the call packs
tokens back to back, as the model's matmuls want them, and
attention alone gathers q into the tiled layout (`tiled_rows` rows: up to PREFILL_TILE - 1
rows of padding per chunk) and its result back out: the kernel skips a tile of padding, so
the matmuls compute no padding tokens and attention none either. Without one the jnp tiles
compute every row they are given, so the call itself starts each chunk on a tile
(`prefill_align`): no gathers, and only its bucket's padding.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

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

    def __init__(self, decode_kernel=None, prefill_kernel=None, kernel_names=("", "")):
        """`decode_kernel(q, k_pages, v_pages, item_slot, item_pages, item_first_pos, lengths,
        *, scale, window)` and `prefill_kernel(q, k_pages, v_pages, query_pos, tile_pages, *,
        scale, window)`: the engine's attention kernels, None for the jnp forms;
        `kernel_names`: what runs each, for stats()."""
        self.decode_kernel, self.prefill_kernel = decode_kernel, prefill_kernel
        self.kernel_names = kernel_names
        self.packed_prefill = prefill_kernel is not None
        self.prefill_align = 1 if self.packed_prefill else PREFILL_TILE
        # Aligned calls keep the 1.5x steps, every one a whole number of tiles (40 and 56
        # are not), and the executables of the layout they had before packing.
        self.prefill_bucket_quarters = (5, 6, 7) if self.packed_prefill else (6,)

    def with_kernels(self, choice):
        names = choice.describe()
        return WorkListBackend(choice.decode_attention, choice.prefill_attention,
                               (names["decode_attention"], names["prefill_attention"]))

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
            args = (q, k_pages, v_pages, item_slot, item_pages + off, item_first_pos, lengths)
            if self.decode_kernel is None:
                return xla_paged_attention.paged_decode_attention_xla(
                    *args, scale=scale, **scale_kwargs(scales, window, soft_cap))
            return self.decode_kernel(*args, scale=scale, window=window)
        return attend

    def decode_kernel_name(self, pool_dtype, model_cfg) -> str:
        return self.kernel_names[0] or "jnp work lists"

    def prefill_kernel_name(self, pool_dtype, model_cfg) -> str:
        return self.kernel_names[1] or "jnp query tiles"

    def prefill_attend(self, meta, scale):
        """meta = (tile_pos [R], tile_pages [R / PREFILL_TILE, P]), the tiled layout's
        positions and tables, and with packed prefill (row_token [R], token_row [T]), the two
        gathers between the call's tokens and it (R = T without)."""
        tile_pos, tile_pages, *gathers = meta

        def attend(q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None):
            if gathers:
                q = jnp.take(q, gathers[0], axis=0, mode="fill", fill_value=0)    # [R, H, D]
            args = (q, k_pages, v_pages, tile_pos, tile_pages + off)
            if self.prefill_kernel is None:
                out = xla_paged_attention.tiled_prefill_attention_xla(
                    *args, scale=scale, **scale_kwargs(scales, window, soft_cap))
            else:
                out = self.prefill_kernel(*args, scale=scale, window=window)
            if gathers:
                out = jnp.take(out, gathers[1], axis=0, mode="fill", fill_value=0)  # [T, H, D]
            return out
        return attend

    def __repr__(self) -> str:
        return (f"WorkListBackend({self.name!r}, decode={self.kernel_names[0] or 'jnp'!r}, "
                f"prefill={self.kernel_names[1] or 'jnp'!r})")
