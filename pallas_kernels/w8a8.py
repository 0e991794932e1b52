"""W8A8 matmul: int8 weights (one scale per output channel) against activations quantized to
int8 per token when the matmul runs, int32 accumulation (`quantization="w8a8"`).

    quantize_rows(x [M, K])        -> (q [M, K] int8, scale [M] float32): per token,
                                      q = round(x * (127 / max|x|)), scale = max|x| * float32(1 / 127)
                                      (a row of zeros: q = 0, scale 0)
    w8a8_reference(x, w, w_scale, out_dtype)
                                   the plain-jnp W8A8 matmul every kernel is checked against:
                                      (q @ w in int32) as float32 x (scale[m] x w_scale[n])
    w8a8_matmul(x, w, w_scale, out_dtype, interpret=False)
                                   the same as a Pallas kernel (GPU: int8 MMA into int32;
                                      interpret=True runs it anywhere, for tests)
    why_not(k, n)                  None where the kernel covers an int8 [k, n] weight

The CPU kernel (`cpu_kernels/w8a8_gemm.py`, `vpdpbusd`) computes the same float32 operations
in the same order, so it equals the reference bit for bit; every row's result depends on that
row alone (solo equals batched).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

INT8_MAX = 127.0
# A row's scale is max|x| times this float32 constant (XLA turns a division by a constant into
# this product; the CPU kernel computes the same product).
INV_INT8_MAX = np.float32(1) / np.float32(INT8_MAX)


def quantize_rows(x):
    """x [M, K] float -> (q [M, K] int8, scale [M] float32), one scale per row."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    inv = jnp.where(absmax > 0, INT8_MAX / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, absmax * INV_INT8_MAX


def dequantize_product(acc, x_scale, w_scale, out_dtype):
    """int32 [M, N] -> out_dtype: as float32, times (the row's scale x the column's). (XLA
    reassociates a product of two broadcasts into this order anyway.)"""
    return (acc.astype(jnp.float32) * (x_scale[:, None] * w_scale[None, :])).astype(out_dtype)


def w8a8_reference(x, w, w_scale, out_dtype=None, *, w_out_in: bool = False):
    """x [M, K] float, w [K, N] int8 ([N, K] where `w_out_in`: XLA:CPU's form), w_scale [N]
    float32 -> [M, N] in out_dtype (x's)."""
    q, x_scale = quantize_rows(x)
    acc = jax.lax.dot_general(q, w, (((1,), (1 if w_out_in else 0,)), ((), ())),
                              preferred_element_type=jnp.int32)                # [M, N]
    # The barrier keeps XLA from folding the convert into the dot (a float32 dot whose sums
    # round past 2^24): the int32 sums are exact, and converted once.
    acc = jax.lax.optimization_barrier(acc)
    return dequantize_product(acc, x_scale, w_scale, out_dtype or x.dtype)


def _kernel(q_ref, w_ref, xs_ref, ws_ref, o_ref, *, block_k: int):
    """One [block_m, block_n] output tile: the K axis in block_k steps (a whole panel would not
    fit a GPU's shared memory), int32 sums, then the float32 epilogue."""
    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + jnp.dot(q_ref[:, ks], w_ref[ks, :], preferred_element_type=jnp.int32)

    acc = jax.lax.fori_loop(0, q_ref.shape[1] // block_k, step,
                            jnp.zeros(o_ref.shape, jnp.int32))
    o_ref[...] = (acc.astype(jnp.float32) * (xs_ref[...] * ws_ref[...])).astype(o_ref.dtype)


def why_not(k: int, n: int, block_n: int = 128) -> str | None:
    """None where `w8a8_matmul` covers an int8 [k, n] weight, else why not."""
    if _block_k(k) is None or n % min(block_n, n):
        return f"a [{k}, {n}] weight: in not a multiple of 32 or out of {block_n}"
    return None


def _block_k(k: int) -> int | None:
    """The largest power-of-two step of K up to 256 that divides it (Triton's int8 dots take
    32 and up), or None."""
    return next((b for b in (256, 128, 64, 32) if k % b == 0), None)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "interpret"))
def w8a8_matmul(x, w, w_scale, out_dtype=None, block_m: int = 16, block_n: int = 128,
                interpret: bool = False):
    """The Pallas W8A8 matmul: x [M, K] float, w [K, N] int8, w_scale [N] -> [M, N]. The rows
    are quantized first (one pass, `quantize_rows`); each program multiplies a [block_m, K]
    tile of them by a [K, block_n] weight panel, block_k columns at a time, with int32
    accumulation. The Triton backend on a GPU (its compiler parameters select it)."""
    from pallas_kernels.paged_decode import compiler_params
    m, k = x.shape
    n = w.shape[1]
    if w.shape[0] != k or w_scale.shape != (n,):
        raise ValueError(f"w8a8_matmul: x [M, {k}], w [{k}, N], w_scale [N] expected, got "
                         f"{x.shape}, {w.shape}, {w_scale.shape}")
    if w.dtype != jnp.int8:
        raise ValueError(f"w8a8_matmul: int8 weights expected, got {w.dtype}")
    block_k = _block_k(k)
    if block_k is None:
        raise ValueError(f"w8a8_matmul: K={k} is not a multiple of 32")
    out_dtype = out_dtype or x.dtype
    q, x_scale = quantize_rows(x)
    pad_m = -m % block_m
    q = jnp.pad(q, ((0, pad_m), (0, 0)))
    xs = jnp.pad(x_scale, (0, pad_m))[:, None]                               # [M', 1]
    bn = min(block_n, n)
    if n % bn:
        raise ValueError(f"w8a8_matmul: N={n} is not a multiple of block_n={bn}")
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(q.shape[0] // block_m, n // bn),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((block_m, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((q.shape[0], n), out_dtype),
        compiler_params=None if interpret else compiler_params(num_warps=4, num_stages=3),
        interpret=interpret,
    )(q, w, xs, w_scale[None, :].astype(jnp.float32))
    return out[:m]
