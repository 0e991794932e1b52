"""Writing one step's keys/values into the paged pool: a validating wrapper, deliberately not a
Pallas kernel.

Why no kernel: the write moves T x KVH x D elements per layer (a few hundred KB per step), tiny
next to the attention that reads the pool. XLA lowers `.at[...].set` to an in-place scatter
when the pool is donated (the runner donates it), so a Pallas kernel with input/output aliasing
could only match it, and would add a second code path to keep correct. What matters for speed
is the donation: without it XLA copies the whole pool every step. scripts/gpu_check.py times
this write against its byte count so a regression shows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode import check_int32, check_kv_pool, check_rank
from pallas_kernels.reference import write_kv_ref


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """k/v_pages [KVH, N, bs, D]; k, v [T, KVH, D]; slot_mapping [T] int32 = block * bs + offset.

    Returns the updated (k_pages, v_pages). Padded tokens should point into the null block 0.
    Page size and head_dim need not be powers of two here (the CPU path has no such limit),
    except that a bf16-bits (uint16) pool's pages hold up to 16 keys or a multiple of 16
    (`reference.key_group`).
    """
    check_kv_pool(k_pages, v_pages, require_pow2=False)
    check_rank("k", k, 3)
    check_rank("v", v, 3)
    num_kv_heads, _, _, head_dim = k_pages.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ in shape")
    if k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k/v must be [T, {num_kv_heads}, {head_dim}], got {k.shape}")
    for name, x in (("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    check_int32("slot_mapping", slot_mapping, (k.shape[0],))
    return write_kv_ref(k_pages, v_pages, k, v, slot_mapping)


write_kv_jit = jax.jit(write_kv, donate_argnums=(0, 1))
