"""The GEMM kernels' AMX variants (`packed_gemm.cc`, `tdpbf16ps` / `tdpbusd` over the weights as
packed for AVX512): bf16 against the reference within float32 rounding, its bf16 output and
silu * up epilogue as the AVX512 kernel's are to their references, int8 equal bit for bit to
the VNNI kernel; padding rows zero; a row's result the same alone, in a decode-sized call and
in a prefill-sized one; and an engine on them agreeing with one on AVX512. Skipped where this
CPU has no AMX."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import packed_gemm, w8a8_gemm

REASON = packed_gemm.amx_why_not() or w8a8_gemm.amx_why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no AMX tiles here: {REASON}")


def _case(seed, m, k, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(jnp.bfloat16)
    w = rng.standard_normal((k, n)).astype(jnp.bfloat16)
    return x, w


def _amx(fn, **kw):
    return jax.jit(lambda x, w, rows=None: fn(x, w, rows=rows, amx=True, **kw))


# (m, k, n): decode calls (m <= 16) of 1..6 blocks in the last unit, prefill calls of one or
# two row groups in the last pass, of one k chunk or several and units of 1..16 blocks, and a k
# that is no whole tile step (the AVX512 path runs)
SHAPES = [(1, 32, 16), (5, 576, 960), (16, 96, 112), (17, 64, 32), (40, 576, 80),
          (64, 128, 48), (3, 48, 32), (40, 1088, 272)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bf16_matches_the_reference_within_float32_rounding(m, k, n):
    x, w = _case(m * 31 + n, m, k, n)
    out = np.asarray(_amx(packed_gemm.matmul)(jnp.asarray(x), jnp.asarray(packed_gemm.pack(w))))
    ref = np.asarray(jnp.dot(jnp.asarray(x), jnp.asarray(w), preferred_element_type=jnp.float32))
    magnitude = np.abs(x.astype(np.float32)) @ np.abs(w.astype(np.float32))
    assert out.dtype == np.float32 and out.shape == (m, n)
    assert np.all(np.abs(out - ref) <= 4 * k * np.finfo(np.float32).eps * magnitude)


@pytest.mark.parametrize("m,k,n", [(5, 576, 960), (40, 576, 96), (33, 1088, 576)])
def test_bf16_out_and_silu_mul_are_the_float32_result_rounded_and_activated(m, k, n):
    from jaxbatch.model.linear import activation
    x, w = _case(m + n, m, k, n)
    x = (x.astype(np.float32) * 4).astype(jnp.bfloat16)
    x, packed = jnp.asarray(x), jnp.asarray(packed_gemm.pack(w))
    f32 = _amx(packed_gemm.matmul)(x, packed)
    bf16 = _amx(packed_gemm.matmul, out_dtype=jnp.bfloat16)(x, packed)
    np.testing.assert_array_equal(np.asarray(bf16).view(np.uint16),
                                  np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
    gate, up = jnp.split(bf16, 2, axis=-1)
    np.testing.assert_array_equal(
        np.asarray(_amx(packed_gemm.silu_mul)(x, packed)).view(np.uint16),
        np.asarray(activation(gate, "silu") * up).view(np.uint16))


def test_a_row_alone_equals_the_row_in_decode_and_prefill_calls():
    x, w = _case(11, 256, 576, 192)
    packed = jnp.asarray(packed_gemm.pack(w))
    kernel = _amx(packed_gemm.matmul)
    batch = np.asarray(kernel(jnp.asarray(x), packed))
    for start, rows in ((0, 1), (13, 1), (5, 16), (30, 17), (100, 40), (0, 64)):
        part = np.asarray(kernel(jnp.asarray(x[start:start + rows]), packed))
        np.testing.assert_array_equal(part, batch[start:start + rows])


@pytest.mark.parametrize("m,rows", [(9, 0), (9, 5), (16, 16), (40, 33), (40, 17), (6, -3)])
def test_padding_rows_are_zero_whatever_they_hold(m, rows):
    kept = min(max(rows, 0), m)
    x, w = _case(m + rows, m, 576, 96)
    x[kept:] = np.nan
    x, packed = jnp.asarray(x), jnp.asarray(packed_gemm.pack(w))
    for fn in (_amx(packed_gemm.matmul), _amx(packed_gemm.silu_mul)):
        whole = np.asarray(fn(x, packed))
        part = np.asarray(fn(x, packed, jnp.int32(rows)))
        np.testing.assert_array_equal(part[:kept], whole[:kept])
        assert not part[kept:].any()


@pytest.mark.parametrize("m,k,n,rows", [(1, 64, 32, None), (5, 576, 960, None),
                                        (16, 192, 96, 11), (40, 128, 64, 33),
                                        (64, 576, 160, None), (3, 96, 48, None),
                                        (40, 2176, 576, 37)])
def test_int8_equals_the_vnni_kernel_bit_for_bit(m, k, n, rows):
    rng = np.random.default_rng(m * k + n)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(jnp.bfloat16))
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    packed = jax.tree.map(jnp.asarray, w8a8_gemm.pack(w, rng.random(n).astype(np.float32)))
    calls = [lambda x, p, **kw: w8a8_gemm.matmul(x, p, jnp.bfloat16, **kw),
             lambda x, p, **kw: w8a8_gemm.matmul(x.astype(jnp.float32), p, jnp.float32, **kw)]
    if n % 32 == 0:
        calls.append(w8a8_gemm.silu_mul)
    for call in calls:
        vnni = jax.jit(lambda x, p: call(x, p, rows=rows))(x, packed)
        amx = jax.jit(lambda x, p: call(x, p, rows=rows, amx=True))(x, packed)
        np.testing.assert_array_equal(np.asarray(amx).view(np.uint8),
                                      np.asarray(vnni).view(np.uint8))


def test_the_engine_on_amx_tiles_agrees_with_the_avx512_kernel_and_batch_invariance_holds():
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    prompts, params = greedy_case()
    amx = tiny_engine_in(jnp.bfloat16, cpu_gemm="amx")
    assert amx.stats()["matmuls"] == "cpu_kernels.packed_gemm (AMX)"
    assert "AMX tiles" in amx.stats()["kernels"]["matmul"]
    outs = run_all(amx, prompts, params)
    solo = run_all(amx, prompts[2:3], params[2:3])
    assert solo[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    avx512 = tiny_engine_in(jnp.bfloat16, cpu_gemm="packed")
    assert avx512.stats()["matmuls"] == "cpu_kernels.packed_gemm"
    agree = tokens_agreeing(outs, run_all(avx512, prompts, params), logprob_tol=1e-2)
    assert agree >= 36, f"only {agree} of 40 greedy tokens agree before a divergence"

