"""The typed weights the kernels read, each defined beside the call it makes: `Packed` for the
packed bf16 / float32 GEMM (`cpu_kernels.packed_gemm`; `AmxPacked`, the same over AMX tiles),
and the W8A8 forms, int8 matrices against activations quantized per token: `PackedW8A8`
(`cpu_kernels.w8a8_gemm`, VNNI; `AmxPackedW8A8`, AMX int8 tiles),
`OutInW8A8` (XLA's int8 dots, [out, in]: oneDNN's AMX int8 tiles where the CPU has
them), `PallasW8A8` (`pallas_kernels.w8a8`, a GPU's int8 MMA) and `W8A8` (the jnp reference
all equal). `weight_forms.prepare` gives matrices these forms; `model/linear.py` names none."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import packed_gemm, w8a8_gemm
from jaxbatch.model.linear import SILU_MUL, Linear, pytree_weight
from pallas_kernels import w8a8

# Calls of at least this many tokens take silu * up as the packed GEMM's epilogue: in a call
# of a few decode rows the epilogue's exponentials and divisions cost about what XLA's
# separate elementwise op costs there; in prefill calls the op costs more than the epilogue.
SILU_EPILOGUE_MIN_ROWS = 32


class Packed(Linear):
    """A matrix packed for `cpu_kernels.packed_gemm` ([N / 16, K / s, 16 s], bf16 as bits),
    met by AVX512 (`vdpbf16ps`, float32 FMAs)."""
    packed: object
    amx = False
    silu_epilogue_min_rows = SILU_EPILOGUE_MIN_ROWS

    def apply(self, x, rows=None, out_dtype=None):
        return packed_gemm.matmul(x, self.packed, out_dtype=out_dtype or x.dtype, rows=rows,
                                  amx=self.amx)

    def fuses(self, epilogue, x) -> bool:
        return (epilogue is SILU_MUL and x.dtype == jnp.bfloat16
                and x.shape[0] >= self.silu_epilogue_min_rows
                and packed_gemm.silu_mul_why_not(self.packed) is None)

    def apply_epilogue(self, x, epilogue, rows=None):
        if not self.fuses(epilogue, x):
            return super().apply_epilogue(x, epilogue, rows)
        return packed_gemm.silu_mul(x, self.packed, rows=rows, amx=self.amx)

    in_out = property(lambda self: packed_gemm.in_out_shape(self.packed))

    def to_float(self):
        return packed_gemm.unpack(self.packed)

    @classmethod
    def of(cls, w, like) -> "Packed":
        """From [in, out] values; numpy stays numpy, a device array `like` goes back there."""
        packed = packed_gemm.pack(np.asarray(w))
        return cls(packed if isinstance(like, np.ndarray) else jnp.asarray(packed))


class AmxPacked(Packed):
    """The same bf16 matrix, as packed, met by the CPU's AMX tiles (`tdpbf16ps`). The tiles
    leave the epilogue's arithmetic the cheaper side from one row on: silu * up always fuses."""
    amx = True
    silu_epilogue_min_rows = 1


Packed = pytree_weight(Packed, ("packed",))
AmxPacked = pytree_weight(AmxPacked, ("packed",))


class W8A8(Linear):
    """int8 values [.., in, out] and scales [.., out] against activations quantized per token:
    the jnp reference (`pallas_kernels/w8a8.py`)."""
    values: object
    scale: object

    def _product(self, x2, out_dtype):
        return w8a8.w8a8_reference(x2, self.values, self.scale, out_dtype)

    def apply(self, x, rows=None, out_dtype=None):
        k, n = self.in_out
        y = self._product(x.reshape(-1, k), out_dtype or x.dtype)
        return y.reshape(*x.shape[:-1], n)

    in_out = property(lambda self: tuple(self.values.shape[-2:]))
    dtype_name = property(lambda self: "int8")

    def int8_values(self):
        return self.values

    def to_float(self):
        return self.values.astype(jnp.float32) * self.scale[..., None, :]

    @classmethod
    def of(cls, values, scale) -> "W8A8":
        """From int8 [in, out] values and [out] scales."""
        return cls(values, scale)


