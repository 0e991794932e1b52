"""The CPU argmax kernel (`cpu_kernels/first_argmax.cc`) against numpy's first maximum with NaN
as +inf and against the jnp form it replaces (`argmax.two_level_argmax`), exactly; and every
sampling path taking it on CPU. Skipped, with the reason, where the kernel cannot run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import first_argmax as kernel
from jaxbatch.worker import argmax

REASON = kernel.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def _oracle(x):
    return np.argmax(np.where(np.isnan(x), np.inf, x), axis=-1).astype(np.int32)


def _hard_rows(rows: int, vocab: int, seed: int) -> np.ndarray:
    """Few distinct values (ties within and across 16-lane blocks), NaN, +-inf, an all -inf
    row, a maximum in the last element (past the last full block when vocab % 16), -0 and +0."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 4, (rows, vocab)).astype(np.float32)
    x[::7, rng.integers(0, vocab, 5)] = np.nan
    x[::5, rng.integers(0, vocab, 3)] = np.inf
    x[1 % rows] = -np.inf
    x[2 % rows, vocab - 1] = 9.0
    x[3 % rows] = np.where(rng.random(vocab) < 0.5, -0.0, 0.0)
    x[4 % rows] = rng.standard_normal(vocab).astype(np.float32)
    return x


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 17), (3, 100), (4, 4099), (16, 49152),
                                        (64, 1000), (9, 128)])
def test_the_first_maximum_with_nan_as_inf_exactly_as_the_jnp_form(rows, vocab):
    x = _hard_rows(rows, vocab, rows * 7 + vocab)
    got = np.asarray(jax.jit(kernel.first_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got, _oracle(x))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(argmax.two_level_argmax)(x)))


def test_a_row_alone_equals_the_row_in_a_batch():
    x = _hard_rows(16, 4099, 3)
    whole = np.asarray(kernel.first_argmax(jnp.asarray(x)))
    alone = [int(kernel.first_argmax(jnp.asarray(x[i:i + 1]))[0]) for i in range(16)]
    np.testing.assert_array_equal(whole, alone)


def test_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="float32 x"):
        kernel.first_argmax(jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 x"):
        kernel.first_argmax(jnp.zeros((8,), jnp.float32))


def test_every_sampling_path_takes_it_on_cpu_and_jnp_elsewhere():
    """The engine's argmax (`worker/kernels.py`) is the kernel on CPU (greedy, Gumbel-max and
    the rejection step's resample all call it), the jnp form for a GPU and for other dtypes."""
    import functools
    from jaxbatch.model.config import ModelConfig
    from jaxbatch.worker import sampler
    from jaxbatch.worker.kernels import choose
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    on_cpu = choose(model_cfg=cfg, dtype=jnp.float32, pool_dtype=jnp.float32).argmax
    on_gpu = choose(model_cfg=cfg, dtype=jnp.float32, pool_dtype=jnp.float32,
                    platform="gpu").argmax
    assert on_gpu is argmax.two_level_argmax
    x = jnp.zeros((4, 300), jnp.float32)
    assert kernel.TARGET in jax.jit(on_cpu).lower(x).as_text()
    assert kernel.TARGET not in jax.jit(on_gpu).lower(x).as_text()
    assert kernel.TARGET not in jax.jit(on_cpu).lower(x.astype(jnp.bfloat16)).as_text()
    rows = [None] * 4
    arrays = sampler.build_sampling_arrays(rows, 16, vocab_size=300)
    sample = functools.partial(sampler.sample, argmax=on_cpu)
    text = jax.jit(sample).lower(x, arrays).as_text()
    assert text.count(f"@{kernel.TARGET}(") >= 2          # the plain greedy branch and _choose's
