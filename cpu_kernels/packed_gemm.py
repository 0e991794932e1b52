"""x @ W on CPU over a weight packed once at load time (`packed_gemm.cc`); its reference is
`jnp.dot(x, W, preferred_element_type=float32)` with x in W's dtype.

XLA:CPU runs a dot of a few rows well under the machine's bf16 rate; the kernel reads the
packed weight as one stream of 64-byte lines, each met by every row in registers, and sums each
output in k order whatever the batch (so a row's result is the same solo or batched).

    unavailable_reason()     None where the kernel runs on this machine, else why not
    why_not(dtype, k, n)     None where it covers a [k, n] weight of `dtype` here
    pack(w [K, N])           -> the packed weight (numpy in, numpy out; bf16 as uint16 bits)
    unpack(packed)           -> w [K, N] (bf16 from bits), for whoever needs the plain matrix
    in_out_shape(packed)     -> (K, N)
    matmul(x [.., K], packed, out_dtype=float32, rows=None) -> [.., N] in out_dtype
    silu_mul(x [.., K], packed [gate | up], rows=None) -> [.., N / 2] bf16: silu(x @ gate) *
                             (x @ up), the MLP's activation as the GEMM's epilogue (bf16 only)
    `rows` (an int32 scalar, may be traced): x's rows (flattened) past it are padding, not
                             computed: their outputs are zero. None: every row is computed.
    `amx` (bf16 weights): the same weights met by the CPU's AMX tiles (`tdpbf16ps`) instead
                             of AVX512-BF16; `amx_why_not()` says where it cannot run. Each
                             row's sums are in k order either way, so batch invariance holds
                             for each; the two agree to float32 rounding.
    silu_mul_why_not(packed) None where `silu_mul` covers this packed weight here
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import availability

SOURCE = "packed_gemm.cc"
# packed element type -> (handler symbol, FFI target, x's dtype, k values per 64-byte lane pair)
_HANDLERS = {jnp.dtype(jnp.uint16): ("JaxbatchPackedGemm", "jaxbatch_packed_gemm",
                                     jnp.bfloat16, 2),
             jnp.dtype(jnp.float32): ("JaxbatchPackedGemmF32", "jaxbatch_packed_gemm_f32",
                                      jnp.float32, 1)}
# bf16 weights, bf16 x, the result rounded to bf16 in the kernel (a bf16 model's layers)
_BF16_OUT = ("JaxbatchPackedGemmBf16Out", "jaxbatch_packed_gemm_bf16_out")
# bf16 [gate | up] weights, bf16 x -> silu(gate) * up in bf16 (a bf16 model's MLP)
_SILU_MUL = ("JaxbatchPackedGemmSiluMul", "jaxbatch_packed_gemm_silu_mul")
TARGETS = tuple(target for _, target, _, _ in _HANDLERS.values()) + (_BF16_OUT[1], _SILU_MUL[1])
TARGETS += tuple(availability.amx_variant("", target)[1] for target in (TARGETS[0],) + TARGETS[2:])
BLOCK = 16                                  # output columns per packed block (one zmm of f32)
TILE_ROWS = 16                              # k steps of an AMX B tile (packed_gemm.cc, kTileRows)
_STORED = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(jnp.float32):
           jnp.dtype(jnp.float32)}


def unavailable_reason() -> str | None:
    for symbol, target in [h[:2] for h in _HANDLERS.values()] + [_BF16_OUT, _SILU_MUL]:
        reason = availability.unavailable_reason(SOURCE, symbol, target)
        if reason:
            return reason
    amx_why_not()           # registers the AMX variants where they run (a stored step may call one)
    return None


def amx_why_not() -> str | None:
    """None where the bf16 handlers' AMX variants run here, else why not."""
    return availability.amx_variants_why_not(
        SOURCE, (_HANDLERS[jnp.dtype(jnp.uint16)][:2], _BF16_OUT, _SILU_MUL))


def _variant(symbol: str, target: str, amx: bool) -> tuple[str, str]:
    if not amx:
        return symbol, target
    reason = amx_why_not()
    if reason:
        raise RuntimeError(f"packed_gemm's AMX variant cannot run here: {reason}")
    return availability.amx_variant(symbol, target)


def why_not(dtype, k: int, n: int) -> str | None:
    dtype = jnp.dtype(dtype)
    if dtype not in _STORED:
        return f"{dtype.name} weights, neither bf16 nor float32"
    per_step = _HANDLERS[_STORED[dtype]][3]
    if n % BLOCK or k % per_step or not k or not n:
        return f"a [{k}, {n}] weight: out not a multiple of {BLOCK} or in not of {per_step}"
    return unavailable_reason()


