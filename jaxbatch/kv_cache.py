"""The paged KV pool on device: one (k_pages, v_pages) pair holding every layer (layer l's
block b is row l * num_blocks + b; see `model/llama.py`), sized from a budget."""
from __future__ import annotations

import jax.numpy as jnp

from jaxbatch.model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    """K and V of one block across all layers."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


def blocks_for_budget(cfg: ModelConfig, block_size: int, dtype, budget_bytes: int) -> int:
    return max(2, budget_bytes // bytes_per_block(cfg, block_size, dtype))


def allocate_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype):
    """Zeros, not jnp.empty: from jax 0.11 `empty` is uninitialised and a NaN in a masked slot
    would poison a whole row of a matmul. Returns (k, v), each
    [num_kv_heads, num_layers * num_blocks, block_size, head_dim]."""
    shape = (cfg.num_kv_heads, cfg.num_layers * num_blocks, block_size, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
