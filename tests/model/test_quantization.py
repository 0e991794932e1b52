"""int8 quantization helpers: KV round trip and write, weight quantization and its matmul,
pool sizing with the scale bytes, option validation. Tiny arrays, no model."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.model.registry import config_from_hf
from jaxbatch.worker import kv_cache
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.linear import Int8
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.quantize import (QUANTIZED_MATRICES, check_quantization, dequantize_matrix,
                                     params_are_quantized, quantize_matrix,
                                     quantize_params)
from pallas_kernels.int8 import dequantize_int8, quantize_int8, write_kv_int8


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_round_trip_within_half_a_scale_step(rng, xp):
    # Rows of very different magnitudes, one all-zero row (scale 0, no division by zero).
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * np.array([1e-3, 1, 50, 0, 7])[:, None, None]
    q, scale = quantize_int8(xp.asarray(x))
    assert q.dtype == xp.int8 and scale.shape == (5, 3) and scale.dtype == xp.float32
    q, scale = np.asarray(q), np.asarray(scale)
    assert np.abs(q).max() <= 127
    back = np.asarray(dequantize_int8(q, scale))
    err = np.abs(back - x)
    assert (err <= 0.5 * scale[..., None] * (1 + 1e-5) + 1e-12).all()
    assert (back[3] == 0).all() and (scale[3] == 0).all()
    # The largest value of each row is hit exactly (+-127 steps).
    assert (np.abs(q[[0, 1, 2, 4]]).max(axis=-1) == 127).all()


def test_weight_scale_is_per_output_channel(rng):
    w = rng.standard_normal((2, 16, 8)).astype(np.float32)       # [L, in, out]
    w[:, :, 3] *= 100.0                                           # one loud output channel
    qw = quantize_matrix(w)
    assert qw["int8"].shape == (2, 16, 8) and qw["scale"].shape == (2, 8)
    np.testing.assert_allclose(qw["scale"], np.abs(w).max(axis=1) / 127, rtol=1e-6)
    err = np.abs(np.asarray(dequantize_matrix(qw)) - w)
    assert (err <= 0.5 * qw["scale"][:, None, :] * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_int8_matmul_equals_dequantize_then_matmul(rng, dtype, tol):
    x = jnp.asarray(rng.standard_normal((7, 48)), dtype)
    qw = quantize_matrix(rng.standard_normal((48, 24)).astype(np.float32))
    got = np.asarray(Int8(qw["int8"], qw["scale"]).apply(x).astype(jnp.float32))
    want = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize_matrix(qw),
                              precision="highest"))
    assert got.shape == (7, 24)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_quantize_params_covers_the_layer_matrices_only_and_is_idempotent(rng):
    layer = {name: rng.standard_normal((8, 8)).astype(np.float32) for name in QUANTIZED_MATRICES}
    layer.update(attn_norm=np.ones(8, np.float32), mlp_norm=np.ones(8, np.float32))
    params = {"embed": rng.standard_normal((16, 8)).astype(np.float32),
              "final_norm": np.ones(8, np.float32), "layers": [layer, dict(layer)]}
    q = quantize_params(params)
    assert params_are_quantized(q) and not params_are_quantized(params)
    for name in QUANTIZED_MATRICES:
        assert q["layers"][0][name]["int8"].dtype == np.int8
    assert q["embed"] is params["embed"] and q["layers"][0]["attn_norm"] is layer["attn_norm"]
    assert quantize_params(q)["layers"][0]["wq"] is q["layers"][0]["wq"]
    # Stacked and per-layer layouts of the quantized matrices.
    stacked = stack_layers(q, matrices_per_layer=False)["layers"]
    assert stacked["wq"]["int8"].shape == (2, 8, 8) and stacked["wq"]["scale"].shape == (2, 8)
    per_layer = stack_layers(q, matrices_per_layer=True)["layers"]
    assert isinstance(per_layer["wq"], tuple) and len(per_layer["wq"]) == 2
    assert params_are_quantized({"layers": per_layer})


def test_write_kv_int8_stores_values_and_scales_where_the_slots_say(rng):
    kvh, blocks, bs, d, t = 2, 5, 4, 16, 6
    pool = (jnp.zeros((kvh, blocks, bs, d), jnp.int8), jnp.zeros((kvh, blocks, bs, d), jnp.int8),
            jnp.zeros((kvh, blocks, bs), jnp.float32), jnp.zeros((kvh, blocks, bs), jnp.float32))
    k = rng.standard_normal((t, kvh, d)).astype(np.float32)
    v = 3 * rng.standard_normal((t, kvh, d)).astype(np.float32)
    slots = rng.choice(np.arange(bs, blocks * bs), t, replace=False).astype(np.int32)
    kp, vp, ks, vs = write_kv_int8(*pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    b, o = slots // bs, slots % bs
    for pages, scales, want in ((kp, ks, k), (vp, vs, v)):
        back = np.asarray(dequantize_int8(pages[:, b, o], scales[:, b, o])).swapaxes(0, 1)
        assert (np.abs(back - want) <= 0.5 * np.asarray(scales[:, b, o]).T[..., None] + 1e-7).all()
    written = np.zeros((blocks, bs), bool)
    written[b, o] = True
    assert (np.asarray(ks)[:, ~written] == 0).all() and (np.asarray(kp)[:, ~written] == 0).all()


def _cfg(head_dim=64):
    return config_from_hf(dict(
        vocab_size=256, hidden_size=head_dim * 4, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=1e4, architectures=["LlamaForCausalLM"]))


def test_pool_sizing_counts_the_scale_bytes():
    cfg = _cfg()
    f32 = kv_cache.bytes_per_block(cfg, 16, jnp.float32)
    bf16 = kv_cache.bytes_per_block(cfg, 16, jnp.bfloat16)
    int8 = kv_cache.bytes_per_block(cfg, 16, jnp.bfloat16, "int8")
    assert int8 == 2 * 3 * 2 * 16 * (64 + 4)
    assert int8 == kv_cache.bytes_per_block(cfg, 16, jnp.float32, "int8")   # model dtype moot
    assert bf16 / int8 == pytest.approx(128 / 68) and f32 / int8 == pytest.approx(256 / 68)
    budget = 1 << 22
    assert kv_cache.blocks_for_budget(cfg, 16, jnp.bfloat16, budget, "int8") == budget // int8
    pool = kv_cache.allocate_pool(cfg, 7, 16, jnp.bfloat16, "int8")
    assert [a.dtype for a in pool] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    assert pool[0].shape == (2, 21, 16, 64) and pool[2].shape == (2, 21, 16)
    assert sum(a.nbytes for a in pool) == 7 * int8


def test_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        kv_cache.check_kv_cache_dtype("fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache.allocate_pool(_cfg(), 4, 16, jnp.float32, "int4")
    with pytest.raises(ValueError, match="quantization='int4'"):
        check_quantization("int4")
    check_quantization(None)
    check_quantization("int8")
