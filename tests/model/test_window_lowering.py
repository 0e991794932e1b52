"""The sliding-window variants of every kernel lower for the cuda platform on a CPU machine
(tests/worker/test_lowering.py's method, run under both jax versions in CI): the window is a traced
int32 scalar (each layer's, from the layer scan), with float and int8 pools, soft cap on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_decode as pd
from pallas_kernels.availability import lower_for_cuda
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.xla_paged_attention import (PAGES_PER_ITEM, PREFILL_TILE,
                                                paged_decode_attention_xla,
                                                tiled_prefill_attention_xla)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # jax 0.11: Triton

sds = jax.ShapeDtypeStruct
TRITON_CALL = getattr(pd.pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
# (heads, kv heads, head_dim, dtype): Gemma-2-2B-like float32, Qwen3-8B-like bfloat16.
MODELS = {"gemma2_2b": (8, 4, 256, jnp.float32), "qwen3_8b": (32, 8, 128, jnp.bfloat16)}
BLOCKS, BS = 4096, 16
I32 = jnp.int32


def _pool(kv_heads, head_dim, dtype, int8):
    pages = sds((kv_heads, BLOCKS, BS, head_dim), jnp.int8 if int8 else dtype)
    return pages, (sds((kv_heads, BLOCKS, BS), jnp.float32) if int8 else None)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("splits", [1, None])
def test_windowed_decode_lowers_for_cuda(model, int8, splits):
    heads, kv_heads, head_dim, dtype = MODELS[model]
    pages, scales = _pool(kv_heads, head_dim, dtype, int8)
    rows, table = 64, 256

    def f(q, k, v, t, n, w, *s):
        kw = {} if not s else dict(k_scales=s[0], v_scales=s[1])
        return paged_decode_attention(q, k, v, t, n, window=w, soft_cap=50.0, num_splits=splits,
                                      **kw)
    lowered = lower_for_cuda(f, sds((rows, heads, head_dim), dtype), pages, pages,
                             sds((rows, table), I32), sds((rows,), I32), sds((), I32),
                             *((scales, scales) if int8 else ()))
    assert TRITON_CALL in lowered.as_text()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("int8", [False, True])
def test_windowed_ragged_lowers_for_cuda(model, int8):
    heads, kv_heads, head_dim, dtype = MODELS[model]
    pages, scales = _pool(kv_heads, head_dim, dtype, int8)
    tokens, seqs, table = 512, 16, 256

    def f(q, k, v, kl, pi, cu, ns, w, *s):
        kw = {} if not s else dict(k_scales=s[0], v_scales=s[1])
        return ragged_paged_attention(q, k, v, kl, pi, cu, ns, window=w, soft_cap=50.0, **kw)
    lowered = lower_for_cuda(f, sds((tokens, heads, head_dim), dtype), pages, pages,
                             sds((seqs,), I32), sds((seqs, table), I32), sds((seqs + 1,), I32),
                             sds((1,), I32), sds((), I32), *((scales, scales) if int8 else ()))
    assert TRITON_CALL in lowered.as_text()


@pytest.mark.parametrize("int8", [False, True])
def test_windowed_xla_attention_lowers_for_cuda(int8):
    heads, kv_heads, head_dim, dtype = MODELS["qwen3_8b"]
    pages, scales = _pool(kv_heads, head_dim, dtype, int8)
    extra = (scales, scales) if int8 else ()
    kw = lambda s: {} if not s else dict(k_scales=s[0], v_scales=s[1])
    rows, items, tokens, table = 64, 1024, 256, 512
    lower_for_cuda(lambda q, k, v, s, p, f, n, w, *sc: paged_decode_attention_xla(
                       q, k, v, s, p, f, n, window=w, soft_cap=50.0, **kw(sc)),
                   sds((rows, heads, head_dim), dtype), pages, pages, sds((items,), I32),
                   sds((items, PAGES_PER_ITEM), I32), sds((items,), I32), sds((rows,), I32),
                   sds((), I32), *extra)
    lower_for_cuda(lambda q, k, v, p, t, w, *sc: tiled_prefill_attention_xla(
                       q, k, v, p, t, window=w, soft_cap=50.0, **kw(sc)),
                   sds((tokens, heads, head_dim), dtype), pages, pages, sds((tokens,), I32),
                   sds((tokens // PREFILL_TILE, table), I32), sds((), I32), *extra)
