"""The CPU storage of the weights (`model/storage.py`): every per-layer float matrix and the
LM head (tied or not) packed for our GEMM kernel where it covers them, the plain values kept
recoverable (restacking for tensor parallelism, LoRA shapes), and a forward that computes with
the packed form what it computes with the transposed one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import packed_gemm
from jaxbatch.lora.pool import target_shapes
from jaxbatch.model import fused, llama, precision, storage
from tiny_models import make_hf_model, ours_from_hf

REASON = packed_gemm.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def _per_layer(name, dtype=np.float32):
    cfg, params = ours_from_hf(make_hf_model(name, seed=3))
    params = jax.tree.map(lambda a: np.asarray(a, dtype), params)
    return cfg, llama.stack_layers(params, matrices_per_layer=True)


@pytest.mark.parametrize("name", ["llama_untied_gqa2", "llama_tied_mha"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matrices_and_head_are_packed_and_give_their_values_back(name, dtype):
    cfg, params = _per_layer(name, dtype)
    unpacked = fused.fuse_params(precision.to_storage(params, platform="cpu"))
    stored = storage.prepare(params, platform="cpu")
    again = storage.prepare(stored, platform="cpu")                            # idempotent
    assert jax.tree.structure(again) == jax.tree.structure(stored)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stored)))
    for key, value in stored["layers"].items():
        if isinstance(value, tuple):
            assert all(precision.is_packed(w) for w in value), key
            for w, plain in zip(value, unpacked["layers"][key]):
                np.testing.assert_array_equal(np.asarray(precision.as_float(w)),
                                              np.asarray(precision.as_float(plain)))
                assert precision.in_out_shape(w) == precision.in_out_shape(plain)
    tied = "lm_head" not in params
    head = stored[storage.TIED_HEAD if tied else "lm_head"]
    assert precision.is_packed(head)
    want = np.asarray(params["embed"]).T if tied else np.asarray(params["lm_head"])
    np.testing.assert_array_equal(np.asarray(precision.as_float(head)), want)
    assert ("lm_head" in stored) != tied
    # LoRA's shapes and tensor parallelism's restacking read through the packing.
    assert target_shapes(stored) == target_shapes(unpacked)
    restacked = llama.stack_layers(stored, matrices_per_layer=False)
    assert storage.TIED_HEAD not in restacked
    if not tied:
        np.testing.assert_array_equal(np.asarray(restacked["lm_head"]), want)
    for part in ("wq", "wv", "w_up", "w_down"):
        np.testing.assert_array_equal(
            np.asarray(restacked["layers"][part]),
            np.stack([np.asarray(precision.as_float(w)) for w in params["layers"][part]]))


def test_uncovered_matrices_and_other_platforms_stay_as_they_were(monkeypatch):
    _, params = _per_layer("llama_untied_gqa2")
    on_gpu = storage.prepare(params, platform="gpu")
    assert jax.tree.structure(on_gpu) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(on_gpu), jax.tree.leaves(params)))
    monkeypatch.setattr(packed_gemm, "why_not", lambda *a: "not here")
    stored = storage.prepare(params, platform="cpu")
    assert not any(precision.is_packed(w) for w in jax.tree.leaves(stored,
                                                                   is_leaf=precision.is_packed))
    assert storage.matmuls(stored) == "XLA dots"


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_logits_and_a_layer_matmul_match_the_transposed_form(dtype):
    _, params = _per_layer("llama_tied_mha", dtype)
    plain = jax.tree.map(jnp.asarray, fused.fuse_params(precision.to_storage(params, "cpu")))
    packed = jax.tree.map(jnp.asarray, storage.prepare(params, platform="cpu"))
    assert storage.matmuls(packed) == "cpu_kernels.packed_gemm"
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, params["embed"].shape[1])),
                         dtype)
    got = jax.jit(precision.logits)(packed, hidden)
    want = jax.jit(precision.logits)(plain, hidden)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    w_plain, w_packed = plain["layers"]["wo"][0], packed["layers"]["wo"][0]
    x = hidden[:, :precision.in_out_shape(w_plain)[0]]
    np.testing.assert_allclose(np.asarray(precision.dense(x, w_packed), np.float32),
                               np.asarray(precision.dense(x, w_plain), np.float32),
                               rtol=1e-2 if dtype != np.float32 else 1e-5, atol=1e-5)


def test_a_head_the_kernel_does_not_cover_keeps_xlas_dot():
    # a vocabulary of 250 is not a multiple of 16: the tied head [d, V] stays the embedding's
    layer = {precision.OUT_IN: np.ones((32, 32), np.float32)}
    for head in ({"embed": np.ones((250, 32), np.float32)},
                 {"embed": np.ones((256, 32), np.float32), "lm_head": np.ones((32, 250), np.float32)}):
        stored = storage.prepare({**head, "layers": {"wo": (layer,)}}, platform="cpu")
        assert storage.TIED_HEAD not in stored
        assert not precision.is_packed(stored.get("lm_head"))
        assert precision.is_packed(stored["layers"]["wo"][0])          # the layers still are
