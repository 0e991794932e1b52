"""The engine with an int8 KV cache and int8 weights, on a tiny random model: the Pallas
kernels (interpret mode) give the xla path's tokens on an int8 pool, warm-up covers every shape
(nothing compiles while serving), the pool is sized with its scale bytes, stats report the
options, and bad options are rejected before anything loads."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import jax
import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.worker.kv_cache import bytes_per_block
from jaxbatch.model.loader import LoadedModel
from jaxbatch.model.quantize import params_are_quantized
from engines import run_all
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts


@pytest.fixture(scope="module")
def tiny():
    # head_dim 16 (hidden 64 / 4 heads), GQA 2: a power of two, as the Triton kernels need.
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=11))
    return LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0,
                       from_cache=False)


def _engine(tiny, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("warmup", False)
    kw.setdefault("compilation_cache", False)
    kw.setdefault("max_num_seqs", 3)
    return LLMEngine(loaded=tiny, **kw)


PROMPTS = random_token_prompts(np.random.default_rng(21), [4, 33, 70, 9, 50])
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 7, 10)]


def _tokens(engine):
    return [o.outputs[0].token_ids for o in run_all(engine, PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def xla_int8_tokens(tiny):
    return _tokens(_engine(tiny, kv_cache_dtype="int8", attention_backend="xla"))


def test_pallas_interpret_gives_the_xla_tokens_on_an_int8_pool(tiny, xla_int8_tokens):
    engine = _engine(tiny, kv_cache_dtype="int8", attention_backend="pallas_interpret")
    assert _tokens(engine) == xla_int8_tokens
    assert engine.stats()["kv_cache_dtype"] == "int8"


def test_reference_backend_gives_the_xla_tokens_on_an_int8_pool(tiny, xla_int8_tokens):
    engine = _engine(tiny, kv_cache_dtype="int8", attention_backend="reference")
    assert _tokens(engine) == xla_int8_tokens


def test_int8_pool_really_holds_int8_and_scales(tiny):
    engine = _engine(tiny, kv_cache_dtype="int8")
    run_all(engine, PROMPTS[:2], PARAMS[:2])
    k, v, ks, vs = engine.runner.pool
    assert k.dtype == v.dtype == jnp.int8 and ks.dtype == vs.dtype == jnp.float32
    assert np.abs(np.asarray(k)).max() == 127 and np.asarray(ks).max() > 0


def test_int8_weights_run_on_every_backend_alike_and_leave_the_caller_params(tiny):
    tokens = {}
    for backend in ("xla", "pallas_interpret"):
        engine = _engine(tiny, quantization="int8", kv_cache_dtype="int8",
                         attention_backend=backend)
        assert params_are_quantized(engine.runner.params)
        assert engine.stats()["quantization"] == "int8"
        tokens[backend] = _tokens(engine)
    assert tokens["xla"] == tokens["pallas_interpret"]
    assert not params_are_quantized(tiny.params)          # quantized a copy


def test_warmup_covers_every_shape_with_int8_cache_and_weights(tiny):
    engine = _engine(tiny, kv_cache_dtype="int8", quantization="int8", warmup=True,
                     prefill_chunk_size=32)
    compiled = engine.stats()["num_compilations"]
    rng = np.random.default_rng(3)
    prompts = random_token_prompts(rng, rng.integers(1, 100, 24))
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i,
                             max_tokens=int(rng.integers(1, 20)), ignore_eos=True,
                             logprobs=2 if i % 5 == 0 else None,
                             prompt_logprobs=1 if i % 7 == 0 else None)
              for i in range(len(prompts))]
    run_all(engine, prompts, params)
    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0, engine.runner.compilations_after_warmup
    assert stats["num_compilations"] == compiled
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_one_memory_budget_holds_more_blocks_with_an_int8_cache(tiny):
    budget = 300_000
    blocks = {}
    for kv in ("auto", "int8"):
        # Enough slots x context that the budget, not the useful maximum, sets the pool.
        engine = _engine(tiny, kv_cache_dtype=kv, kv_cache_memory_bytes=budget,
                         max_num_seqs=8, max_model_len=512)
        blocks[kv] = engine.stats()["num_total_blocks"] + 1          # plus the null block
        pool_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.pool))
        assert pool_bytes == blocks[kv] * bytes_per_block(tiny.config, 16, jnp.float32, kv)
        assert pool_bytes <= budget
    # float32 model: 16 x 4 bytes per (token, head) vs 16 + 4 -> 3.2x the blocks.
    assert blocks["int8"] == budget // bytes_per_block(tiny.config, 16, jnp.float32, "int8")
    assert blocks["int8"] / blocks["auto"] == pytest.approx(64 / 20, rel=0.05)


def test_default_options_report_the_model_dtype(tiny):
    stats = _engine(tiny).stats()
    assert stats["kv_cache_dtype"] == "float32" and stats["quantization"] is None


@pytest.mark.parametrize("kw,match", [(dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
                                      (dict(kv_cache_dtype="bfloat16"), "kv_cache_dtype"),
                                      (dict(quantization="int4"), "quantization='int4'"),
                                      (dict(quantization="awq"), "quantization")])
def test_unknown_options_raise_value_error(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        _engine(tiny, **kw)


def test_int8_weights_given_without_the_option_are_rejected(tiny):
    engine = _engine(tiny, quantization="int8")
    quantized = dataclasses.replace(tiny, params=engine.loaded.params)
    with pytest.raises(ValueError, match="quantization='int8'"):
        _engine(quantized)


def test_serve_flags_reach_the_engine_kwargs():
    from jaxbatch.engine.config import engine_kwargs_from_args as engine_kwargs
    from jaxbatch.entrypoints.cli import _parser
    args = _parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--quantization", "int8"])
    kw = engine_kwargs(args)
    assert kw["kv_cache_dtype"] == "int8" and kw["quantization"] == "int8"
    defaults = engine_kwargs(_parser().parse_args(["serve"]))
    assert defaults["kv_cache_dtype"] == "auto" and defaults["quantization"] is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])


def test_int8_weights_in_the_per_layer_layout_give_the_stacked_tokens(monkeypatch):
    """weight_layout="per_layer" keeps each layer's int8 matrix apart (a lax.switch picks
    it); the tokens must not depend on the layout."""
    from jaxbatch.model.linear import PerLayer
    model = make_hf_model("llama_untied_gqa2", seed=11)
    tokens = {}
    for layout in ("stacked", "per_layer"):
        cfg, params = ours_from_hf(model)           # per-layer dicts: stacked by the engine
        loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0,
                             from_cache=False)
        engine = _engine(loaded, quantization="int8", weight_layout=layout)
        wq = engine.runner.params["layers"]["wq"]
        assert isinstance(wq, PerLayer) == (layout == "per_layer")
        tokens[layout] = _tokens(engine)
    assert tokens["stacked"] == tokens["per_layer"]


def test_loader_quantizes_from_float32_and_caches_the_int8_params(tmp_path, monkeypatch):
    import jax
    from jaxbatch.model.loader import load_model
    from jaxbatch.model.quantize import quantize_params
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny_hf"
    make_hf_model("llama_untied_gqa2", seed=5).save_pretrained(path, safe_serialization=True)
    first = load_model(str(path), "bfloat16", quantization="int8")
    second = load_model(str(path), "bfloat16", quantization="int8")
    assert not first.from_cache and second.from_cache
    assert len(list((tmp_path / "cache").glob("*-int8"))) == 1
    full = load_model(str(path), "float32")                   # the float32 cache, hit
    assert full.from_cache and not params_are_quantized(full.params)
    want = quantize_params(jax.tree.map(np.asarray, full.params))

    def stacked(w):           # {"int8": [L, in, out], "scale": [L, out]}, stacked or per layer
        if isinstance(w, tuple):
            return {part: np.stack([np.asarray(x[part]) for x in w]) for part in w[0]}
        return {part: np.asarray(value) for part, value in w.items()}
    for got in (first, second):
        layers = got.params["layers"]
        assert stacked(layers["w_up"])["int8"].dtype == jnp.int8
        assert stacked(layers["w_up"])["scale"].dtype == jnp.float32  # whatever the model dtype
        assert got.params["embed"].dtype == layers["attn_norm"].dtype == jnp.bfloat16
        for name in ("wq", "w_down"):                 # quantized from float32, not from bf16
            np.testing.assert_array_equal(stacked(layers[name])["int8"],
                                          stacked(want["layers"][name])["int8"])
    with pytest.raises(ValueError, match="quantization='fp4'"):
        load_model(str(path), quantization="fp4")
