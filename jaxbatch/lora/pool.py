"""The adapter pool on the device: one fixed-shape pair of stacks per layer matrix,
    A [L, S, r_max, in]    B [L, S, r_max, out]      S = max_loras + 1 slots, slot 0 = none
(adapters of lower rank zero-padded to r_max, their scale folded into B). Loading an adapter
is one in-place write of its slot (a donated, jitted update compiled when the pool is made),
so neither loading nor serving ever compiles anything or changes a shape.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.lora.adapter import HF_TO_OURS, LoRAWeights
from jaxbatch.model.inputs import LoRAInputs
from jaxbatch.worker.weight_forms import matrix_shapes


def target_shapes(params: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each matrix an adapter may target that this model has as a plain layer
    matrix (a routed MoE's experts are not targets; fused matrices count as their parts)."""
    shapes = matrix_shapes(params)
    return {ours: shapes[ours] for ours in HF_TO_OURS.values() if ours in shapes}


def _write_slot(arrays, a, b, slot):
    return {"A": {k: v.at[:, slot].set(a[k]) for k, v in arrays["A"].items()},
            "B": {k: v.at[:, slot].set(b[k]) for k, v in arrays["B"].items()}}


class LoRAPool:
    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
                 max_rank: int):
        self.shapes, self.num_layers, self.max_rank = shapes, num_layers, max_rank
        self.num_slots = max_loras + 1
        s, r = self.num_slots, max_rank
        self.arrays = {"A": {k: jnp.zeros((num_layers, s, r, i), jnp.float32)
                             for k, (i, _) in shapes.items()},
                       "B": {k: jnp.zeros((num_layers, s, r, o), jnp.float32)
                             for k, (_, o) in shapes.items()}}
        self._write = jax.jit(_write_slot, donate_argnums=0)
        self.clear(0)      # compiles the one write executable now, not while serving

    def _padded(self, weights: LoRAWeights | None):
        """Every matrix's [L, r_max, in] / [L, r_max, out]: the adapter's rows, zeros beyond."""
        a, b = {}, {}
        for k, (fan_in, fan_out) in self.shapes.items():
            a[k] = np.zeros((self.num_layers, self.max_rank, fan_in), np.float32)
            b[k] = np.zeros((self.num_layers, self.max_rank, fan_out), np.float32)
            if weights is not None and k in weights.matrices:
                wa, wb = weights.matrices[k]
                a[k][:, :weights.rank], b[k][:, :weights.rank] = wa, wb
        return a, b

    def load(self, slot: int, weights: LoRAWeights) -> None:
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.num_slots - 1}")
        self.arrays = self._write(self.arrays, *self._padded(weights), np.int32(slot))

    def clear(self, slot: int) -> None:
        self.arrays = self._write(self.arrays, *self._padded(None), np.int32(slot))

    def call_input(self, slots: np.ndarray) -> LoRAInputs:
        """The pytree a model call takes (`forward_hidden`'s `lora`): slots [T] int32."""
        return LoRAInputs(slots, self.arrays["A"], self.arrays["B"])
