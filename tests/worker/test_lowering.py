"""Every production kernel configuration lowers for the cuda platform, on a machine without a GPU.

jax 0.10 lowers Triton kernels for cuda as is; jax 0.11 needs an abstract GPU in scope (an H200
here, `pallas_kernels.availability.abstract_gpu`). CI runs this file under both versions.

Configurations: the kernel shapes scripts/gpu_check.py times, and every call shape the engine
compiles (`runner.bucket_shapes()`) with its default settings and with the settings of
`gpu_e2e` (64 slots) for the model shapes gpu_e2e runs (SmolLM2-135M, Llama-3.2-1B,
Llama-3.1-8B), over a KV pool the size of a GPU deployment. The pool is the stacked layout
[KVH, num_layers * num_blocks, block_size, head_dim], larger than 4 GiB, so the kernels' gathers
use 64-bit offsets. The xla fallback (plain jnp, what `auto` picks on a GPU without Triton) is
lowered for cuda too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_decode as pd
from pallas_kernels.availability import abstract_gpu, lower_for_cuda
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.xla_paged_attention import (PAGES_PER_ITEM, PREFILL_TILE,
                                                paged_decode_attention_xla,
                                                tiled_prefill_attention_xla)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # jax 0.11: Triton

sds = jax.ShapeDtypeStruct
TRITON_CALL = getattr(pd.pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
BLOCK_SIZE = 16
# (num_heads, num_kv_heads, head_dim, num_layers) and the dtypes the engine runs them in on a
# GPU: the embedded SmolLM2 GGUF loads as float32 ("auto" keeps a float32 checkpoint float32),
# the random-weight shapes of gpu_e2e are bfloat16.
MODELS = {
    "smollm2": ((9, 3, 64, 30), (jnp.float32, jnp.bfloat16)),
    "llama1b": ((32, 8, 64, 16), (jnp.bfloat16,)),
    "llama8b": ((32, 8, 128, 32), (jnp.bfloat16,)),
}
CASES = [(m, d) for m, (_, dtypes) in MODELS.items() for d in dtypes]
CASE_IDS = [f"{m}-{jnp.dtype(d).name}" for m, d in CASES]
BLOCKS_PER_LAYER = 16384


def _pool(model, dtype):
    heads, kv_heads, head_dim, layers = MODELS[model][0]
    return sds((kv_heads, layers * BLOCKS_PER_LAYER, BLOCK_SIZE, head_dim), dtype)


def _assert_triton(lowered):
    # The Triton backend must have been selected (a plain pallas_call would go to Mosaic GPU).
    assert TRITON_CALL in lowered.as_text(), "no Triton custom call in the lowered module"


def lower_decode(model, dtype, rows, pages, **kw):
    heads, _, head_dim, _ = MODELS[model][0]
    pool = _pool(model, dtype)
    _assert_triton(lower_for_cuda(
        lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, **kw),
        sds((rows, heads, head_dim), dtype), pool, pool, sds((rows, pages), jnp.int32),
        sds((rows,), jnp.int32)))


def lower_ragged(model, dtype, tokens, seqs, pages, **kw):
    heads, _, head_dim, _ = MODELS[model][0]
    pool = _pool(model, dtype)
    _assert_triton(lower_for_cuda(
        lambda q, k, v, kl, pi, cu, ns: ragged_paged_attention(q, k, v, kl, pi, cu, ns, **kw),
        sds((tokens, heads, head_dim), dtype), pool, pool, sds((seqs,), jnp.int32),
        sds((seqs, pages), jnp.int32), sds((seqs + 1,), jnp.int32), sds((1,), jnp.int32)))


# --- the shapes scripts/gpu_check.py times -----------------------------------------------------

@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("batch,pages_per_seq,splits", [(64, 256, None), (64, 256, 1),
                                                         (8, 16, None)])
def test_decode_lowers_for_cuda(model, dtype, batch, pages_per_seq, splits):
    lower_decode(model, dtype, batch, pages_per_seq, num_splits=splits)


@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("num_tokens,max_seqs,pages_per_seq", [(512, 64, 256), (64, 64, 64),
                                                               (2048, 1, 256)])
def test_ragged_lowers_for_cuda(model, dtype, num_tokens, max_seqs, pages_per_seq):
    lower_ragged(model, dtype, num_tokens, max_seqs, pages_per_seq, soft_cap=50.0)


@pytest.mark.parametrize("params", [
    dict(pages_per_compute_block=2), dict(pages_per_compute_block=8), dict(num_splits=4),
    dict(num_splits=8), dict(num_warps=8), dict(num_stages=3),
    dict(pages_per_compute_block=8, num_warps=8)], ids=str)
def test_gpu_check_sweep_settings_lower_for_cuda(params):
    """The tile / split / warp settings scripts/gpu_check.py sweeps at its headline shape."""
    lower_decode("llama8b", jnp.bfloat16, 64, 256, **params)


def test_lowering_targets_the_abstract_gpu():
    """The abstract device is what the Triton lowering sees (jax 0.11 reads its compute
    capability); without it jax 0.11 refuses on a CPU machine."""
    from jax._src import mesh as mesh_lib
    with abstract_gpu("NVIDIA H200"):
        device = mesh_lib.get_abstract_mesh().abstract_device
    assert device is not None and device.device_kind == "NVIDIA H200"


# --- every call shape the engine compiles ------------------------------------------------------

def _engine_buckets(**engine_kwargs):
    """(bucket shapes, prefill chunks per call) of an engine with the Pallas backend, built on a
    tiny random model (bucket shapes depend on the scheduler settings, not on the model)."""
    import dataclasses

    from jaxbatch.benchmarks.random_models import MODEL_SHAPES, random_model
    from jaxbatch.engine.llm_engine import LLMEngine
    cfg = dataclasses.replace(MODEL_SHAPES["tiny"], max_position_embeddings=1 << 17)
    loaded = random_model("tiny", "float32", seed=0, config=cfg)
    engine = LLMEngine(loaded=loaded, attention_backend="pallas", warmup=False,
                       **engine_kwargs)
    runner = engine.runner
    chunks = getattr(runner, "chunks_per_call", None) or runner.layout.chunks_per_call
    # Attention runs in the decode and prefill calls; other keys (sampling, prompt
    # log-probabilities) hold no kernel.
    return [k for k in runner.bucket_shapes() if k[0] in ("decode", "prefill")], chunks


def _gpu_e2e_settings():
    from benchmarks import gpu_e2e
    args = gpu_e2e.parse_args([])
    max_len = args.prompt_len + args.new_tokens
    return dict(max_num_seqs=args.slots, max_model_len=max_len,
                num_blocks=args.slots * -(-max_len // BLOCK_SIZE) + 1)


ENGINE_SETTINGS = {
    "engine_defaults": lambda: dict(num_blocks=None),
    "gpu_e2e": _gpu_e2e_settings,
}


@pytest.fixture(scope="module")
def engine_buckets():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _engine_buckets(**ENGINE_SETTINGS[name]())
        return cache[name]
    return get


@pytest.mark.parametrize("settings", sorted(ENGINE_SETTINGS))
@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
def test_every_engine_bucket_lowers_for_cuda(engine_buckets, settings, model, dtype):
    shapes, chunks_per_call = engine_buckets(settings)
    assert {kind for kind, _, _ in shapes} == {"decode", "prefill"}, shapes
    for kind, a, b in shapes:
        if kind == "decode":
            lower_decode(model, dtype, rows=a, pages=b)
        else:
            lower_ragged(model, dtype, tokens=a, seqs=chunks_per_call, pages=b)


def test_engine_default_buckets_cover_the_default_context():
    """The default engine compiles page buckets up to max_model_len: the shapes above are the
    ones a GPU deployment with default settings runs."""
    from jaxbatch.engine.setup import DEFAULT_MAX_MODEL_LEN
    shapes, _ = _engine_buckets(num_blocks=None)
    largest = max(b for kind, _, b in shapes if kind == "decode")
    assert largest * BLOCK_SIZE >= DEFAULT_MAX_MODEL_LEN


# --- the xla fallback (plain jnp) --------------------------------------------------------------

@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
def test_xla_attention_lowers_for_cuda(model, dtype):
    heads, _, head_dim, _ = MODELS[model][0]
    pool = _pool(model, dtype)
    rows, items, tokens, pages = 64, 1024, 256, 512
    lower_for_cuda(paged_decode_attention_xla, sds((rows, heads, head_dim), dtype), pool, pool,
                   sds((items,), jnp.int32), sds((items, PAGES_PER_ITEM), jnp.int32),
                   sds((items,), jnp.int32), sds((rows,), jnp.int32))
    lower_for_cuda(tiled_prefill_attention_xla, sds((tokens, heads, head_dim), dtype), pool, pool,
                   sds((tokens,), jnp.int32), sds((tokens // PREFILL_TILE, pages), jnp.int32))


# --- int8 KV pools (pallas_kernels/int8.py): int8 pages + float32 scales per token and head -----

def _int8_pool(model):
    pages = _pool(model, jnp.int8)
    return pages, sds(pages.shape[:3], jnp.float32)


@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("batch,pages_per_seq,splits", [(64, 256, None), (64, 256, 1)])
def test_int8_decode_lowers_for_cuda(model, dtype, batch, pages_per_seq, splits):
    heads, _, head_dim, _ = MODELS[model][0]
    pages, scales = _int8_pool(model)
    _assert_triton(lower_for_cuda(
        lambda q, k, v, t, n, ks, vs: paged_decode_attention(q, k, v, t, n, k_scales=ks,
                                                             v_scales=vs, num_splits=splits),
        sds((batch, heads, head_dim), dtype), pages, pages, sds((batch, pages_per_seq), jnp.int32),
        sds((batch,), jnp.int32), scales, scales))


@pytest.mark.parametrize("model,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("num_tokens,max_seqs,pages_per_seq", [(512, 64, 256), (2048, 1, 256)])
def test_int8_ragged_lowers_for_cuda(model, dtype, num_tokens, max_seqs, pages_per_seq):
    heads, _, head_dim, _ = MODELS[model][0]
    pages, scales = _int8_pool(model)
    _assert_triton(lower_for_cuda(
        lambda q, k, v, kl, pi, cu, ns, ks, vs: ragged_paged_attention(
            q, k, v, kl, pi, cu, ns, k_scales=ks, v_scales=vs),
        sds((num_tokens, heads, head_dim), dtype), pages, pages, sds((max_seqs,), jnp.int32),
        sds((max_seqs, pages_per_seq), jnp.int32), sds((max_seqs + 1,), jnp.int32),
        sds((1,), jnp.int32), scales, scales))


def test_int8_xla_attention_lowers_for_cuda():
    heads, _, head_dim, _ = MODELS["llama8b"][0]
    pages, scales = _int8_pool("llama8b")
    dtype, rows, items, tokens, n_pages = jnp.bfloat16, 64, 1024, 256, 512
    lower_for_cuda(lambda q, k, v, s, p, f, n, ks, vs: paged_decode_attention_xla(
                       q, k, v, s, p, f, n, k_scales=ks, v_scales=vs),
                   sds((rows, heads, head_dim), dtype), pages, pages, sds((items,), jnp.int32),
                   sds((items, PAGES_PER_ITEM), jnp.int32), sds((items,), jnp.int32),
                   sds((rows,), jnp.int32), scales, scales)
    lower_for_cuda(lambda q, k, v, p, t, ks, vs: tiled_prefill_attention_xla(
                       q, k, v, p, t, k_scales=ks, v_scales=vs),
                   sds((tokens, heads, head_dim), dtype), pages, pages, sds((tokens,), jnp.int32),
                   sds((tokens // PREFILL_TILE, n_pages), jnp.int32), scales, scales)


@pytest.mark.parametrize("m,k,n", [(16, 2048, 8192), (64, 8192, 2048), (5, 576, 1536)])
def test_w8a8_lowers_for_cuda(m, k, n):
    """quantization="w8a8" on a GPU: the Pallas int8 kernel goes to Triton, K in steps."""
    from pallas_kernels.w8a8 import w8a8_matmul
    _assert_triton(lower_for_cuda(lambda x, w, s: w8a8_matmul(x, w, s),
                                  sds((m, k), jnp.bfloat16), sds((k, n), jnp.int8),
                                  sds((n,), jnp.float32)))
