"""The paged KV pool on device: one (k_pages, v_pages) pair holding every layer (layer l's
block b is row l * num_blocks + b; see `model/decoder.py`), sized from a budget.

`kv_cache_dtype="auto"` stores K/V in the model's dtype; `"int8"` stores int8 pages plus one
float32 scale per (token, KV head) in (k_scales, v_scales) beside them (`pallas_kernels/int8.py`).
Sizing counts the scale bytes: with head_dim 64 a token-head costs 64 + 4 bytes instead of 128
(bfloat16) or 256 (float32), so one budget holds 1.88x or 3.76x the tokens.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.inputs import KVPool
from pallas_kernels.int8 import SCALE_BYTES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose 'auto' (the model's dtype) "
                         "or 'int8' (one float32 scale per token and KV head)")


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one block across all layers, scales included for an int8 cache."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        per_token_head = cfg.head_dim * 1 + SCALE_BYTES
    else:
        per_token_head = cfg.head_dim * jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * per_token_head


def blocks_for_budget(cfg: ModelConfig, block_size: int, dtype, budget_bytes: int,
                      kv_cache_dtype: str = "auto") -> int:
    return max(2, budget_bytes // bytes_per_block(cfg, block_size, dtype, kv_cache_dtype))


def allocate_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
                  kv_cache_dtype: str = "auto") -> KVPool:
    """Zeros, not jnp.empty: from jax 0.11 `empty` is uninitialised and a NaN in a masked slot
    would poison a whole row of a matmul. Returns (k, v), each
    [num_kv_heads, num_layers * num_blocks, block_size, head_dim] in `dtype`; for an int8
    cache (k, v, k_scales, v_scales) with int8 pages and float32 scales
    [num_kv_heads, num_layers * num_blocks, block_size]."""
    check_kv_cache_dtype(kv_cache_dtype)
    shape = (cfg.num_kv_heads, cfg.num_layers * num_blocks, block_size, cfg.head_dim)
    if kv_cache_dtype == "auto":
        return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return KVPool(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8),
                  jnp.zeros(shape[:3], jnp.float32), jnp.zeros(shape[:3], jnp.float32))
