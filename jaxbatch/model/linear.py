"""Weight matrices as typed pytrees: each knows its storage form and how to multiply itself.

A layer writes `k.matmul(x, w)` (`model/kernels.py`) and never asks what `w` is. Every form
computes x [T, in] @ W [in, out] -> [T, out], x cast to the weight's dtype, accumulated in
float32, the result in `out_dtype` (x's dtype unless told):

    Dense     w [.., in, out] float: the plain form (GPUs, stacked layouts, expert stacks)
    Bf16Bits  bits [.., in, out] uint16: a bf16 stack kept as its bit patterns. XLA:CPU slices
              a bf16 stack in the layer scan by converting all of it to float32 and hoisting
              that out of the loop (a float32 copy of every layer weight each step); integer
              slices are native and in place.
    OutIn     w [out, in] float: one layer's matrix stored transposed, the operand layout of
              XNNPACK's fully-connected kernels that XLA:CPU's small dots call, so a dot of a
              few rows reads the weight where it lies instead of repacking it every call.
    Int8      values [.., in, out] int8, scale [.., out] float32 (`quantize.py`): the scale is
              applied to the [T, out] result, not the weight.
    PerLayer  a tuple of L one-layer matrices (any form) closed over by the layer scan: `at`
              gives layer `index`'s, a `lax.switch` whose branch reads its matrix in place.

The CPU kernels' packed form (`worker/weight_forms.py`) is one more subclass of `Linear`,
defined beside the kernel it feeds: nothing here names it.

An epilogue (`SILU_MUL`) is applied to the product by whichever form computes it: in a
kernel's epilogue where the form has one, after the product otherwise. Both give the same bits.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

ACCUMULATE = jnp.float32
BF16_BITS = jnp.uint16


class Linear:
    """The interface every weight form implements."""

    def apply(self, x, rows=None, out_dtype=None):
        """x [.., in] -> [.., out] in `out_dtype` (None: x's). `rows`: None, or an int32
        scalar, the call's rows before its padding; a form may skip the rest (their outputs
        are then not to be read)."""
        raise NotImplementedError

    def apply_epilogue(self, x, epilogue, rows=None):
        """epilogue(x @ W): the product in x's dtype, then the epilogue's jnp form."""
        return epilogue(self.apply(x, rows))

    def fuses(self, epilogue, x) -> bool:
        """Whether this form applies `epilogue` inside its product for an `x` of this shape."""
        return False

    @property
    def in_out(self) -> tuple[int, int]:
        """(in, out) of one layer's matrix."""
        raise NotImplementedError

    def to_float(self):
        """The [.., in, out] float values (numpy stays numpy)."""
        raise NotImplementedError

    @property
    def dtype_name(self) -> str:
        """The dtype the matrix holds, by name ("bfloat16" for bits)."""
        return jnp.dtype(self.to_float().dtype).name


