"""Chooses how attention is computed, and what the host must lay out for it.

    xla               plain jnp shaped for XLA on CPU: cost follows each sequence's own pages
                      (`pallas_kernels/xla_paged_attention.py`); the CPU default
    reference         the plain-jnp oracle (`pallas_kernels/reference.py`): every row pays for
                      the longest block table of the call; for tests
    pallas            the Pallas kernels; the GPU default
    pallas_interpret  the same kernels run by the Pallas interpreter on CPU, for tests

Each factory returns `attend(q, k_pages, v_pages) -> out` for `model.llama.forward_hidden`,
closing over the backend's metadata arrays (built by the runner: `uses_work_lists`).
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import reference, xla_paged_attention

BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def uses_work_lists(backend: str) -> bool:
    """xla takes decode work items and prefill query tiles; the others take block tables and
    the ragged (cu_q_lens, kv_lens, page_indices, num_seqs) contract."""
    return backend == "xla"


def decode_attend(backend: str, meta, scale):
    """One query per row of the decode call.
    xla:    meta = (item_slot [J], item_pages [J, PPI], item_first_pos [J], lengths [B])
    others: meta = (block_tables [B, P], lengths [B])"""
    if backend == "xla":
        return lambda q, k_pages, v_pages: xla_paged_attention.paged_decode_attention_xla(
            q, k_pages, v_pages, *meta, scale=scale)
    if backend == "reference":
        fn = reference.paged_decode_attention_ref
    else:
        from pallas_kernels.paged_decode import paged_decode_attention
        fn = functools.partial(paged_decode_attention, interpret=backend == "pallas_interpret")
    block_tables, lengths = meta
    return lambda q, k_pages, v_pages: fn(q, k_pages, v_pages, block_tables, lengths, scale=scale)


def prefill_attend(backend: str, meta, scale):
    """Packed prefill chunks of several sequences, causal per sequence.
    xla:    meta = (query_pos [T], tile_pages [T / PREFILL_TILE, P])
    others: meta = (kv_lens [S], page_indices [S, P], cu_q_lens [S + 1], num_seqs [1])"""
    if backend == "xla":
        return lambda q, k_pages, v_pages: xla_paged_attention.tiled_prefill_attention_xla(
            q, k_pages, v_pages, *meta, scale=scale)
    if backend == "reference":
        fn = reference.ragged_paged_attention_ref
    else:
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret")
    return lambda q, k_pages, v_pages: fn(q, k_pages, v_pages, *meta, scale=scale)
