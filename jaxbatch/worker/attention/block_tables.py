"""Block-table backends: the plain-jnp oracle (`reference`, `pallas_kernels/reference.py`) and
the Pallas kernels (`pallas`, and `pallas_interpret` on CPU for tests).

Decode takes a block table per row, prefill the ragged paged-attention contract (kv_lens,
page_indices, cu_q_lens, num_seqs), both padded to a page bucket: the context in use is part
of each call's shape.
"""
from __future__ import annotations

import functools

import numpy as np

from jaxbatch.core.plan import pad_block_table
from jaxbatch.worker.attention.base import AttentionBackend, scale_kwargs
from pallas_kernels import reference


class BlockTableBackend(AttentionBackend):
    def __init__(self, name: str):
        self.name = name
        # The oracle's ragged attention costs tokens x sequences x context: one chunk per call.
        self.chunks_per_call = 1 if name == "reference" else AttentionBackend.chunks_per_call
        self.exportable = name == "reference"

    def _page_buckets(self, layout):
        return [1 << i for i in range(layout.max_page_bucket.bit_length())]

    def decode_sizes(self, layout, rows):
        return self._page_buckets(layout)

    def prefill_sizes(self, layout, tokens):
        return [p for p in self._page_buckets(layout)
                if p == layout.prefill_page_bucket(tokens, p)]

    def prefill_pages(self, layout, tokens, chunks):
        bs = layout.cfg.block_size
        max_pages = max(-(-(c.start + len(c.token_ids)) // bs) for c in chunks)
        return layout.prefill_page_bucket(tokens, max_pages)

    def decode_metadata(self, layout, entries, rows, lengths):
        size = layout.page_bucket(max(len(e[4]) for e in entries))
        tables = np.zeros((rows, size), np.int32)
        for i, e in enumerate(entries):
            tables[i] = pad_block_table(e[4], size)
        return (tables, lengths), size

    def prefill_metadata(self, chunks, q_starts, tables, query_pos, tokens, pages):
        # The ragged contract: chunks packed back to back, as `prefill_align = 1` packs them.
        s = tables.shape[0]
        kv_lens = np.zeros(s, np.int32)
        cu_q_lens = np.zeros(s + 1, np.int32)
        for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
            kv_lens[i] = chunk.start + len(chunk.token_ids)
            cu_q_lens[i + 1:] = q0 + len(chunk.token_ids)
        return (kv_lens, tables, cu_q_lens, np.array([len(chunks)], np.int32))

    def placeholder_decode_metadata(self, rows, size):
        return (np.zeros((rows, size), np.int32), np.zeros(rows, np.int32))

    def placeholder_prefill_metadata(self, tokens, pages, chunks):
        return (np.zeros(chunks, np.int32), np.zeros((chunks, pages), np.int32),
                np.zeros(chunks + 1, np.int32), np.zeros(1, np.int32))

    def _kernels(self):
        if self.name == "reference":
            return reference.paged_decode_attention_ref, reference.ragged_paged_attention_ref
        from pallas_kernels.paged_decode import paged_decode_attention
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        interpret = self.name == "pallas_interpret"
        return (functools.partial(paged_decode_attention, interpret=interpret),
                functools.partial(ragged_paged_attention, interpret=interpret))

    def decode_attend(self, meta, scale):
        """meta = (block_tables [B, P], lengths [B])"""
        fn = self._kernels()[0]
        block_tables, lengths = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: fn(
            q, k_pages, v_pages, block_tables + off, lengths, scale=scale,
            **scale_kwargs(scales, window, soft_cap))

    def prefill_attend(self, meta, scale):
        """meta = (kv_lens [S], page_indices [S, P], cu_q_lens [S + 1], num_seqs [1])"""
        fn = self._kernels()[1]
        kv_lens, page_indices, cu_q_lens, num_seqs = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: fn(
            q, k_pages, v_pages, kv_lens, page_indices + off, cu_q_lens, num_seqs, scale=scale,
            **scale_kwargs(scales, window, soft_cap))
