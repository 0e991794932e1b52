"""A layer written in another order runs on whatever kernels the engine chose, with no change
outside model/: here each layer's MLP before its attention (a toy, not a family), written only
with model/'s pieces, computes on the CPU seam's kernels (packed GEMMs, the C++ add + norm)
what it computes on the plain-jnp ones."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forward_helpers import CPU_FORM
from jaxbatch.model.inputs import KVPool
from jaxbatch.model.layers import Layer, attention_block, mlp_block, unsharded
from jaxbatch.model.linear import Linear
from jaxbatch.model.lora_delta import NO_LORA
from jaxbatch.model.rope import inverse_frequencies, rope_tables
from jaxbatch.worker import kv_cache
from jaxbatch.worker.attention import get_backend
from jaxbatch.worker.kernels import KernelOptions, choose
from jaxbatch.worker.weight_forms import prepare
from tiny_models import make_hf_model, ours_from_hf


def mlp_first(params, cfg, kernels, pool, tokens, positions, slots, attend):
    """Each layer: x += mlp(norm(x)); x += attention(norm(x)) (the reverse of Llama's)."""
    x = params["embed"][tokens]
    rope = rope_tables(positions, jnp.asarray(inverse_frequencies(cfg)), cfg.rope_attention_factor)
    layers = params["layers"]
    h = jnp.zeros_like(x)
    for i in range(cfg.num_layers):
        vectors = {k: v[i] for k, v in layers.items() if not isinstance(v, Linear)}
        layer = Layer({**layers, **vectors}, i, NO_LORA)
        x, normed = kernels.add_norm(x, h, layer["mlp_norm"], cfg.rms_norm_eps)
        h = mlp_block(kernels, layer, cfg, normed)
        x, normed = kernels.add_norm(x, h, layer["attn_norm"], cfg.rms_norm_eps)
        h, pool = attention_block(kernels, layer, cfg, normed, rope, slots, pool,
                                  i * (pool.k.shape[1] // cfg.num_layers), attend, None, unsharded)
    return kernels.add_norm(x, h, params["final_norm"], cfg.rms_norm_eps)[1]


def test_a_reordered_layer_computes_the_same_on_the_cpu_kernels_as_on_jnp():
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=2))
    params = jax.tree.map(lambda a: np.asarray(a, jnp.bfloat16), params)
    from jaxbatch.model.decoder import stack_layers
    params = stack_layers(params, matrices_per_layer=True)
    seam = choose(model_cfg=cfg, dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16,
                  options=KernelOptions(cpu_gemm="packed"))
    if not seam.weight_form.packed:
        pytest.skip(seam.describe()["matmul"])
    n, block_size, pages = 40, 4, 12                      # 40 rows: the silu epilogue runs too
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, n).astype(np.int32)
    positions = np.arange(n, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]
    slots = table[0, positions // block_size] * block_size + positions % block_size
    meta = tuple(jnp.asarray(a) for a in (np.array([n], np.int32), table,
                                         np.array([0, n], np.int32), np.ones(1, np.int32)))
    attend = get_backend("reference").prefill_attend(meta, cfg.head_dim ** -0.5)
    out = {}
    for name, form, kernels in (("jnp", CPU_FORM, choose(model_cfg=cfg, dtype=jnp.bfloat16,
                                                          pool_dtype=jnp.bfloat16,
                                                          platform="gpu").kernels),
                                ("cpu", seam.weight_form, seam.kernels)):
        typed = jax.tree.map(jnp.asarray, prepare(params, form))
        pool = kv_cache.allocate_pool(cfg, pages + 1, block_size, jnp.bfloat16)
        run = jax.jit(lambda p, pool: mlp_first(p, cfg, kernels.for_call(jnp.int32(n)), pool,
                                                tokens, positions, slots, attend))
        text = jax.jit(lambda p, pool: mlp_first(p, cfg, kernels, pool, tokens, positions, slots,
                                                 attend)).lower(typed, pool).as_text()
        out[name] = (np.asarray(run(typed, pool), np.float32), text)
    assert "jaxbatch_packed_gemm" in out["cpu"][1] and "jaxbatch_add_rms_norm" in out["cpu"][1]
    assert "jaxbatch_" not in out["jnp"][1]
    np.testing.assert_allclose(out["cpu"][0], out["jnp"][0], atol=0.1, rtol=0.05)
