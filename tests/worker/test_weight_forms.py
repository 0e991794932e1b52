"""The weights' forms (`worker/weight_forms.py`): per-layer matrices transposed, q/k/v and
gate/up fused, every float matrix and the LM head (tied or not) packed for our GEMM kernel
where it covers them; the plain values kept recoverable (quantizing, restacking for tensor
parallelism, LoRA shapes), and a forward that computes in every form what it computes in the
plain one."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import packed_gemm
from forward_helpers import CPU_FORM, PACKED_FORM, compute_logits, forward_hidden, typed
from jaxbatch.lora.pool import target_shapes
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.layers import FUSED
from jaxbatch.model.linear import Int8, OutIn, PerLayer
from jaxbatch.model.quantize import quantize_params
from jaxbatch.model.rope import inverse_frequencies
from jaxbatch.worker import kv_cache, weight_forms
from jaxbatch.worker.attention import get_backend
from jaxbatch.worker.weight_forms import Packed, WeightForm, prepare, to_plain
from tiny_models import make_hf_model, ours_from_hf

REASON = packed_gemm.unavailable_reason()
needs_gemm = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def _per_layer(name, dtype=np.float32):
    cfg, params = ours_from_hf(make_hf_model(name, seed=3))
    params = jax.tree.map(lambda a: np.asarray(a, dtype), params)
    return cfg, stack_layers(params, matrices_per_layer=True)


@needs_gemm
@pytest.mark.parametrize("name", ["llama_untied_gqa2", "llama_tied_mha"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matrices_and_head_are_packed_and_give_their_values_back(name, dtype):
    cfg, params = _per_layer(name, dtype)
    unpacked = prepare(params, CPU_FORM)
    stored = prepare(params, PACKED_FORM)
    again = prepare(stored, PACKED_FORM)                                      # idempotent
    assert jax.tree.structure(again) == jax.tree.structure(stored)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stored)))
    for key, value in stored["layers"].items():
        if isinstance(value, PerLayer):
            assert all(isinstance(w, Packed) for w in value.layers), key
            for w, plain in zip(value.layers, unpacked["layers"][key].layers):
                np.testing.assert_array_equal(np.asarray(w.to_float()),
                                              np.asarray(plain.to_float()))
                assert w.in_out == plain.in_out
    tied = "lm_head" not in params
    head = stored["tied_head" if tied else "lm_head"]
    assert isinstance(head, Packed)
    want = np.asarray(params["embed"]).T if tied else np.asarray(params["lm_head"])
    np.testing.assert_array_equal(np.asarray(head.to_float()), want)
    assert ("lm_head" in stored) != tied
    # LoRA's shapes and tensor parallelism's restacking read through the packing.
    assert target_shapes(stored) == target_shapes(unpacked)
    restacked = prepare(stored, WeightForm())
    assert "tied_head" not in restacked
    if not tied:
        np.testing.assert_array_equal(np.asarray(restacked["lm_head"].to_float()), want)
    for part in ("wq", "wv", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(restacked["layers"][part].to_float()),
                                      np.stack([np.asarray(w) for w in params["layers"][part]]))


@needs_gemm
def test_uncovered_matrices_and_the_plain_form_stay_unpacked(monkeypatch):
    _, params = _per_layer("llama_untied_gqa2")
    stacked = prepare(params, WeightForm())
    assert weight_forms.matmuls(stacked) == "XLA dots"
    assert not any(isinstance(v, PerLayer) for v in stacked["layers"].values())
    monkeypatch.setattr(packed_gemm, "why_not", lambda *a: "not here")
    stored = prepare(params, PACKED_FORM)
    assert weight_forms.matmuls(stored) == "XLA dots"


@needs_gemm
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_logits_and_a_layer_matmul_match_the_transposed_form(dtype):
    _, params = _per_layer("llama_tied_mha", dtype)
    plain = jax.tree.map(jnp.asarray, prepare(params, CPU_FORM))
    packed = jax.tree.map(jnp.asarray, prepare(params, PACKED_FORM))
    assert weight_forms.matmuls(packed) == "cpu_kernels.packed_gemm"
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, params["embed"].shape[1])),
                         dtype)
    logits = jax.jit(lambda p, h: compute_logits(p, h, form=None))
    np.testing.assert_allclose(np.asarray(logits(packed, hidden)),
                               np.asarray(logits(plain, hidden)), rtol=1e-5, atol=1e-5)
    w_plain, w_packed = plain["layers"]["wo"].layers[0], packed["layers"]["wo"].layers[0]
    x = hidden[:, :w_plain.in_out[0]]
    np.testing.assert_allclose(np.asarray(w_packed.apply(x), np.float32),
                               np.asarray(w_plain.apply(x), np.float32),
                               rtol=1e-2 if dtype != np.float32 else 1e-5, atol=1e-5)


@needs_gemm
def test_a_head_the_kernel_does_not_cover_keeps_xlas_dot():
    # a vocabulary of 250 is not a multiple of 16: the tied head [d, V] stays the embedding's
    layer = np.ones((32, 32), np.float32)
    for head in ({"embed": np.ones((250, 32), np.float32)},
                 {"embed": np.ones((256, 32), np.float32), "lm_head": np.ones((32, 250), np.float32)}):
        stored = prepare({**head, "layers": {"wo": (layer,), "attn_norm": np.ones((1, 32))}},
                         PACKED_FORM)
        assert "tied_head" not in stored
        assert not isinstance(stored.get("lm_head"), Packed)
        assert isinstance(stored["layers"]["wo"].layers[0], Packed)      # the layers still are


def test_fused_matrices_hold_their_parts_and_split_back():
    cfg, params = ours_from_hf(make_hf_model("llama_gqa4_bias", seed=3))   # 4 q heads, 1 kv head
    plain = stack_layers(params, matrices_per_layer=True)
    layers = prepare(plain, CPU_FORM)["layers"]
    assert {"wqkv", "w_gate_up"} <= set(layers)
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layers)
    q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    for i, layer in enumerate(params["layers"]):
        want = np.concatenate([np.asarray(layer[p]).T for p in ("wq", "wk", "wv")])
        assert isinstance(layers["wqkv"].layers[i], OutIn)
        np.testing.assert_array_equal(np.asarray(layers["wqkv"].layers[i].w), want)
    back = to_plain({"layers": layers})["layers"]
    assert set(back) == set(plain["layers"])
    for name, value in plain["layers"].items():
        for got, want in zip(jax.tree.leaves(back[name]), jax.tree.leaves(value)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # LoRA targets the parts, fused or not; restacking (tensor parallelism) gets the parts.
    assert target_shapes({"layers": layers}) == {
        "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
        "w_gate": (d, cfg.intermediate_size), "w_up": (d, cfg.intermediate_size),
        "w_down": (cfg.intermediate_size, d)}
    restacked = prepare({**plain, "layers": layers}, WeightForm())
    for name in ("wq", "wv", "w_up"):
        np.testing.assert_array_equal(np.asarray(restacked["layers"][name].to_float()),
                                      np.stack([np.asarray(l[name]) for l in params["layers"]]))


@pytest.mark.parametrize("form", [CPU_FORM, PACKED_FORM, WeightForm()], ids=["cpu", "packed",
                                                                             "stacked"])
def test_the_forward_is_the_same_in_every_form(form):
    if form.packed and REASON:
        pytest.skip(REASON)
    cfg, params = ours_from_hf(make_hf_model("qwen2_qkv_bias", seed=4))
    plain = jax.tree.map(jnp.asarray, typed(params))
    formed = jax.tree.map(jnp.asarray, typed(params, form))
    num_tokens, block_size, pages = 12, 4, 4
    pool = kv_cache.allocate_pool(cfg, pages + 1, block_size, jnp.float32)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, num_tokens).astype(np.int32)
    positions = np.arange(num_tokens, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]                # block 0: the null block
    slots = table[0, positions // block_size] * block_size + positions % block_size
    meta = (np.array([num_tokens], np.int32), table, np.array([0, num_tokens], np.int32),
            np.ones(1, np.int32))                                          # one sequence

    @functools.partial(jax.jit, static_argnums=2)
    def logits(p, meta, form):
        attend = get_backend("reference").prefill_attend(meta, cfg.head_dim ** -0.5)
        hidden, _ = forward_hidden(p, cfg, pool, tokens, positions, slots, attend,
                                   jnp.asarray(inverse_frequencies(cfg)), form=form)
        return compute_logits(p, hidden, form=form)
    np.testing.assert_allclose(np.asarray(logits(formed, meta, form)),
                               np.asarray(logits(plain, meta, WeightForm(per_layer=True))),
                               rtol=1e-5, atol=1e-5)


def test_int8_quantizes_the_parts_of_fused_matrices():
    """A float model an engine holds has fused matrices; quantizing it (an engine's
    quantization="int8" on such a `loaded`) gives int8 parts, never a fused int8 matrix."""
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=5))
    stored = prepare(stack_layers(params, matrices_per_layer=True), CPU_FORM)
    q = prepare(quantize_params(to_plain(stored)), CPU_FORM)["layers"]
    assert not set(FUSED) & set(q)
    assert all(isinstance(q[p].layers[0], Int8) for parts in FUSED.values() for p in parts)
    assert target_shapes({"layers": q}) == target_shapes(stored)


@needs_gemm
def test_amx_forms_only_where_the_tiles_cover_the_matrix(monkeypatch):
    """A bf16 matrix whose in-width is no whole tile step would run the AVX512 loop inside the
    AMX call: it takes the AVX512 form (and its epilogue threshold), and says so; prepare of
    the result changes nothing."""
    import dataclasses
    from jaxbatch.worker.kernel_forms import AmxPacked
    _, params = _per_layer("llama_untied_gqa2", jnp.bfloat16)
    amx_form = dataclasses.replace(PACKED_FORM, amx=True)
    covered = prepare(params, amx_form)
    assert all(type(w) is AmxPacked for v in covered["layers"].values()
               if isinstance(v, PerLayer) for w in v.layers)
    monkeypatch.setattr(packed_gemm, "amx_covers", lambda dtype, k: False)
    uncovered = prepare(params, amx_form)
    forms = [type(w) for v in uncovered["layers"].values() if isinstance(v, PerLayer)
             for w in v.layers] + [type(uncovered["lm_head"])]
    assert set(forms) == {Packed}
    again = prepare(uncovered, amx_form)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(uncovered)))
