"""A mixed model call's attention: a step's decode rows and its first prefill chunk share one
pass over the weights, and each part attends with its own backend function."""
from __future__ import annotations

import jax.numpy as jnp


def mixed_attend(rows: int, decode_attend, prefill_attend):
    """A mixed call's attention: q [rows + T, H, D] holds the decode rows first, then the
    packed prefill tokens; each part attends with its own function over the same pool, which
    both parts' keys and values were written into before any attends (a step's decoding and
    prefilling sequences are distinct, so neither part reads what the other wrote)."""
    def attend(q, k_pages, v_pages, off, **kwargs):
        decoded = decode_attend(q[:rows], k_pages, v_pages, off, **kwargs)      # [rows, H, D]
        prefilled = prefill_attend(q[rows:], k_pages, v_pages, off, **kwargs)   # [T, H, D]
        return jnp.concatenate([decoded, prefilled])
    return attend
