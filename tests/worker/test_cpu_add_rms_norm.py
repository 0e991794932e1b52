"""The residual add + RMSNorm kernel (`cpu_kernels/add_rms_norm.cc`): bit for bit its spec,
written here in numpy float32 (the sum rounded to bf16, `ordered_sum`'s tree, IEEE sqrt and
division, every step rounded on its own); within a bf16 step of the jnp form that other
platforms run (`norms.add_rms_norm`, where XLA:CPU approximates sqrt and division), the sums
identical; the same bits whatever the batch; and where the decoder uses it. Skipped, with the
reason, where the kernel cannot run (no AVX512-BF16, no g++)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpu_kernels import add_rms_norm as kernel
from jaxbatch.model import norms

REASON = kernel.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

EPS = 1e-5
F32 = np.float32


def _spec(x, h, w, offset):
    """The kernel's math in numpy float32: numpy rounds every op on its own, IEEE."""
    total = (np.asarray(x, F32) + np.asarray(h, F32)).astype(ml_dtypes.bfloat16)
    t32 = total.astype(F32)
    d = t32.shape[-1]
    chunks = np.zeros((t32.shape[0], -(-d // 16) * 16), F32)
    chunks[:, :d] = t32 * t32
    chunks = chunks.reshape(t32.shape[0], -1, 16)
    while chunks.shape[1] > 1:                      # pallas_kernels/ordered_sum.py's tree
        if chunks.shape[1] % 2:
            chunks = np.concatenate([chunks, np.zeros_like(chunks[:, :1])], axis=1)
        half = chunks.shape[1] // 2
        chunks = chunks[:, :half] + chunks[:, half:]
    lanes = chunks[:, 0]
    while lanes.shape[1] > 1:
        half = lanes.shape[1] // 2
        lanes = lanes[:, :half] + lanes[:, half:]
    mean_square = lanes * (F32(1) / F32(d))                                   # [T, 1]
    inv = F32(1) / np.sqrt(mean_square + F32(EPS))
    scale = np.asarray(w, F32) + F32(offset)
    return total, ((t32 * inv) * scale).astype(ml_dtypes.bfloat16)


@functools.partial(jax.jit, static_argnums=3)
def _jnp_form(x, h, w, offset):
    return norms.add_rms_norm(x, h, w, EPS, offset)


def _case(seed, t, d, scale):
    rng = np.random.default_rng(seed)
    x, h = (jnp.asarray(rng.standard_normal((t, d)) * scale, jnp.bfloat16) for _ in range(2))
    return x, h, jnp.asarray(rng.standard_normal(d), jnp.bfloat16)


def _bits(a):
    return np.asarray(a).view(np.uint16)


_fused = jax.jit(kernel.add_rms_norm, static_argnums=(3, 4))


@pytest.mark.parametrize("t,d", [(1, 576), (2, 8), (3, 17), (16, 100), (70, 576), (256, 960),
                                 (5, 2048)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_spec_bit_for_bit_and_the_jnp_form_to_a_bf16_step(t, d, scale, offset):
    """d: whole chunks of 16, a partial one, a lone partial chunk, odd chunk counts at several
    levels of the tree; t 70 and 256: rows split over threads."""
    x, h, w = _case(t * 1000 + d, t, d, scale)
    total, normed = _fused(x, h, w, EPS, offset)
    want_total, want_normed = _spec(x, h, w, offset)
    np.testing.assert_array_equal(_bits(total), _bits(want_total))
    np.testing.assert_array_equal(_bits(normed), _bits(want_normed))
    jnp_total, jnp_normed = _jnp_form(x, h, w, offset)
    np.testing.assert_array_equal(_bits(total), _bits(jnp_total))
    got, want = np.asarray(normed, F32), np.asarray(jnp_normed, F32)
    assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -7).all()
    assert (got != want).mean() < 0.01


def test_the_jnp_form_rounds_the_sum_before_the_norm():
    """What the kernel computes, the jnp form computes in one jit too (XLA fusing the add
    into the norm would otherwise square the unrounded float32 sum)."""
    x, h, w = _case(5, 64, 576, 1.0)
    _, fused_norm = _jnp_form(x, h, w, 0.0)
    total = jax.jit(jnp.add)(x, h)
    _, apart = jax.jit(lambda t, w: norms.add_rms_norm(t, jnp.zeros_like(t), w, EPS))(total, w)
    np.testing.assert_array_equal(_bits(fused_norm), _bits(apart))


def test_a_row_alone_equals_the_row_in_a_batch():
    x, h, w = _case(7, 33, 576, 1.0)
    total, normed = _fused(x, h, w, EPS, 0.0)
    for r in (0, 17, 32):
        alone = _fused(x[r:r + 1], h[r:r + 1], w, EPS, 0.0)
        np.testing.assert_array_equal(_bits(alone[0])[0], _bits(total)[r])
        np.testing.assert_array_equal(_bits(alone[1])[0], _bits(normed)[r])


def test_refuses_what_it_does_not_cover():
    x, h, w = _case(1, 4, 64, 1.0)
    with pytest.raises(ValueError, match="add_rms_norm"):
        kernel.add_rms_norm(x.astype(jnp.float32), h, w, EPS)
    with pytest.raises(ValueError, match="add_rms_norm"):
        kernel.add_rms_norm(x, h[:, :32], w, EPS)


def test_the_seam_takes_the_kernel_on_cpu_and_jnp_elsewhere():
    """The engine's add + norm (`worker/kernels.py`): the kernel for a bf16 model on CPU, the
    jnp form for a GPU, a float32 model or kernels turned off; float32 activations handed to
    the kernel's entry keep jnp."""
    from jaxbatch.model.config import ModelConfig
    from jaxbatch.worker.kernels import KernelOptions, choose
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    x, h, w = _case(3, 8, 64, 1.0)

    def text(*args, **how):
        choice = choose(model_cfg=cfg, pool_dtype=jnp.uint16, **how)
        fn = lambda x, h, w: choice.kernels.add_norm(x, h, w, EPS, 0.0)
        return jax.jit(fn).lower(*args).as_text()
    assert "jaxbatch_add_rms_norm" in text(x, h, w, dtype=jnp.bfloat16)
    assert "jaxbatch_add_rms_norm" not in text(x, h, w, dtype=jnp.bfloat16, platform="gpu")
    assert "jaxbatch_add_rms_norm" not in text(x, h, w, dtype=jnp.float32)
    assert "jaxbatch_add_rms_norm" not in text(x, h, w, dtype=jnp.bfloat16,
                                                options=KernelOptions(cpu_kernels="off"))
    f32 = [a.astype(jnp.float32) for a in (x, h, w)]            # float32 models keep jnp
    assert "jaxbatch_add_rms_norm" not in text(*f32, dtype=jnp.bfloat16)


@pytest.mark.parametrize("dtype,expected", [("bfloat16", True), ("float32", False)])
def test_the_engines_bf16_step_calls_it(dtype, expected):
    """A bf16 engine on the embedded model (its matrices on our GEMM): every residual add
    and norm is the kernel, 2 per layer and the final one; float32 keeps XLA's ops."""
    from jaxbatch.engine.llm_engine import LLMEngine
    from jaxbatch.model.loader import load_model
    from forward_helpers import forward_hidden
    loaded = load_model(dtype=dtype)
    engine = LLMEngine(loaded=loaded, max_num_seqs=2, max_model_len=64, warmup=False,
                       async_scheduling=False)
    cfg, params = engine.model_config, engine.runner.params
    tokens = jnp.zeros((4,), jnp.int32)
    kernels = engine.runner.kernels.kernels
    hlo = jax.jit(lambda p, pool: forward_hidden(
        p, cfg, pool, tokens, tokens, tokens, lambda q, *a, **k: q, engine.runner._inv_freq,
        kernels=kernels, form=engine.runner.kernels.weight_form)[0]
    ).lower(params, engine.runner.pool).as_text()
    # two calls in the scanned layer, the final norm's after it
    calls = hlo.count("stablehlo.custom_call @jaxbatch_add_rms_norm(")
    assert calls == (3 if expected else 0), calls
