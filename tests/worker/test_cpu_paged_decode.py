"""The CPU decode-attention kernels (`cpu_kernels/paged_decode.cc`, bf16 and float32 pages)
against their reference, the
XLA-CPU work-list attention (`paged_decode_attention_xla`), on the same random paged inputs
(NaN in every pool slot a case does not fill, `test_xla_attention._decode_case`), and inside
the engine. Skipped, with the reason, where the kernel cannot run (no AVX512-BF16, no g++)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_decode
from pallas_kernels.reference import BF16_BITS, keys_as_stored
from pallas_kernels.xla_paged_attention import paged_decode_attention_xla
from test_xla_attention import _decode_case

REASON = paged_decode.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

_kernel = jax.jit(paged_decode.paged_decode_attention)
_xla = jax.jit(paged_decode_attention_xla)


def _as_bits(pool):
    return jax.lax.bitcast_convert_type(pool, BF16_BITS)


def _bf16_pool(k, v):
    """float pages -> a bf16 pool as the engine stores it: bits, the keys grouped."""
    return keys_as_stored(_as_bits(k), k.shape[2]), _as_bits(v)


CASES = [
    # (seed, num_heads, num_kv_heads, head_dim, block_size, padding items, pages per item)
    (21, 9, 3, 64, 16, 3, 8),       # SmolLM2's shapes
    (22, 4, 4, 128, 32, 9, 2),      # GQA 1
    (23, 8, 2, 64, 32, 12, 8),      # GQA 4, long slots across items
    (24, 4, 2, 16, 16, 0, 1),       # the tiny test model's head_dim: a partial D chunk
    (25, 32, 8, 128, 16, 5, 4),     # Llama-3.1-8B's heads
    (26, 16, 2, 80, 8, 2, 4),       # GQA 8; head_dim 80: a partial 32-block after a full one;
                                    # pages of 8 keys: every block of keys short
    (27, 12, 2, 96, 16, 1, 2),      # GQA 6: the group not fixed at compile time; 3 blocks of D
]


# The largest error relative to the output's largest value: bf16 outputs carry 8 bits, and
# the bf16 kernel rounds its probabilities to bf16 for p.V; float32 sums in another order only.
TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float32: 2e-5}


@pytest.mark.parametrize("seed,heads,kv_heads,head_dim,block_size,extra,ppi", CASES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_its_reference(seed, heads, kv_heads, head_dim, block_size, extra, ppi,
                                      window, dtype):
    (q, k, v, *items, lengths), _, lens = _decode_case(seed, heads, kv_heads, head_dim,
                                                       block_size, dtype, extra, ppi)
    if dtype == jnp.bfloat16:
        k, v = _bf16_pool(k, v)
    scale = 0.3
    out = _kernel(q, k, v, *items, lengths, scale=scale, window=window)
    ref = _xla(q, k, v, *items, lengths, scale=scale, window=window)
    assert out.dtype == q.dtype and out.shape == q.shape
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), f"seed={seed}: NaN from a masked key or value"
    err = np.abs(out32 - ref32).max() / np.abs(ref32).max()
    assert err < TOLERANCE[dtype], f"seed={seed} window={window}: relative error {err:.3g}"
    assert (out32[lens == 0] == 0).all(), f"seed={seed}: empty rows must give exactly zero"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    """Batch invariance: each row's result depends on its own keys only."""
    (q, k, v, item_slot, item_pages, item_first, lengths), _, lens = _decode_case(
        31, 9, 3, 64, 16, dtype, 4, 2)
    if dtype == jnp.bfloat16:
        k, v = _bf16_pool(k, v)
    full = np.asarray(_kernel(q, k, v, item_slot, item_pages, item_first, lengths), np.float32)
    for row in np.flatnonzero(lens > 0):
        keep = np.asarray(item_slot) == row
        # the row's items alone, as row 0 of a one-row call, padded like a real bucket
        slot = np.where(keep, 0, 1)[np.argsort(~keep, kind="stable")]
        order = np.argsort(~keep, kind="stable")
        alone = _kernel(q[row:row + 1], k, v, jnp.asarray(slot, jnp.int32),
                        item_pages[order], item_first[order], lengths[row:row + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], full[row])


def test_a_bf16_q_over_bf16_pages_gets_the_float32_result_rounded_to_bf16():
    """The bf16-out handler: exactly the float32-out handler's result (a float32 q holding the
    same values, over the same bf16 pages) rounded to nearest even, bit for bit."""
    (q, k, v, *items, lengths), _, _ = _decode_case(32, 9, 3, 64, 16, jnp.bfloat16, 3, 8)
    k, v = _bf16_pool(k, v)
    out = _kernel(q, k, v, *items, lengths, scale=0.3)
    wide = _kernel(q.astype(jnp.float32), k, v, *items, lengths, scale=0.3)
    assert out.dtype == jnp.bfloat16 and wide.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  np.asarray(wide.astype(jnp.bfloat16)).view(np.uint16))


def test_refuses_what_it_does_not_cover():
    q = jnp.zeros((2, 4, 16), jnp.bfloat16)
    pool = jnp.zeros((2, 3, 16, 16), jnp.bfloat16)
    assert paged_decode.why_not(jnp.uint16, 4, 2, 16) is None
    assert paged_decode.why_not(jnp.float32, 4, 2, 16) is None
    assert "neither" in paged_decode.why_not(pool.dtype, 4, 2, 16)    # values, not bits
    assert "neither" in paged_decode.why_not(jnp.int8, 4, 2, 16)
    assert "soft cap" in paged_decode.why_not(jnp.uint16, 4, 2, 16, soft_cap=30.0)
    assert "kv heads" in paged_decode.why_not(jnp.uint16, 4 * 17, 4, 16)
    empty = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32),
             jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="float32 pools expected"):
        paged_decode.paged_decode_attention(q, pool, pool, *empty)
    with pytest.raises(ValueError, match="float32 pools expected"):       # K and V disagree
        paged_decode.paged_decode_attention(q, _as_bits(pool), pool.astype(jnp.float32), *empty)


def _decode_text(engine):
    runner = engine.runner
    key = [k for k in runner.layout.bucket_shapes() if k[0] == "decode"][-1]
    return runner.executables.lower(key, runner.example_args(key)).compile().as_text()


# greedy tokens of 40 that must agree before a divergence: bf16 rounds differently from the
# jnp path (p.V over bf16 probabilities), float32 only sums in another order
AGREE = {jnp.bfloat16: 30, jnp.float32: 40}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_engine_decodes_with_the_kernel_and_agrees_with_the_jnp_path(request, dtype):
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    prompts, params = greedy_case()
    # a bf16 model's q is bf16: the bf16-out handler
    target = paged_decode.TARGETS[2 if dtype == jnp.bfloat16 else 1]
    with_kernel = tiny_engine_in(dtype)
    assert with_kernel.stats()["decode_attention"] == "cpu_kernels.paged_decode"
    assert f'"{target}"' in _decode_text(with_kernel)      # the exact target name
    outs = run_all(with_kernel, prompts, params)
    import cpu_kernels
    cpu_kernels.configure(mode="off")                     # read while a step is traced
    request.addfinalizer(cpu_kernels.configure)
    plain = tiny_engine_in(dtype)
    assert "turned off" in plain.stats()["decode_attention"]
    assert f'"{target}"' not in _decode_text(plain)
    agree = tokens_agreeing(outs, run_all(plain, prompts, params), logprob_tol=0.05)
    assert agree >= AGREE[dtype], f"only {agree} of 40 greedy tokens agree before a divergence"
