"""The argmax every sampling path takes (greedy, Gumbel-max, the rejection step's resample), in
jnp: the reference of the engine's argmax kernel (`worker/kernels.py`), which the sampler is
handed."""
from __future__ import annotations

import jax.numpy as jnp

CHUNK = 128     # vocabulary entries per chunk of the two-level search


def two_level_argmax(x):
    """[N, V] -> [N] int32: the first maximum, NaN counted as +inf (unlike jnp.argmax, a NaN
    does not beat an earlier +inf).

    Two levels, so that no pass but the first reads the whole [N, V] array: each chunk of
    CHUNK entries' maximum, the first chunk holding the row's maximum, then the first lane of
    that chunk holding it. XLA:CPU runs jnp.argmax's (value, index) reduction element by
    element, and a max followed by a masked min over the whole vocabulary took several passes
    over it, both many times slower over [64, V] logits. The result is exact, so it is the same
    whatever the batch."""
    n, v = x.shape
    pad = -v % CHUNK
    if pad:   # -inf after the end: never before an earlier maximum, even an all -inf row's
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    chunks = x.reshape(n, -1, CHUNK)                                     # [N, V / CHUNK, CHUNK]
    # NaN as +inf: a chunk holding one has maximum +inf. Flagged by a reduction of its own, not
    # by a NaN-free copy of x: both levels would read that copy, so XLA writes it out whole.
    chunk_max = jnp.where(jnp.any(jnp.isnan(chunks), axis=-1), jnp.inf,
                          jnp.max(chunks, axis=-1))                      # [N, V / CHUNK]
    best = jnp.max(chunk_max, axis=-1, keepdims=True)                    # [N, 1]
    num_chunks = chunk_max.shape[-1]
    first_chunk = jnp.min(jnp.where(chunk_max == best,
                                    jnp.arange(num_chunks, dtype=jnp.int32), num_chunks),
                          axis=-1)                                       # [N]
    lanes = jnp.take_along_axis(chunks, first_chunk[:, None, None], axis=1)[:, 0]  # [N, CHUNK]
    lanes = jnp.where(jnp.isnan(lanes), jnp.inf, lanes)
    lane = jnp.min(jnp.where(lanes == best, jnp.arange(CHUNK, dtype=jnp.int32), CHUNK), axis=-1)
    return first_chunk * CHUNK + lane
