"""The CPU activation-product kernel (`cpu_kernels/silu_mul.cc`) against its reference, the
model's own `activation(gate, "silu") * up` on bf16, and inside the engine. Skipped, with the
reason, where the kernel cannot run (no AVX512-BF16, no g++)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import silu_mul
from jaxbatch.model import layers
from jaxbatch.model.config import ModelConfig

REASON = silu_mul.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

_kernel = jax.jit(silu_mul.silu_mul)


@jax.jit
def _reference(gate_up):
    half = gate_up.shape[1] // 2
    return layers.activation(gate_up[:, :half], "silu") * gate_up[:, half:]


def _case(seed, rows, width, scale=3.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 2 * width)) * scale
    x[0, :8] = [0.0, -0.0, 100.0, -100.0, 1e-30, -90.0, 89.0, np.inf][:min(8, 2 * width)]
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("rows,width", [(1, 16), (7, 40), (64, 1536), (130, 72)])
def test_kernel_matches_its_reference(rows, width):
    """bf16 results, each step in float32 as the reference takes it: only e^x differs (by an
    ulp or so of float32), so a result may differ by one bf16 step where the float32 value
    sits on a rounding boundary, and never by more."""
    x = _case(rows * 7 + width, rows, width)
    out, ref = _kernel(x), _reference(x)
    assert out.dtype == jnp.bfloat16 and out.shape == (rows, width)
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    ok = ~np.isnan(a)
    same = a[ok] == b[ok]
    assert same.mean() > 0.999, f"{(~same).sum()} of {same.size} differ"
    step = np.abs(b[ok]) * 2.0 ** -7 + 1e-38                 # one bf16 step at that magnitude
    with np.errstate(invalid="ignore"):                       # inf - inf where both are inf
        assert np.all(same | (np.abs(a[ok] - b[ok]) <= step))


def test_a_row_alone_equals_the_row_in_a_batch():
    x = _case(5, 96, 576)          # past the size where helpers join
    batch = np.asarray(_kernel(x)).view(np.uint16)
    for start, rows in ((0, 1), (37, 1), (10, 16)):
        part = np.asarray(_kernel(x[start:start + rows])).view(np.uint16)
        np.testing.assert_array_equal(part, batch[start:start + rows])


def test_refuses_what_it_does_not_cover():
    assert silu_mul.why_not(jnp.bfloat16) is None
    assert "float32" in silu_mul.why_not(jnp.float32)
    with pytest.raises(ValueError, match="bf16 gate_up"):
        silu_mul.silu_mul(jnp.zeros((2, 6), jnp.float32))
    with pytest.raises(ValueError, match="bf16 gate_up"):
        silu_mul.silu_mul(jnp.zeros((2, 5), jnp.bfloat16))


def test_the_model_uses_it_only_where_it_computes_the_same_thing():
    cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=4)
    x = jnp.zeros((2, 4), jnp.bfloat16)
    fused = {"w_gate_up": None}
    assert layers._fused_silu_mul_covers(fused, cfg, x)
    assert not layers._fused_silu_mul_covers(fused, cfg, x.astype(jnp.float32))
    assert not layers._fused_silu_mul_covers({"w_gate": None, "w_up": None}, cfg, x)
    assert not layers._fused_silu_mul_covers({**fused, "lora_w_up": None}, cfg, x)
    gelu = ModelConfig(**{**cfg.__dict__, "hidden_act": "gelu_tanh"})
    assert not layers._fused_silu_mul_covers(fused, gelu, x)


def _mlp_text(engine, kind="decode"):
    runner = engine.runner
    key = [k for k in runner.layout.bucket_shapes() if k[0] == kind][-1]
    return runner.executables.lower(key, runner.example_args(key)).compile().as_text()


def test_the_engine_runs_it_in_bf16_and_agrees_with_the_jnp_path(monkeypatch):
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    prompts, params = greedy_case()
    with_kernel = tiny_engine_in(jnp.bfloat16)
    for kind in ("decode", "prefill"):          # once in the layer loop's body
        assert f'custom_call_target="{silu_mul.TARGET}"' in _mlp_text(with_kernel, kind), kind
    outs = run_all(with_kernel, prompts, params)
    monkeypatch.setattr(silu_mul, "why_not", lambda *a: "off")
    plain = tiny_engine_in(jnp.bfloat16)
    assert f'"{silu_mul.TARGET}"' not in _mlp_text(plain)
    agree = tokens_agreeing(outs, run_all(plain, prompts, params), logprob_tol=0.05)
    assert agree >= 30, f"only {agree} of 40 greedy tokens agree before a divergence"
    assert f'"{silu_mul.TARGET}"' not in _mlp_text(tiny_engine_in(jnp.float32))
