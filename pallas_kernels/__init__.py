"""Paged attention for jaxbatch.

Tier 1, `reference`: plain-jnp oracles and the CPU path. Tier 2: Pallas kernels on the Triton
backend (`paged_decode_attention`, `ragged_paged_attention`), same signatures as the references
plus keyword-only tuning knobs and `interpret=True` for CPU testing. `write_kv` fills the pool.
"""
from pallas_kernels.kv_write import write_kv, write_kv_jit
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import (paged_decode_attention_ref, ragged_paged_attention_ref,
                                      write_kv_ref)

__all__ = [
    "paged_decode_attention", "paged_decode_attention_ref", "ragged_paged_attention",
    "ragged_paged_attention_ref", "write_kv", "write_kv_jit", "write_kv_ref",
]
