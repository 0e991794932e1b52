"""Rotary position embeddings with the checkpoint's scaling (default, linear, llama3, yarn-free).

Follows Hugging Face's `rotate_half` convention: the GGUF and safetensors loaders both hand us
weights in that layout.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32, with the checkpoint's rope_scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling_dict
    if scaling is None:
        return inv_freq.astype(np.float32)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, blended, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: linear, llama3")


def apply_rope(x, positions, inv_freq):
    """x: [T, heads, head_dim]; positions: [T] int32 -> same shape as x."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]        # [T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, None, :]     # [T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, None, :]
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
