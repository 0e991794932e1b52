"""Rotary position embeddings with the checkpoint's scaling (default, linear, llama3, yarn-free).

Follows Hugging Face's `rotate_half` convention: the GGUF and safetensors loaders both hand us
weights in that layout. Partial rotary (Phi-4-mini) rotates the first `cfg.rotary_dim`
features of each head and passes the rest through, as HF does.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.config import ModelConfig


def _inverse_frequencies(theta: float, scaling: dict | None, dim: int) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in ("longrope", "su"):     # the short factors: see model/phi3.py
        return (inv_freq / np.asarray(scaling["short_factor"], np.float64)).astype(np.float32)
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
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: linear, llama3, "
                     "longrope (Phi-3)")


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[rotary_dim // 2] float32 with the checkpoint's rope_scaling applied; [L, rotary_dim // 2]
    when layers differ (Gemma 3's local and global bases: `cfg.layer_rope`)."""
    if cfg.layer_rope is None:
        return _inverse_frequencies(cfg.rope_theta, cfg.rope_scaling_dict, cfg.rotary_dim)
    return np.stack([_inverse_frequencies(theta, None if s is None else dict(s), cfg.rotary_dim)
                     for theta, s in cfg.layer_rope])


def rope_tables(positions, inv_freq, attention_factor: float = 1.0):
    """positions [T] int32; inv_freq [R/2] or [L, R/2] -> (cos, sin), each [T, R] or
    [L, T, R] float32, scaled by `attention_factor` (longrope). Computed once per forward,
    before the layer loop: from frequencies scanned per layer, XLA evaluated them in every
    layer, once for q and once for k."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[..., None, :]  # [(L,) T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)                       # [(L,) T, R]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x, cos, sin):
    """x: [T, heads, head_dim]; cos, sin [T, R] (`rope_tables`; R <= head_dim: features past
    R are not rotated) -> x's shape."""
    assert cos.ndim == 2, "one layer's tables: [T, R]"
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]                               # [T, 1, R]
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = x32[..., :rot], x32[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    if x_pass.shape[-1]:
        out = jnp.concatenate([out, x_pass], axis=-1)
    return out.astype(x.dtype)