def amx_covers(dtype, k: int) -> bool:
    """Whether the AMX variant meets a [k, n] weight with tiles: bf16, k whole tile steps (16
    pairs); elsewhere the call runs the AVX512 loop inside, whatever it is asked."""
    per_step = _HANDLERS[_STORED[jnp.dtype(jnp.bfloat16)]][3]
    return jnp.dtype(dtype) == jnp.bfloat16 and k % (TILE_ROWS * per_step) == 0


def pack(w: np.ndarray) -> np.ndarray:
    """w [K, N] (bf16 or float32, numpy) -> [N / 16, K / s, 16 s] with s k values per lane:
    element [b, p, s j + t] = w[s p + t, 16 b + j]."""
    w = np.asarray(w)
    stored = _STORED[jnp.dtype(w.dtype)]
    per_step = _HANDLERS[stored][3]
    k, n = w.shape
    bits = w.view(stored)
    packed = bits.reshape(k // per_step, per_step, n // BLOCK, BLOCK)     # [p, t, b, j]
    return np.ascontiguousarray(packed.transpose(2, 0, 3, 1)).reshape(
        n // BLOCK, k // per_step, BLOCK * per_step)


def in_out_shape(packed) -> tuple[int, int]:
    per_step = _HANDLERS[jnp.dtype(packed.dtype)][3]
    return packed.shape[1] * per_step, packed.shape[0] * BLOCK


def unpack(packed):
    """The inverse of `pack` (numpy or jax arrays): [K, N] in the weight's float dtype."""
    per_step = _HANDLERS[jnp.dtype(packed.dtype)][3]
    xp = np if isinstance(packed, np.ndarray) else jnp
    blocks, steps, _ = packed.shape
    w = xp.transpose(packed.reshape(blocks, steps, BLOCK, per_step), (1, 3, 0, 2))
    w = w.reshape(steps * per_step, blocks * BLOCK)
    if per_step == 1:
        return w
    return w.view(jnp.bfloat16) if xp is np else jax.lax.bitcast_convert_type(w, jnp.bfloat16)


def _rows_operand(rows, m: int):
    """[1] int32: the rows to compute, of m."""
    if rows is None:
        return np.full((1,), m, np.int32)
    return jnp.reshape(jnp.asarray(rows, jnp.int32), (1,))


def matmul(x, packed, out_dtype=jnp.float32, rows=None, amx=False):
    """x [.., K] @ the packed [K, N] weight -> [.., N] float32, accumulated in float32 (x cast
    to the weight's dtype). `out_dtype` bf16 with bf16 weights: the kernel rounds the result to
    bf16 itself (as `.astype(bfloat16)` would, without a pass over the float32 result)."""
    symbol, target, x_dtype, _ = _HANDLERS[jnp.dtype(packed.dtype)]
    result_dtype = jnp.dtype(jnp.float32)
    if jnp.dtype(out_dtype) == jnp.bfloat16 and x_dtype == jnp.bfloat16:
        (symbol, target), result_dtype = _BF16_OUT, jnp.dtype(jnp.bfloat16)
    k, n = in_out_shape(packed)
    if x.shape[-1] != k:
        raise ValueError(f"packed_gemm: x [.., {k}] expected, got {x.shape}")
    if amx and x_dtype != jnp.bfloat16:
        raise ValueError("packed_gemm: the AMX variant takes bf16 weights")
    symbol, target = _variant(symbol, target, amx)
    reason = availability.register(SOURCE, symbol, target)
    if reason:
        raise RuntimeError(f"packed_gemm cannot run here: {reason}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(x_dtype)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), result_dtype))(
        x2, packed, _rows_operand(rows, x2.shape[0]))
    return y.reshape(*lead, n).astype(out_dtype)


def silu_mul_why_not(packed) -> str | None:
    """None where `silu_mul` covers this packed [gate | up] weight on this machine."""
    if jnp.dtype(packed.dtype) != jnp.uint16:
        return f"{jnp.dtype(packed.dtype).name} weights, not bf16"
    if packed.shape[0] % 2:
        return f"{packed.shape[0]} column blocks: gate and up not {BLOCK}-column blocks each"
    return unavailable_reason()


def silu_mul(x, packed, rows=None, amx=False):
    """x [.., K] bf16 @ the packed bf16 [K, 2 I] weight [gate | up] -> [.., I] bf16:
    silu(gate) * up as `jaxbatch.model.layers.activation` computes it on the bf16 gate and up
    (its reference: `matmul(x, packed, bfloat16)` split in two, then that activation times up)."""
    reason = silu_mul_why_not(packed)
    if reason:
        raise RuntimeError(f"packed_gemm.silu_mul cannot run here: {reason}")
    k, n = in_out_shape(packed)
    if x.shape[-1] != k:
        raise ValueError(f"packed_gemm: x [.., {k}] expected, got {x.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    target = _variant(*_SILU_MUL, amx)[1]
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n // 2), jnp.bfloat16))(
        x2, packed, _rows_operand(rows, x2.shape[0]))
    return y.reshape(*lead, n // 2)