def pytree_weight(cls, data: tuple[str, ...]):
    """A frozen dataclass registered with JAX, `data` its array fields."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=[])
    return cls


def _dot(x, w, out_dtype):
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=ACCUMULATE).astype(
        out_dtype or x.dtype)


class Dense(Linear):
    w: object                                                                # [.., in, out]

    def apply(self, x, rows=None, out_dtype=None):
        return _dot(x, self.w, out_dtype)

    in_out = property(lambda self: tuple(self.w.shape[-2:]))

    def to_float(self):
        return self.w


class Bf16Bits(Linear):
    bits: object                                                             # [.., in, out]

    def apply(self, x, rows=None, out_dtype=None):
        return _dot(x, self.to_float(), out_dtype)

    in_out = property(lambda self: tuple(self.bits.shape[-2:]))
    dtype_name = property(lambda self: "bfloat16")

    def to_float(self):
        if isinstance(self.bits, np.ndarray):
            return self.bits.view(jnp.bfloat16)
        return jax.lax.bitcast_convert_type(self.bits, jnp.bfloat16)

    @classmethod
    def of(cls, w) -> "Bf16Bits":
        bits = (w.view(np.uint16) if isinstance(w, np.ndarray)
                else jax.lax.bitcast_convert_type(w, BF16_BITS))
        return cls(bits)


class OutIn(Linear):
    w: object                                                                # [out, in]

    def apply(self, x, rows=None, out_dtype=None):
        return jax.lax.dot_general(x.astype(self.w.dtype), self.w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=ACCUMULATE).astype(out_dtype or x.dtype)

    in_out = property(lambda self: tuple(self.w.shape[::-1]))

    def to_float(self):
        return self.w.T

    @classmethod
    def of(cls, w) -> "OutIn":
        """From [in, out] values (numpy transposed on the host)."""
        return cls(np.ascontiguousarray(w.T) if isinstance(w, np.ndarray) else jnp.transpose(w))


class Int8(Linear):
    values: object                                                           # [.., in, out]
    scale: object                                                            # [.., out]

    def apply(self, x, rows=None, out_dtype=None):
        y = jnp.dot(x, self.values.astype(x.dtype), preferred_element_type=ACCUMULATE)
        return (y * self.scale).astype(out_dtype or x.dtype)

    in_out = property(lambda self: tuple(self.values.shape[-2:]))
    dtype_name = property(lambda self: "int8")

    def to_float(self):
        return self.values.astype(jnp.float32) * self.scale[..., None, :]


class PerLayer(Linear):
    layers: tuple                                    # L one-layer matrices, any form each

    def at(self, index) -> Linear:
        """Layer `index`'s matrix (an int32 scalar, traced in the layer scan)."""
        return self.layers[0] if len(self.layers) == 1 else _Switched(self.layers, index)

    in_out = property(lambda self: self.layers[0].in_out)
    dtype_name = property(lambda self: self.layers[0].dtype_name)

    def to_float(self):
        stack = np.stack if isinstance(jax.tree.leaves(self.layers)[0], np.ndarray) else jnp.stack
        return stack([w.to_float() for w in self.layers])


Dense = pytree_weight(Dense, ("w",))
Bf16Bits = pytree_weight(Bf16Bits, ("bits",))
OutIn = pytree_weight(OutIn, ("w",))
Int8 = pytree_weight(Int8, ("values", "scale"))
PerLayer = pytree_weight(PerLayer, ("layers",))


class _Switched(Linear):
    """One of L matrices chosen by a traced index: only ever built inside a trace."""

    def __init__(self, layers: tuple, index):
        self.layers, self.index = layers, index

    def _switch(self, fn, x):
        return jax.lax.switch(self.index, [lambda x, w=w: fn(w, x) for w in self.layers], x)

    def apply(self, x, rows=None, out_dtype=None):
        return self._switch(lambda w, x: w.apply(x, rows, out_dtype), x)

    def apply_epilogue(self, x, epilogue, rows=None):
        if not all(w.fuses(epilogue, x) for w in self.layers):
            return epilogue(self.apply(x, rows))      # the epilogue once, after the switch
        return self._switch(lambda w, x: w.apply_epilogue(x, epilogue, rows), x)

    in_out = property(lambda self: self.layers[0].in_out)


def is_linear(w) -> bool:
    return isinstance(w, Linear)


def layer_matrix(w, index) -> Linear:
    """This layer's matrix: `PerLayer.at(index)`, or `w` itself (a scan slice)."""
    return w.at(index) if isinstance(w, PerLayer) else w


def split(y, widths: tuple[int, ...] | int) -> list:
    """[.., sum widths] -> one array per part (`widths` an int: that many equal parts)."""
    if isinstance(widths, int):
        return jnp.split(y, widths, axis=-1)
    return jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)


def activation(gate, kind: str):
    g32 = gate.astype(jnp.float32)
    if kind == "gelu_tanh":                 # torch's gelu(approximate="tanh")
        return jax.nn.gelu(g32, approximate=True).astype(gate.dtype)
    return (gate * (1.0 / (1.0 + jnp.exp(-g32)))).astype(gate.dtype)


class SiluMul:
    """The gated MLP's activation as an epilogue of the fused [gate | up] product:
    [.., 2 I] -> silu(gate) * up [.., I], as `activation` computes it on the rounded halves."""
    name = "silu_mul"

    def __call__(self, y):
        gate, up = split(y, 2)
        return activation(gate, "silu") * up

    def __repr__(self) -> str:
        return "SILU_MUL"


SILU_MUL = SiluMul()