class OutInW8A8(W8A8):
    """int8 values [out, in] and scales [out]: XLA's int8 dot, the form XLA:CPU hands to
    oneDNN (AMX int8 tiles where the CPU has them); the reference's product otherwise."""

    def _product(self, x2, out_dtype):
        return w8a8.w8a8_reference(x2, self.values, self.scale, out_dtype, w_out_in=True)

    in_out = property(lambda self: tuple(self.values.shape[::-1]))

    def int8_values(self):
        return self.values.T

    def to_float(self):
        return self.int8_values().astype(jnp.float32) * self.scale[None, :]

    @classmethod
    def of(cls, values, scale) -> "OutInW8A8":
        """From int8 [in, out] values (numpy transposed on the host) and [out] scales."""
        return cls(np.ascontiguousarray(values.T) if isinstance(values, np.ndarray)
                   else jnp.transpose(values), scale)


class PallasW8A8(W8A8):
    """The same on a GPU: the Pallas int8 MMA kernel."""

    def _product(self, x2, out_dtype):
        if w8a8.why_not(*self.values.shape[-2:]) is not None:   # the reference's, exactly
            return super()._product(x2, out_dtype)
        return w8a8.w8a8_matmul(x2, self.values, self.scale, out_dtype=jnp.dtype(out_dtype))


class PackedW8A8(Linear):
    """int8 values packed for `cpu_kernels.w8a8_gemm` ([N / 16, K / 4, 64]), the columns' scales
    and offset shares."""
    values: object
    scale: object
    comp: object
    amx = False
    silu_epilogue_min_rows = SILU_EPILOGUE_MIN_ROWS

    def _packed(self) -> w8a8_gemm.PackedInt8:
        return w8a8_gemm.PackedInt8(self.values, self.scale, self.comp)

    def apply(self, x, rows=None, out_dtype=None):
        return w8a8_gemm.matmul(x, self._packed(), out_dtype=out_dtype or x.dtype, rows=rows,
                                amx=self.amx)

    def fuses(self, epilogue, x) -> bool:
        return (epilogue is SILU_MUL and x.dtype == jnp.bfloat16
                and x.shape[0] >= self.silu_epilogue_min_rows
                and w8a8_gemm.silu_mul_why_not(self._packed()) is None)

    def apply_epilogue(self, x, epilogue, rows=None):
        if not self.fuses(epilogue, x):
            return super().apply_epilogue(x, epilogue, rows)
        return w8a8_gemm.silu_mul(x, self._packed(), rows=rows, amx=self.amx)

    in_out = property(lambda self: w8a8_gemm.in_out_shape(self.values))
    dtype_name = property(lambda self: "int8")

    def int8_values(self):
        return w8a8_gemm.unpack(self.values)

    def to_float(self):
        return self.int8_values().astype(jnp.float32) * self.scale[None, :]

    @classmethod
    def of(cls, values, scale) -> "PackedW8A8":
        """From int8 [in, out] values and [out] scales; numpy stays numpy, device arrays go
        back to the device."""
        packed = w8a8_gemm.pack(np.asarray(values), np.asarray(scale))
        if not isinstance(values, np.ndarray):
            packed = jax.tree.map(jnp.asarray, packed)
        return cls(*packed)


class AmxPackedW8A8(PackedW8A8):
    """The same, met by the CPU's AMX int8 tiles (`tdpbusd`): the same int32 sums (and silu *
    up fused from one row, as `AmxPacked`)."""
    amx = True
    silu_epilogue_min_rows = 1


W8A8 = pytree_weight(W8A8, ("values", "scale"))
OutInW8A8 = pytree_weight(OutInW8A8, ("values", "scale"))
PallasW8A8 = pytree_weight(PallasW8A8, ("values", "scale"))
PackedW8A8 = pytree_weight(PackedW8A8, ("values", "scale", "comp"))
AmxPackedW8A8 = pytree_weight(AmxPackedW8A8, ("values", "scale", "comp"))
W8A8_KERNELS = {"amx": AmxPackedW8A8, "cpu": PackedW8A8, "xla": OutInW8A8,
                "pallas": PallasW8A8, "jnp": W8A8}
W8A8_FORMS = tuple(W8A8_KERNELS.values())
