"""q/k/v and gate/up fused per layer on CPU (`model/fused.py`): the fused matrix holds its parts
exactly, splits back for restacking, names its parts' shapes for LoRA, and a model computes
with it what it computes with the parts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.lora.pool import target_shapes
from jaxbatch.model import fused, llama, precision
from jaxbatch.model.quantize import is_quantized, quantize_params
from jaxbatch.model.rope import inverse_frequencies
from jaxbatch.worker import kv_cache
from jaxbatch.worker.attention import get_backend
from tiny_models import make_hf_model, ours_from_hf


def _stored(params):
    """The CPU storage form, before fusing: per-layer tuples of {OUT_IN: [out, in]}."""
    return precision.to_storage(llama.stack_layers(params, matrices_per_layer=True),
                                platform="cpu")


def test_fused_matrices_hold_their_parts_and_split_back():
    cfg, params = ours_from_hf(make_hf_model("llama_gqa4_bias", seed=3))   # 4 q heads, 1 kv head
    stored = _stored(params)
    layers = fused.fuse(stored["layers"])
    assert {"wqkv", "w_gate_up"} <= set(layers)
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layers)
    assert fused.fuse(layers) == layers                                       # idempotent
    q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    assert fused.part_widths(layers, "wqkv") == (q, kv, kv)
    assert fused.part_widths(layers, "w_gate_up") == (cfg.intermediate_size,) * 2
    for i, layer in enumerate(params["layers"]):
        want = np.concatenate([np.asarray(layer[p]).T for p in ("wq", "wk", "wv")])
        np.testing.assert_array_equal(np.asarray(layers["wqkv"][i][precision.OUT_IN]), want)
    back = fused.unfuse(layers)
    assert set(back) == set(stored["layers"])
    for name, value in stored["layers"].items():
        for got, want in zip(jax.tree.leaves(back[name]), jax.tree.leaves(value)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # LoRA targets the parts, fused or not; restacking (tensor parallelism) gets the parts.
    assert target_shapes({"layers": layers}) == target_shapes(stored) == {
        "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
        "w_gate": (d, cfg.intermediate_size), "w_up": (d, cfg.intermediate_size),
        "w_down": (cfg.intermediate_size, d)}
    restacked = llama.stack_layers({**stored, "layers": layers}, matrices_per_layer=False)
    for name in ("wq", "wv", "w_up"):
        np.testing.assert_array_equal(np.asarray(restacked["layers"][name]),
                                      np.stack([np.asarray(l[name]) for l in params["layers"]]))


def test_the_forward_is_the_same_with_fused_and_separate_projections():
    cfg, params = ours_from_hf(make_hf_model("qwen2_qkv_bias", seed=4))
    stored = jax.tree.map(jnp.asarray, _stored(params))
    fused_params = fused.fuse_params(stored)
    assert "wqkv" in fused_params["layers"] and "wqkv" not in stored["layers"]
    num_tokens, block_size, pages = 12, 4, 4
    pool = kv_cache.allocate_pool(cfg, pages + 1, block_size, jnp.float32)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, num_tokens).astype(np.int32)
    positions = np.arange(num_tokens, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]                # block 0: the null block
    slots = table[0, positions // block_size] * block_size + positions % block_size
    meta = (np.array([num_tokens], np.int32), table, np.array([0, num_tokens], np.int32),
            np.ones(1, np.int32))                                          # one sequence

    @jax.jit
    def logits(p, meta):
        attend = get_backend("reference").prefill_attend(meta, cfg.head_dim ** -0.5)
        hidden, _ = llama.forward_hidden(p, cfg, pool, tokens, positions, slots, attend,
                                         jnp.asarray(inverse_frequencies(cfg)))
        return llama.compute_logits(p, hidden)
    np.testing.assert_allclose(np.asarray(logits(fused_params, meta)),
                               np.asarray(logits(stored, meta)), rtol=1e-5, atol=1e-5)


def test_int8_quantizes_the_parts_of_fused_matrices():
    """A float model loaded on CPU holds fused matrices; quantizing it (an engine's
    quantization="int8" on such a `loaded`) gives int8 parts, never a fused int8 matrix."""
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=5))
    stored = fused.fuse_params(_stored(params))
    q = quantize_params(stored)["layers"]
    assert not set(fused.FUSED) & set(q)
    assert all(is_quantized(q[p][0]) for parts in fused.FUSED.values() for p in parts)
    assert target_shapes({"layers": q}) == target_shapes(stored)
