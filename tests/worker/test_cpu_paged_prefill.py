"""The CPU prefill-attention kernel (`cpu_kernels/paged_prefill.cc`, bf16 pages) against its
reference, the XLA-CPU tiled prefill attention (`tiled_prefill_attention_xla`), on the same
random paged inputs (NaN in every pool slot a case does not fill and in every padding query,
`test_xla_attention._prefill_case`), and inside the engine. Skipped, with the reason, where
the kernel cannot run (no AVX512-BF16, no g++)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_prefill
from pallas_kernels.reference import BF16_BITS, keys_as_stored
from pallas_kernels.xla_paged_attention import PREFILL_TILE, tiled_prefill_attention_xla
from test_xla_attention import _prefill_case

REASON = paged_prefill.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

_kernel = jax.jit(paged_prefill.paged_prefill_attention)
_xla = jax.jit(tiled_prefill_attention_xla)


def _bits(pool):
    return jax.lax.bitcast_convert_type(pool, BF16_BITS)


def _bf16_pool(k, v):
    """float pages -> a bf16 pool as the engine stores it: bits, the keys grouped."""
    return keys_as_stored(_bits(k), k.shape[2]), _bits(v)


CASES = [
    # (seed, heads, kv_heads, head_dim, block_size, [(start, length)], padding tiles)
    (101, 9, 3, 64, 16, [(0, 128)], 0),                      # SmolLM2: a first chunk
    (102, 9, 3, 64, 16, [(300, 20), (0, 40), (130, 5)], 1),  # later chunks, padding tiles
    (103, 4, 4, 128, 32, [(33, 7), (0, 19), (1, 45), (80, 12)], 1),  # G 1: 16 tokens a group
    (104, 8, 2, 64, 8, [(16, 17), (0, 33), (3, 14)], 2),     # G 4; pages of 8 keys: short spans
    (105, 16, 2, 80, 16, [(45, 30), (0, 5), (70, 1)], 0),    # G 8; D 80: a partial 32-block
    (106, 12, 2, 96, 16, [(7, 50)], 0),                      # G 6: groups of 2 tokens, 12 rows
    (107, 4, 2, 16, 16, [(0, 16), (5, 11)], 0),              # the tiny test model's head_dim
]


@pytest.mark.parametrize("seed,heads,kv_heads,head_dim,block_size,chunks,extra", CASES)
@pytest.mark.parametrize("window", [None, 7, 40])
def test_kernel_matches_its_reference(seed, heads, kv_heads, head_dim, block_size, chunks,
                                      extra, window):
    (q, k, v, query_pos, tile_pages), _, spans = _prefill_case(
        seed, heads, kv_heads, head_dim, block_size, jnp.bfloat16, chunks, extra)
    k, v = _bf16_pool(k, v)
    out = _kernel(q, k, v, query_pos, tile_pages, scale=0.3, window=window)
    ref = _xla(q, k, v, query_pos, tile_pages, scale=0.3, window=window)
    assert out.dtype == q.dtype and out.shape == q.shape
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    used = np.asarray(query_pos) >= 0
    assert np.isfinite(out32).all(), f"seed={seed}: NaN from a masked key, value or query"
    err = np.abs(out32 - ref32)[used].max() / np.abs(ref32[used]).max()
    # bf16 outputs carry 8 bits, and both round their probabilities to bf16 for p.V, each
    # relative to its own running maximum
    assert err < 1e-2, f"seed={seed} window={window}: relative error {err:.3g}"
    assert (out32[~used] == 0).all(), f"seed={seed}: padding rows must give exactly zero"


def test_a_bf16_q_gets_the_float32_result_rounded_to_bf16():
    """A bf16 q takes the bf16-out handler: exactly the float32 handler's result (a float32 q
    holding the same values) rounded to nearest even, bit for bit."""
    (q, k, v, query_pos, tile_pages), _, _ = _prefill_case(
        108, 9, 3, 64, 16, jnp.bfloat16, [(40, 50), (0, 30)], 1)
    k, v = _bf16_pool(k, v)
    out = _kernel(q, k, v, query_pos, tile_pages)
    wide = _kernel(q.astype(jnp.float32), k, v, query_pos, tile_pages)
    assert out.dtype == jnp.bfloat16 and wide.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  np.asarray(wide.astype(jnp.bfloat16)).view(np.uint16))


def test_a_chunk_alone_equals_the_chunk_among_others():
    """Batch invariance: a chunk's result depends on its own tokens and keys only."""
    chunks = [(200, 16), (0, 48), (130, 80), (450, 32)]
    (q, k, v, query_pos, tile_pages), _, spans = _prefill_case(
        91, 9, 3, 64, 16, jnp.bfloat16, chunks, 1)
    k, v = _bf16_pool(k, v)
    together = np.asarray(_kernel(q, k, v, query_pos, tile_pages), np.float32)
    for i, (base, _, n) in enumerate(spans):
        end = base + -(-n // PREFILL_TILE) * PREFILL_TILE
        alone = _kernel(q[base:end], k, v, query_pos[base:end],
                        tile_pages[base // PREFILL_TILE:end // PREFILL_TILE])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[:n],
                                      together[base:base + n], err_msg=f"chunk {i}")


def test_refuses_what_it_does_not_cover():
    assert paged_prefill.why_not(jnp.uint16, 9, 3, 64) is None
    assert "float32" in paged_prefill.why_not(jnp.float32, 9, 3, 64)
    assert "int8" in paged_prefill.why_not(jnp.int8, 9, 3, 64)
    assert "soft cap" in paged_prefill.why_not(jnp.uint16, 4, 2, 16, soft_cap=30.0)
    assert "kv heads" in paged_prefill.why_not(jnp.uint16, 4 * 17, 4, 16)
    q = jnp.zeros((32, 4, 16), jnp.bfloat16)
    pool = jnp.zeros((2, 3, 16, 16), jnp.uint16)
    pos, tables = jnp.zeros(32, jnp.int32), jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="bf16-bit pools expected"):
        paged_prefill.paged_prefill_attention(q, pool.astype(jnp.float32), pool, pos, tables)
    with pytest.raises(ValueError, match="multiple of tiles"):
        paged_prefill.paged_prefill_attention(q, pool, pool, pos, jnp.zeros((3, 1), jnp.int32))


def _compiled_text(engine, kind):
    runner = engine.runner
    key = [k for k in runner.layout.bucket_shapes() if k[0] == kind][-1]
    return runner.executables.lower(key, runner.example_args(key)).compile().as_text()


def test_the_engine_prefills_with_the_kernel_and_agrees_with_the_jnp_path(monkeypatch):
    """Prefill calls and mixed calls (decode rows and a prefill chunk in one) both run the
    kernel; greedy tokens agree with the jnp path's (bf16 rounds its probabilities relative to
    each path's own running maximum, so a near tie may still flip late)."""
    import jax.numpy as jnp
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    prompts, params = greedy_case()
    with_kernel = tiny_engine_in(jnp.bfloat16)
    assert with_kernel.stats()["prefill_attention"] == "cpu_kernels.paged_prefill"
    for kind in ("prefill", "mixed"):      # a bf16 model: the bf16-out handler
        assert f'"{paged_prefill.BF16_OUT_TARGET}"' in _compiled_text(with_kernel, kind), kind
    outs = run_all(with_kernel, prompts, params)
    plain = tiny_engine_in(jnp.bfloat16, cpu_kernels="off")
    assert "cpu_kernels='off'" in plain.stats()["prefill_attention"]
    assert all(f'"{t}"' not in _compiled_text(plain, "prefill") for t in paged_prefill.TARGETS)
    agree = tokens_agreeing(outs, run_all(plain, prompts, params), logprob_tol=0.05)
    assert agree >= 30, f"only {agree} of 40 greedy tokens agree before a divergence"


def test_float32_pools_keep_the_jnp_path():
    """float32 stays token-identical to HF: its prefill is not this kernel's."""
    import jax.numpy as jnp
    from engines import tiny_engine_in
    engine = tiny_engine_in(jnp.float32)
    assert "not bf16 bits" in engine.stats()["prefill_attention"]
    assert all(f'"{t}"' not in _compiled_text(engine, "prefill") for t in paged_prefill.TARGETS)
