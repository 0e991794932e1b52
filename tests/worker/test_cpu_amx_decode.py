"""Decode attention's AMX variant (`paged_decode.cc` over `decode_amx.h`: q.K and p.V by
`tdpbf16ps`, the pool's key groups read as B tiles where they lie): against the reference as
the AVX512 kernel is, and within float32 rounding of that kernel; NaN in unused slots kept out;
a row's result the same alone as in a batch; shapes the tiles do not cover refused, saying why;
the kernel seam choosing it where it runs and is the faster, in an engine agreeing with one on
AVX512.
Skipped where this CPU has no AMX."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_decode
from pallas_kernels.xla_paged_attention import paged_decode_attention_xla
from test_cpu_paged_decode import _bf16_pool
from test_xla_attention import _decode_case

REASON = paged_decode.unavailable_reason() or paged_decode.amx_why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no AMX tiles here: {REASON}")

_amx = jax.jit(lambda *a, **kw: paged_decode.paged_decode_attention(*a, amx=True, **kw))
_avx512 = jax.jit(paged_decode.paged_decode_attention)
_xla = jax.jit(paged_decode_attention_xla)

CASES = [
    # (seed, num_heads, num_kv_heads, head_dim, block_size, padding items, pages per item)
    (41, 9, 3, 64, 16, 3, 8),       # SmolLM2's shapes: 5 spans in a row's tail (one pair half)
    (42, 4, 4, 128, 32, 9, 2),      # GQA 1, two passes of 4 value tiles
    (43, 32, 4, 64, 16, 2, 4),      # TinyLlama-1.1B's heads: GQA 8
    (44, 16, 1, 32, 16, 0, 1),      # GQA 16 (a full A tile), one dim chunk: no second q tile
    (45, 12, 2, 96, 32, 1, 2),      # GQA 6 (no compiled group), 3 dim chunks: an odd one
]


@pytest.mark.parametrize("seed,heads,kv_heads,head_dim,block_size,extra,ppi", CASES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matches_the_reference_and_the_avx512_kernel(seed, heads, kv_heads, head_dim,
                                                     block_size, extra, ppi, window, out_dtype):
    (q, k, v, *items, lengths), _, lens = _decode_case(seed, heads, kv_heads, head_dim,
                                                       block_size, jnp.bfloat16, extra, ppi)
    k, v = _bf16_pool(k, v)
    q = q.astype(out_dtype)          # a float32 q: the float32-out handler over bf16 pages
    out = _amx(q, k, v, *items, lengths, scale=0.3, window=window)
    assert out.dtype == q.dtype and out.shape == q.shape
    out32 = np.asarray(out, np.float32)
    ref32 = np.asarray(_xla(q.astype(jnp.bfloat16), k, v, *items, lengths, scale=0.3,
                            window=window), np.float32)
    avx32 = np.asarray(_avx512(q, k, v, *items, lengths, scale=0.3, window=window), np.float32)
    assert np.isfinite(out32).all(), f"seed={seed}: NaN from a masked key or value"
    assert (out32[lens == 0] == 0).all(), f"seed={seed}: empty rows must give exactly zero"
    scale = np.abs(ref32).max()
    assert np.abs(out32 - ref32).max() / scale < 1e-2, f"seed={seed}: off the reference"
    # the same probabilities rounded to bf16 from scores summed in another order: now and then
    # one probability a bf16 step apart
    assert np.abs(out32 - avx32).max() / scale < 4e-3, f"seed={seed}: off the AVX512 kernel"


def test_a_row_alone_equals_the_row_in_a_batch():
    (q, k, v, item_slot, item_pages, item_first, lengths), _, lens = _decode_case(
        46, 32, 4, 64, 16, jnp.bfloat16, 4, 2)
    k, v = _bf16_pool(k, v)
    full = np.asarray(_amx(q, k, v, item_slot, item_pages, item_first, lengths), np.float32)
    for row in np.flatnonzero(lens > 0):
        keep = np.asarray(item_slot) == row
        order = np.argsort(~keep, kind="stable")
        slot = np.where(keep, 0, 1)[order]
        alone = _amx(q[row:row + 1], k, v, jnp.asarray(slot, jnp.int32), item_pages[order],
                     item_first[order], lengths[row:row + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], full[row])


def test_shapes_the_tiles_do_not_cover_are_refused_saying_why():
    assert paged_decode.amx_why_not(jnp.uint16, 16, 64) is None
    assert "multiples of 16 and 32" in paged_decode.amx_why_not(jnp.uint16, 8, 64)
    assert "multiples of 16 and 32" in paged_decode.amx_why_not(jnp.uint16, 16, 80)
    assert "take bf16" in paged_decode.amx_why_not(jnp.float32, 16, 64)
    (q, k, v, *items, lengths), _, _ = _decode_case(47, 4, 2, 16, 16, jnp.bfloat16, 0, 1)
    k, v = _bf16_pool(k, v)
    with pytest.raises(ValueError, match="AMX variant cannot run here.*head dim of 16"):
        _amx(q, k, v, *items, lengths)


def _seam(cpu_gemm, heads, kv_heads, head_dim=64, block_size=16):
    from jaxbatch.model.config import ModelConfig
    from jaxbatch.worker.kernels import KernelOptions, choose
    cfg = ModelConfig(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=128,
                      num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256)
    return choose(model_cfg=cfg, dtype=jnp.bfloat16, pool_dtype=jnp.uint16, platform="cpu",
                  options=KernelOptions(cpu_gemm=cpu_gemm),
                  block_size=block_size).describe()["decode_attention"]


def test_the_seam_takes_the_tiles_where_they_fit_and_are_the_faster():
    tiles, plain = "cpu_kernels.paged_decode (AMX tiles)", "cpu_kernels.paged_decode"
    assert _seam("auto", 32, 4) == tiles                       # a group of 8
    assert _seam("auto", 32, 8) == plain                       # of 4: AVX512 is the faster
    assert _seam("amx", 32, 8) == tiles                        # asked for: wherever they fit
    assert _seam("amx", 32, 4, block_size=8) == plain          # pages of 8 keys
    assert _seam("amx", 16, 2, head_dim=80) == plain           # dims not whole tiles
    assert _seam("packed", 32, 4) == _seam("xla", 32, 4) == plain


def test_an_engine_on_the_tiles_agrees_with_one_on_avx512():
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    prompts, params = greedy_case()
    model = "llama_gqa8_head_dim_32"
    amx = tiny_engine_in(jnp.bfloat16, model, cpu_gemm="auto")
    assert amx.stats()["decode_attention"] == "cpu_kernels.paged_decode (AMX tiles)"
    key = [k for k in amx.runner.layout.bucket_shapes() if k[0] == "decode"][-1]
    text = amx.runner.executables.lower(key, amx.runner.example_args(key)).compile().as_text()
    assert '"jaxbatch_paged_decode_bf16_out_amx"' in text
    outs = run_all(amx, prompts, params)
    solo = run_all(amx, prompts[2:3], params[2:3])
    assert solo[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    avx512 = tiny_engine_in(jnp.bfloat16, model, cpu_gemm="packed")
    assert avx512.stats()["decode_attention"] == "cpu_kernels.paged_decode"
    agree = tokens_agreeing(outs, run_all(avx512, prompts, params), logprob_tol=2e-2)
    assert agree >= 34, f"only {agree} of 40 greedy tokens agree before a divergence"
