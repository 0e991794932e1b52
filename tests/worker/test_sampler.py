"""The sampler's own reductions (jaxbatch/worker/sampler.py)."""
import jax.numpy as jnp
import numpy as np

from jaxbatch.worker.argmax import first_argmax


def test_argmax_is_the_first_maximum_with_nan_as_inf():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4099)).astype(np.float32)
    x[0, [7, 4000]] = 30.0                       # ties: the first wins
    x[1, :] = -np.inf                            # all banned: index 0
    x[2, 11] = np.nan                            # NaN beats every finite value
    x[3, [5, 9]] = [np.inf, np.nan]              # NaN ties with +inf: the first of them
    x[4, -1] = 99.0                              # the last element
    expected = np.argmax(np.where(np.isnan(x), np.inf, x), axis=-1)
    got = np.asarray(first_argmax(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(expected, [7, 0, 11, 5, 4098, expected[5]])
