"""Chooses how attention is computed, and what the host must lay out for it.

    xla               plain jnp shaped for XLA on CPU: cost follows each sequence's own pages
                      (`pallas_kernels/xla_paged_attention.py`); the CPU default
    reference         the plain-jnp oracle (`pallas_kernels/reference.py`): every row pays for
                      the longest block table of the call; for tests
    pallas            the Pallas kernels (Triton backend); the GPU default where this jax
                      can still import and lower them
    pallas_interpret  the same kernels run by the Pallas interpreter on CPU, for tests

`auto` resolves to `pallas` on a GPU whose jax imports and lowers the Pallas Triton kernels,
and to `xla` everywhere else: on CPU, and on a GPU with a jax whose Triton backend is gone
(deprecated from jax 0.11; `xla` is plain jnp and runs on any device). What was picked is what
`LLMEngine.stats()["attention_backend"]` reports.

Each factory returns `attend(q, k_pages, v_pages, block_offset, scales=None) -> out` for
`model.llama.forward_hidden`, closing over the backend's metadata arrays (built by the runner:
`uses_work_lists`). The block ids in the metadata are layer 0's; `block_offset` (layer l's
first row of the folded pool) is added to them inside the layer loop. `scales` is None for a
float pool and (k_scales, v_scales) for an int8 one (`pallas_kernels/int8.py`); every backend
dequantizes inside its attention.
Models with sliding windows (issue 24) also pass `window`, the layer's int32 scalar from the
layer scan (a query at position p sees keys p - window < pos <= p, as HF masks), and Gemma 2
`soft_cap` (a static float): the model passes them only when it has them, so every other model
traces exactly what it did before.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import availability, reference, xla_paged_attention

BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


def _platform() -> str:
    """jax's default backend ("cpu", "gpu", "tpu"); a function so tests can pretend."""
    return jax.default_backend()


def resolve_backend(backend: str) -> str:
    """The concrete backend for `backend`; `auto` -> `pallas` or `xla` (see the module doc).

    Asking for `pallas` or `pallas_interpret` on a jax whose Pallas Triton backend is missing
    or does not lower raises ValueError here, before anything is compiled."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    platform = _platform()
    if backend == "auto":
        if platform == "gpu" and availability.triton_unavailable_reason() is None:
            return "pallas"
        return "xla"
    if backend in ("pallas", "pallas_interpret"):
        why = (availability.triton_unavailable_reason() if backend == "pallas"
               else availability.triton_import_error())
        if why is not None:
            raise ValueError(f"attention_backend={backend!r} is not usable with jax "
                             f"{jax.__version__}: {why}. Use 'auto' or 'xla'.")
    return backend


def uses_work_lists(backend: str) -> bool:
    """xla takes decode work items and prefill query tiles; the others take block tables and
    the ragged (cu_q_lens, kv_lens, page_indices, num_seqs) contract."""
    return backend == "xla"


def _scale_kwargs(scales, window=None, soft_cap=None) -> dict:
    """The optional keyword arguments every backend function takes, left out when unset."""
    kwargs = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
    if window is not None:
        kwargs["window"] = window
    if soft_cap is not None:
        kwargs["soft_cap"] = soft_cap
    return kwargs


def decode_attend(backend: str, meta, scale):
    """One query per row of the decode call.
    xla:    meta = (item_slot [J], item_pages [J, PPI], item_first_pos [J], lengths [B])
    others: meta = (block_tables [B, P], lengths [B])"""
    if backend == "xla":
        item_slot, item_pages, item_first_pos, lengths = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: (
            xla_paged_attention.paged_decode_attention_xla(
                q, k_pages, v_pages, item_slot, item_pages + off, item_first_pos, lengths,
                scale=scale, **_scale_kwargs(scales, window, soft_cap)))
    if backend == "reference":
        fn = reference.paged_decode_attention_ref
    else:
        from pallas_kernels.paged_decode import paged_decode_attention
        fn = functools.partial(paged_decode_attention, interpret=backend == "pallas_interpret")
    block_tables, lengths = meta
    return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: fn(
        q, k_pages, v_pages, block_tables + off, lengths, scale=scale,
        **_scale_kwargs(scales, window, soft_cap))


def prefill_attend(backend: str, meta, scale):
    """Packed prefill chunks of several sequences, causal per sequence.
    xla:    meta = (query_pos [T], tile_pages [T / PREFILL_TILE, P])
    others: meta = (kv_lens [S], page_indices [S, P], cu_q_lens [S + 1], num_seqs [1])"""
    if backend == "xla":
        query_pos, tile_pages = meta
        return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: (
            xla_paged_attention.tiled_prefill_attention_xla(
                q, k_pages, v_pages, query_pos, tile_pages + off, scale=scale,
                **_scale_kwargs(scales, window, soft_cap)))
    if backend == "reference":
        fn = reference.ragged_paged_attention_ref
    else:
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret")
    kv_lens, page_indices, cu_q_lens, num_seqs = meta
    return lambda q, k_pages, v_pages, off, scales=None, window=None, soft_cap=None: fn(
        q, k_pages, v_pages, kv_lens, page_indices + off, cu_q_lens, num_seqs, scale=scale,
        **_scale_kwargs(scales, window, soft_cap))
