"""Pooling on the device: a prefill call's final-normed hidden states -> one vector per chunk.

An embedding request's chunks ride ordinary prefill calls (packed beside other requests'
chunks); after the forward, ("pool", tokens) reduces each chunk to one float32 vector
[C, d] (C = the call's `chunks_per_call`), the only thing read back. The host combines a
request's chunks (`engine/pooling.py`): the last chunk's for "last", the first's for "cls",
the sum of all for "mean".

Batch invariance: a chunk's rows are the same numbers whatever else the call packs (see
`step_inputs.MIN_DECODE_ROWS`), and each reduction here reads them at the chunk's own offsets
in a shape fixed by the engine, never by the call: "mean" sums a [C, prefill_chunk_size, d]
window per chunk, so a chunk is summed in the same order alone or packed at any offset of a
call of any token bucket.
"""
from __future__ import annotations

import jax.numpy as jnp


def pool_last(hidden, q_starts, lengths, window: int):
    """Each chunk's last row."""
    return hidden[q_starts + jnp.maximum(lengths, 1) - 1].astype(jnp.float32)        # [C, d]


def pool_cls(hidden, q_starts, lengths, window: int):
    """Each chunk's first row (the host keeps only a prompt's first chunk's)."""
    return hidden[q_starts].astype(jnp.float32)                                       # [C, d]


def pool_mean(hidden, q_starts, lengths, window: int):
    """Each chunk's rows summed (the host divides by the prompt's length)."""
    offsets = jnp.arange(window, dtype=jnp.int32)                                     # [W]
    rows = q_starts[:, None] + offsets[None, :]                                       # [C, W]
    picked = hidden.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)       # [C, W, d]
    inside = (offsets[None, :] < lengths[:, None])[..., None]                         # [C, W, 1]
    return jnp.sum(jnp.where(inside, picked, 0.0), axis=1)                            # [C, d]


POOLERS = {"last": pool_last, "cls": pool_cls, "mean": pool_mean}


def pool_step(pooler, hidden, q_starts, lengths, *, window: int):
    """`pooler`: one of POOLERS (positional, so a stored lowering is keyed by its name).
    hidden [T, d], q_starts / lengths [C] int32 (length 0: no chunk) -> [C, d] float32."""
    return pooler(hidden, q_starts, lengths, window)
