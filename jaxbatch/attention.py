"""Chooses how attention is computed: the plain-jnp reference (CPU, and the test oracle) or the
Pallas kernels (GPU; `pallas_interpret` runs them on CPU for tests).

Each factory returns `attend(q, k_pages, v_pages) -> out` for `model.llama.forward_hidden`.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import reference

BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def decode_attend(backend: str, block_tables, lengths, scale):
    """One query per slot. block_tables [B, P] (P = page bucket), lengths [B]."""
    if backend == "reference":
        fn = reference.paged_decode_attention_ref
    else:
        from pallas_kernels.paged_decode import paged_decode_attention
        fn = functools.partial(paged_decode_attention, interpret=backend == "pallas_interpret")
    return lambda q, k_pages, v_pages: fn(q, k_pages, v_pages, block_tables, lengths, scale=scale)


def ragged_attend(backend: str, kv_lens, page_indices, cu_q_lens, num_seqs, scale):
    """Packed prefill chunks (and decode tokens) of several sequences, causal per sequence."""
    if backend == "reference":
        fn = reference.ragged_paged_attention_ref
    else:
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret")
    return lambda q, k_pages, v_pages: fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, scale=scale)
