"""Symmetric int8 quantization: the helpers shared by the int8 KV cache and int8 weights.

One float32 scale per row of `axis`-reduced values: q = round(x / scale), scale = max|x| / 127,
so dequantized values are within half a scale step of the originals. A row of zeros gets scale 0
(and dequantizes to exact zeros) rather than a division by zero.

int8 KV pool layout (the same as JAX's shipped Pallas paged attention: scales beside the pages):

    k_pages, v_pages     int8     [KVH, num_blocks, block_size, head_dim]
    k_scales, v_scales   float32  [KVH, num_blocks, block_size]          one per (token, KV head)

Per (token, head) rather than per block or per head: a token's scale is fixed when it is
written, so appending tokens never rescales what is already in a page.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

INT8_MAX = 127.0
# Bytes per stored (token, KV head): head_dim int8 values + one float32 scale.
SCALE_BYTES = 4


def quantize_int8(x, axis: int = -1):
    """x float [...] -> (int8 values of x's shape, float32 scales with `axis` removed).

    Works on numpy arrays (host: the loader quantizes weights before they reach the device)
    and on jax arrays (device: the KV write inside the jitted step)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = x.astype(xp.float32)
    scale = xp.max(xp.abs(x), axis=axis) / INT8_MAX
    safe = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.round(x / xp.expand_dims(safe, axis)), -INT8_MAX, INT8_MAX)
    return q.astype(xp.int8), scale.astype(xp.float32)


def dequantize_int8(q, scale, axis: int = -1, dtype=jnp.float32):
    """The inverse of `quantize_int8` (up to rounding): q * scale, scale broadcast over `axis`."""
    xp = np if isinstance(q, np.ndarray) else jnp
    return (q.astype(xp.float32) * xp.expand_dims(scale, axis)).astype(dtype)


def write_kv_int8(k_pages, v_pages, k_scales, v_scales, k, v, slot_mapping):
    """Quantizes one step's keys/values and scatters them with their scales into the pool.

    k, v: [T, KVH, D] float; slot_mapping: [T] int32 = block * block_size + offset (padding
    points into the null block 0). Returns the updated (k_pages, v_pages, k_scales, v_scales).
    """
    block_size = k_pages.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kq, ks = quantize_int8(k)                                    # [T, KVH, D] int8, [T, KVH]
    vq, vs = quantize_int8(v)
    # Advanced indices (blocks, offsets) are adjacent: the indexed views are [KVH, T, (D)].
    k_pages = k_pages.at[:, blocks, offsets].set(jnp.swapaxes(kq, 0, 1))
    v_pages = v_pages.at[:, blocks, offsets].set(jnp.swapaxes(vq, 0, 1))
    k_scales = k_scales.at[:, blocks, offsets].set(jnp.swapaxes(ks, 0, 1))
    v_scales = v_scales.at[:, blocks, offsets].set(jnp.swapaxes(vs, 0, 1))
    return k_pages, v_pages, k_scales, v_scales


def check_scales(pages, scales, name: str):
    """Validates an int8 page array and its scales (static shapes: runs at trace time)."""
    if pages.dtype != jnp.int8:
        raise ValueError(f"{name}_pages must be int8 when {name}_scales is given, got {pages.dtype}")
    if scales.shape != pages.shape[:3]:
        raise ValueError(f"{name}_scales must be {pages.shape[:3]} (one per token and KV head), "
                         f"got {scales.shape}")
    if scales.dtype != jnp.float32:
        raise ValueError(f"{name}_scales must be float32, got {scales.dtype}")
