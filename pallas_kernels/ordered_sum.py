"""Reductions whose order of summation depends on the reduced length alone.

XLA:CPU picks how to sum a row (the loop's vectorisation, its partial sums) from the whole
array's shape, so `jnp.sum(x, axis=-1)` of one row can round differently when the array holds
3 rows than when it holds 8, and a bf16 activation rounded from it can then round the other way:
one request's output would depend on which others share its step. `ordered_sum` adds with
elementwise ops only, in a fixed tree: the row is cut into chunks of LANES values, chunks are
added pairwise (halving their number each time), then the lanes pairwise. Elementwise adds are
exact IEEE operations, so every row gets the same bits whatever the array's other dimensions.
"""
from __future__ import annotations

import jax.numpy as jnp

LANES = 16


def ordered_sum(x, keepdims: bool = False):
    """Sum over the last axis, in an order fixed by its length: [..., n] -> [...] ([..., 1]
    with keepdims)."""
    n = x.shape[-1]
    padded = -(-n // LANES) * LANES
    if padded != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - n)])
    x = x.reshape(x.shape[:-1] + (padded // LANES, LANES))                     # [..., C, LANES]
    chunks = padded // LANES
    while chunks > 1:
        if chunks % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1, :])], axis=-2)
            chunks += 1
        chunks //= 2
        x = x[..., :chunks, :] + x[..., chunks:, :]
    x = x[..., 0, :]
    width = LANES
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x if keepdims else x[..., 0]


def ordered_log_softmax(x):
    """log_softmax over the last axis with `ordered_sum` (max is exact in any order)."""
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    return shifted - jnp.log(ordered_sum(jnp.exp(shifted), keepdims=True))


def ordered_softmax(x):
    """softmax over the last axis with `ordered_sum`."""
    shifted = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return shifted / ordered_sum(shifted, keepdims=True)
