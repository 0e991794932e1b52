"""RMSNorm, alone and after a residual add, in jnp (the reference of any norm kernel)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ordered_sum import ordered_sum


def rms_norm(x, weight, eps, offset: float = 0.0):
    """Scales by (offset + weight): Gemma stores w with offset 1 meaning identity."""
    x32 = x.astype(jnp.float32)
    mean_square = ordered_sum(x32 * x32, keepdims=True) / x.shape[-1]           # batch-invariant
    normed = x32 * jnp.reciprocal(jnp.sqrt(mean_square + eps))
    return (normed * (weight.astype(jnp.float32) + offset)).astype(x.dtype)


def add_rms_norm(x, h, weight, eps, offset: float = 0.0):
    """(x + h, rms_norm(x + h)). Narrower than float32 (bf16), the sum is rounded to its dtype
    before the norm, as Hugging Face's forward rounds it: XLA would fuse the add into the
    norm's float32 math and skip that rounding."""
    if x.dtype == jnp.float32:
        total = x + h
        return total, rms_norm(total, weight, eps, offset)
    info = jnp.finfo(x.dtype)
    total = jax.lax.reduce_precision(x.astype(jnp.float32) + h.astype(jnp.float32),
                                     exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return total.astype(x.dtype), rms_norm(total, weight, eps, offset).astype(x.dtype)
