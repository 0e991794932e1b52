"""The LoRA delta of one layer matrix for a whole batch, in one shot (the adapters themselves
live in jaxbatch/lora/; this is only the math the model's one matmul hook calls).

Each token row t uses the adapter in pool slot s(t) (slot 0: none, all zeros):
    delta[t] = x[t] @ A[s(t)].T @ B[s(t)]     A [S, r, in], B [S, r, out] (scale folded into B)
Computed as a one-hot contraction over the slots rather than a per-row gather: every row
multiplies by every slot's A (S * r extra columns, small next to `out`) and the one-hot zeroes
the others, so the shapes are fixed and XLA emits two plain dots (measured against the gather
in tests/lora/README.md).
"""
from __future__ import annotations

import jax.numpy as jnp


def lora_delta(x, a, b, one_hot):
    """x [T, in]; a [S, r, in]; b [S, r, out]; one_hot [T, S] float32 -> float32 [T, out]."""
    xa = jnp.einsum("ti,sri->tsr", x.astype(jnp.float32), a)                   # [T, S, r]
    return jnp.einsum("tsr,sro->to", xa * one_hot[:, :, None], b)              # [T, out]


def lora_delta_gathered(x, a, b, slots):
    """The per-row gather form of `lora_delta` (slots [T] int32), kept for the measurement."""
    xa = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a[slots])             # [T, r]
    return jnp.einsum("tr,tro->to", xa, b[slots])                              # [T, out]
