"""The CPU W8A8 GEMM (`cpu_kernels/w8a8_gemm.py`, `vpdpbusd` in `packed_gemm.cc`) against its
reference `pallas_kernels.w8a8.w8a8_reference`, bit for bit; the Pallas kernel (interpret
mode) against the same; the packing; rows past `rows`; a row's result whatever the batch.
The kernel half is skipped, with the reason, where it cannot run (no AVX512-VNNI, no g++)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import w8a8_gemm
from jaxbatch.model.linear import activation
from pallas_kernels.int8 import quantize_int8
from pallas_kernels.w8a8 import quantize_rows, w8a8_matmul, w8a8_reference

REASON = w8a8_gemm.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def _case(seed, m, k, n, dtype, spread=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * spread).astype(np.float32)
    x[:, rng.integers(0, k)] *= 20.0                       # an outlier channel, as LLMs have
    wq, ws = quantize_int8(rng.standard_normal((k, n)).astype(np.float32) * 0.05, axis=-2)
    return jnp.asarray(x, dtype), wq, ws


def _device(packed):
    return jax.tree.map(jnp.asarray, packed)


_kernel = jax.jit(w8a8_gemm.matmul, static_argnames=("out_dtype",))
_reference = jax.jit(w8a8_reference, static_argnames=("out_dtype",))

SHAPES = [(1, 4, 16), (3, 60, 32), (8, 64, 48), (9, 576, 64), (17, 96, 80), (5, 576, 960),
          (16, 2048, 3072),     # sums past 2^24: exact in int32, not in a float32 dot
          (4, 4096, 112)]


@needs_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_equals_its_reference_bit_for_bit(m, k, n, dtype):
    x, wq, ws = _case(m * 1000 + n, m, k, n, dtype)
    out = _kernel(x, _device(w8a8_gemm.pack(wq, ws)))
    ref = _reference(x, jnp.asarray(wq), jnp.asarray(ws))
    assert out.dtype == dtype and out.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


@needs_kernel
def test_silu_mul_epilogue_equals_the_activation_of_the_reference_products():
    m, k, i = 40, 192, 96
    x, wq, ws = _case(5, m, k, 2 * i, jnp.bfloat16)
    out = jax.jit(w8a8_gemm.silu_mul)(x, _device(w8a8_gemm.pack(wq, ws)))
    both = _reference(x, jnp.asarray(wq), jnp.asarray(ws))                  # [m, 2 i] bf16
    ref = activation(both[:, :i], "silu") * both[:, i:]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


@needs_kernel
def test_a_rows_result_depends_on_that_row_alone_and_padding_rows_are_zero():
    x, wq, ws = _case(7, 24, 256, 64, jnp.bfloat16)
    packed = _device(w8a8_gemm.pack(wq, ws))
    full = np.asarray(_kernel(x, packed), np.float32)
    for r in (0, 9, 23):
        solo = np.asarray(_kernel(x[r:r + 1], packed), np.float32)
        np.testing.assert_array_equal(solo[0], full[r])
    garbage = x.at[10:].set(jnp.nan)
    part = np.asarray(jax.jit(lambda x, p: w8a8_gemm.matmul(x, p, rows=10))(garbage, packed),
                      np.float32)
    np.testing.assert_array_equal(part[:10], full[:10])
    assert not part[10:].any()


@needs_kernel
def test_a_row_of_zeros_gives_zeros():
    x, wq, ws = _case(8, 3, 64, 32, jnp.float32)
    x = x.at[1].set(0.0)
    out = np.asarray(_kernel(x, _device(w8a8_gemm.pack(wq, ws))))
    assert not out[1].any() and np.isfinite(out).all()


def test_pack_puts_each_value_where_the_kernel_reads_it_and_unpack_inverts_it():
    _, wq, ws = _case(3, 1, 8, 32, jnp.float32)
    packed = w8a8_gemm.pack(wq, ws)
    assert packed.values.shape == (2, 2, 64) and packed.values.dtype == np.int8
    # element [b, p, 4 j + t] = w[4 p + t, 16 b + j]
    assert packed.values[1, 1, 4 * 5 + 3] == wq[4 * 1 + 3, 16 * 1 + 5]
    np.testing.assert_array_equal(w8a8_gemm.unpack(packed.values), wq)
    np.testing.assert_array_equal(packed.comp, 128 * wq.astype(np.int64).sum(axis=0))


@needs_kernel
def test_the_kernel_refuses_operands_that_do_not_fit():
    x, wq, ws = _case(4, 2, 64, 32, jnp.float32)
    packed = w8a8_gemm.pack(wq, ws)
    short = w8a8_gemm.PackedInt8(packed.values, packed.scale[:16], packed.comp)
    with pytest.raises(Exception, match="w8a8_gemm"):
        jax.block_until_ready(_kernel(x, _device(short)))
    with pytest.raises(ValueError, match="x \\[.., 64\\] expected"):
        w8a8_gemm.matmul(x[:, :32], _device(packed))


def test_quantize_rows_is_per_token_and_within_half_a_step():
    x, _, _ = _case(9, 6, 128, 16, jnp.float32)
    q, scale = quantize_rows(x)
    assert q.dtype == jnp.int8 and scale.shape == (6,)
    assert int(jnp.max(jnp.abs(q))) == 127
    err = np.abs(np.asarray(q, np.float32) * np.asarray(scale)[:, None] - np.asarray(x))
    assert (err <= np.asarray(scale)[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("m,k,n", [(20, 256, 256), (5, 576, 384)])
def test_pallas_kernel_in_interpret_mode_equals_the_reference(m, k, n):
    x, wq, ws = _case(11, m, k, n, jnp.float32)
    out = w8a8_matmul(x, jnp.asarray(wq), jnp.asarray(ws), interpret=True)
    ref = _reference(x, jnp.asarray(wq), jnp.asarray(ws))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
