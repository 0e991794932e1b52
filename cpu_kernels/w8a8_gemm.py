"""W8A8 x @ W on CPUs with AVX512-VNNI (`vpdpbusd`): int8 weights packed once at load time,
each call's activations quantized per row inside the kernel, int32 sums; XLA FFI custom calls
of `packed_gemm.cc`, whose reference is `pallas_kernels.w8a8.w8a8_reference` (bit for bit: the
same float32 operations in the same order).

    why_not(k, n)            None where the kernel covers an int8 [k, n] weight here
    pack(w [K, N] int8, w_scale [N]) -> PackedInt8: the packed values, the scales, and each
                             column's offset share (numpy in, numpy out)
    unpack(packed_values)    -> w [K, N] int8
    matmul(x [.., K], packed, out_dtype, rows=None) -> [.., N]: x bf16 or float32; out
                             float32, or bf16 for bf16 x
    silu_mul(x [.., K] bf16, packed [gate | up], rows=None) -> [.., N / 2] bf16: silu(gate) *
                             up, rounded as the bf16 GEMM's epilogue rounds
    `rows`: as packed_gemm's (x's rows past it are padding: not computed, zero out)
    `amx`: the same weights met by the CPU's AMX int8 tiles (`tdpbusd`): the same int32 sums,
                             so the same bits; `amx_why_not()` says where it cannot run
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import availability, packed_gemm

SOURCE = "packed_gemm.cc"
BLOCK = 16                      # output columns per packed block
PER_STEP = 4                    # k values per 32-bit lane (`vpdpbusd`)
OFFSET = 128                    # x's int8 values are offset to unsigned
_F32 = ("JaxbatchW8A8Gemm", "jaxbatch_w8a8_gemm")
_BF16 = ("JaxbatchW8A8GemmBf16", "jaxbatch_w8a8_gemm_bf16")
_SILU_MUL = ("JaxbatchW8A8GemmSiluMul", "jaxbatch_w8a8_gemm_silu_mul")
TARGETS = (_F32[1], _BF16[1], _SILU_MUL[1])
TARGETS += tuple(availability.amx_variant("", target)[1] for target in TARGETS)


class PackedInt8(NamedTuple):
    values: object      # [N / 16, K / 4, 64] int8: element [b, p, 4 j + t] = w[4 p + t, 16 b + j]
    scale: object       # [N] float32
    comp: object        # [N] int32: OFFSET x sum_k w[k, n]


def unavailable_reason() -> str | None:
    for symbol, target in (_F32, _BF16, _SILU_MUL):
        reason = availability.unavailable_reason(SOURCE, symbol, target)
        if reason:
            return reason
    amx_why_not()           # registers the AMX variants where they run (a stored step may call one)
    return None


def amx_why_not() -> str | None:
    """None where the AMX variants run here, else why not."""
    return availability.amx_variants_why_not(SOURCE, (_F32, _BF16, _SILU_MUL))


def why_not(k: int, n: int) -> str | None:
    if n % BLOCK or k % PER_STEP or not k or not n:
        return f"a [{k}, {n}] weight: out not a multiple of {BLOCK} or in not of {PER_STEP}"
    return unavailable_reason()


def amx_covers(k: int) -> bool:
    """Whether the AMX variant meets a [k, n] weight with tiles: k whole tile steps (16 k
    quads); elsewhere the call runs the VNNI loop inside."""
    return k % (packed_gemm.TILE_ROWS * PER_STEP) == 0


def pack(w: np.ndarray, w_scale: np.ndarray) -> PackedInt8:
    w = np.asarray(w)
    if w.dtype != np.int8:
        raise ValueError(f"w8a8_gemm.pack: int8 weights expected, got {w.dtype}")
    k, n = w.shape
    values = np.ascontiguousarray(
        w.reshape(k // PER_STEP, PER_STEP, n // BLOCK, BLOCK).transpose(2, 0, 3, 1)
    ).reshape(n // BLOCK, k // PER_STEP, BLOCK * PER_STEP)
    comp = (OFFSET * w.astype(np.int64).sum(axis=0)).astype(np.int32)
    return PackedInt8(values, np.asarray(w_scale, np.float32), comp)


def in_out_shape(values) -> tuple[int, int]:
    return values.shape[1] * PER_STEP, values.shape[0] * BLOCK


def unpack(values):
    """The packed values back to w [K, N] int8 (numpy or jax)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    blocks, steps, _ = values.shape
    w = xp.transpose(values.reshape(blocks, steps, BLOCK, PER_STEP), (1, 3, 0, 2))
    return w.reshape(steps * PER_STEP, blocks * BLOCK)


def _call(handler, x, packed: PackedInt8, out_cols: int, out_dtype, rows, amx):
    symbol, target = handler
    if amx:
        reason = amx_why_not()
        if reason:
            raise RuntimeError(f"w8a8_gemm's AMX variant cannot run here: {reason}")
        symbol, target = availability.amx_variant(symbol, target)
    k, _ = in_out_shape(packed.values)
    if x.shape[-1] != k:
        raise ValueError(f"w8a8_gemm: x [.., {k}] expected, got {x.shape}")
    reason = availability.register(SOURCE, symbol, target)
    if reason:
        raise RuntimeError(f"w8a8_gemm cannot run here: {reason}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    rows = (np.full((1,), x2.shape[0], np.int32) if rows is None
            else jnp.reshape(jnp.asarray(rows, jnp.int32), (1,)))
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], out_cols), out_dtype))(
        x2, packed.values, packed.scale, packed.comp, rows)
    return y.reshape(*lead, out_cols)


def matmul(x, packed: PackedInt8, out_dtype=None, rows=None, amx=False):
    """x [.., K] bf16 or float32 -> [.., N]: bf16 x gives bf16 (rounded in the kernel, as the
    reference's convert rounds), float32 x or out_dtype float32 (logits) float32 (the same
    quantized rows: a bf16 value is exact in float32); then `out_dtype`."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    _, n = in_out_shape(packed.values)
    if x.dtype == jnp.bfloat16 and out_dtype != jnp.float32:
        return _call(_BF16, x, packed, n, jnp.bfloat16, rows, amx).astype(out_dtype)
    y = _call(_F32, x.astype(jnp.float32), packed, n, jnp.float32, rows, amx)
    return y.astype(out_dtype)


def silu_mul_why_not(packed: PackedInt8) -> str | None:
    if packed.values.shape[0] % 2:
        return f"{packed.values.shape[0]} column blocks: gate and up not {BLOCK}-column blocks each"
    return unavailable_reason()


def silu_mul(x, packed: PackedInt8, rows=None, amx=False):
    """x [.., K] bf16 @ [gate | up] -> [.., N / 2] bf16 silu(gate) * up (the bf16 GEMM's
    epilogue on the dequantized products)."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"w8a8_gemm.silu_mul: bf16 x expected, got {x.dtype}")
    _, n = in_out_shape(packed.values)
    return _call(_SILU_MUL, x, packed, n // 2, jnp.bfloat16, rows, amx)
