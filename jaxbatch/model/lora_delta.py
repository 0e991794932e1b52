"""The LoRA delta of one layer matrix for a whole batch, in one shot (the adapters themselves
live in jaxbatch/lora/; this is only the math a layer adds after its matmul).

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


class LayerLoRA:
    """One layer's adapter pool inside the layer scan: {matrix: (A [S, r, in], B [S, r, out])}
    and the rows' slots as a one-hot [T, S]. Empty (`NO_LORA`) in an engine without LoRA,
    whose traced layers are then exactly those of no LoRA at all."""

    def __init__(self, pairs: dict, one_hot=None):
        self.pairs, self.one_hot = pairs, one_hot

    def has(self, name: str) -> bool:
        return name in self.pairs

    def add(self, name: str, out, x):
        """out + this matrix's delta for x (out unchanged where the matrix has no adapter)."""
        if name not in self.pairs:
            return out
        return (out.astype(jnp.float32) + lora_delta(x, *self.pairs[name], self.one_hot)
                ).astype(out.dtype)


NO_LORA = LayerLoRA({})
