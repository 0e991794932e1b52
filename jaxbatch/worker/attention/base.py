"""What an attention backend is to the rest of the worker.

A backend is two halves that must agree: on the host, a metadata builder that lays a call's
sequences out as the arrays its kernels read (`decode_metadata`, `prefill_metadata`, their
placeholders for warm-up, and the shape keys they produce); on the device, the `attend`
functions the model calls with those arrays (`decode_attend`, `prefill_attend`: each returns
`attend(q, k_pages, v_pages, block_offset, scales=None) -> out` for
`model.decoder.forward_hidden`; models with sliding windows also pass `window`, the layer's
int32 scalar from the layer scan (a query at position p sees keys p - window < pos <= p, as
HF masks), and Gemma 2 `soft_cap`, a static float). `step_inputs.StepLayout` and the runner only ever talk to this
interface; each backend is one file (`work_lists.py`: xla; `block_tables.py`: reference and
the Pallas kernels).

Block ids in the metadata are layer 0's; `block_offset` (layer l's first row of the folded
pool) is added to them inside the layer loop. `scales` is None for a float pool and
(k_scales, v_scales) for an int8 one (`pallas_kernels/int8.py`); every backend dequantizes
inside its attention.
"""
from __future__ import annotations

import numpy as np


class AttentionBackend:
    name: str
    # Chunks (rows sampled) per prefill call.
    chunks_per_call: int = 8
    # Prefill chunks start on multiples of this many tokens of a call.
    prefill_align: int = 1
    # Token buckets between the powers of two from 32, in quarters of the power below them
    # (6: 1.5x). Cheap where context is no shape: one executable per token bucket.
    prefill_bucket_quarters: tuple[int, ...] = ()
    # Whether `jax.export` can store its lowered steps (Pallas kernels are custom calls it
    # refuses).
    exportable: bool = True
    # Whether a step's decode rows and prefill call may share one model call (`mixed_attend`):
    # worth it where each kind has one size per row or token count, since a mixed call has a
    # key per pair of them.
    mixed_calls: bool = False

    def with_kernels(self, choice) -> "AttentionBackend":
        """This backend running the engine's kernels (`worker/kernels.py` `KernelChoice`): the
        runner asks once, before building its `StepLayout`, so a backend may lay calls out
        as the kernels it is handed read them fastest. Backends with kernels of their own
        (the Pallas ones) keep them."""
        return self

    # ---- host: shapes --------------------------------------------------------------------
    def decode_sizes(self, layout, rows: int) -> list[int]:
        """The second key element of every decode call of `rows` rows."""
        raise NotImplementedError

    def prefill_sizes(self, layout, tokens: int) -> list[int]:
        """The page counts of every prefill call of `tokens` tokens."""
        raise NotImplementedError

    def prefill_pages(self, layout, tokens: int, chunks) -> int:
        raise NotImplementedError

    # ---- host: metadata ------------------------------------------------------------------
    def decode_metadata(self, layout, entries, rows: int, lengths: np.ndarray) -> tuple:
        """`entries`: (seq_id, j, token, position, block table, sampling row) per row in use;
        returns (meta arrays, size key)."""
        raise NotImplementedError

    def prefill_metadata(self, chunks, q_starts, tables: np.ndarray, query_pos: np.ndarray,
                         tokens: int, pages: int) -> tuple:
        raise NotImplementedError

    def placeholder_decode_metadata(self, rows: int, size: int) -> tuple:
        """Metadata of a call that touches nothing (warm-up)."""
        raise NotImplementedError

    def placeholder_prefill_metadata(self, tokens: int, pages: int, chunks: int) -> tuple:
        raise NotImplementedError

    # ---- device --------------------------------------------------------------------------
    def decode_attend(self, meta, scale: float):
        raise NotImplementedError

    def prefill_attend(self, meta, scale: float):
        raise NotImplementedError

    def decode_kernel_name(self, pool_dtype, model_cfg) -> str:
        """What runs decode attention for a pool of `pool_dtype` (stats())."""
        return f"{self.name} backend"

    def prefill_kernel_name(self, pool_dtype, model_cfg) -> str:
        """What runs prefill attention for a pool of `pool_dtype` (stats())."""
        return f"{self.name} backend"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def scale_kwargs(scales, window=None, soft_cap=None) -> dict:
    """The optional keyword arguments every kernel takes, left out when unset."""
    kwargs = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
    if window is not None:
        kwargs["window"] = window
    if soft_cap is not None:
        kwargs["soft_cap"] = soft_cap
    return kwargs
