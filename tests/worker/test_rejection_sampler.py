"""The rejection step of speculative sampling, alone: for draft tokens drawn from q, its outputs
are distributed as the target's p (chi-square goodness of fit over tens of thousands of samples
on an 8-token vocabulary), for q overlapping p, q with mass where p has none and the reverse, a
one-hot q, q == p; a proposal is output exactly when it is accepted. Two wrong samplers fail
the same test, so it can fail."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxbatch.worker.rejection_sampler import rejection_sample

VOCAB = 8
NUM_SAMPLES = 40_000
# Fixed keys make each statistic a fixed number; a correct sampler passes at p-value > 1e-3
# (a wrong one, below, scores p-values of ~0: chi-square in the thousands).
MIN_P_VALUE = 1e-3


def _dist(rng, zero=()):
    w = rng.random(VOCAB) + 0.05
    w[list(zero)] = 0.0
    return (w / w.sum()).astype(np.float32)


def _cases():
    rng = np.random.default_rng(0)
    one_hot = np.zeros(VOCAB, np.float32)
    one_hot[3] = 1.0
    p_common = _dist(rng)
    return {
        "overlapping": (_dist(rng), _dist(rng)),
        "q_mass_where_p_has_none": (_dist(rng, zero=(0, 5)), _dist(rng)),
        "p_mass_where_q_has_none": (_dist(rng), _dist(rng, zero=(1, 2, 6))),
        "both_with_holes": (_dist(rng, zero=(0, 1)), _dist(rng, zero=(6, 7))),
        "one_hot_q": (_dist(rng), one_hot),
        "q_equals_p": (p_common, p_common),
    }


def draw(p, q, sampler=rejection_sample, seed=0):
    """NUM_SAMPLES independent rows: d ~ q, then the sampler's output -> (drafts, outputs)."""
    k_draft, k_u, k_g = jax.random.split(jax.random.key(seed), 3)
    p_rows = jnp.broadcast_to(jnp.asarray(p), (NUM_SAMPLES, VOCAB))
    q_rows = jnp.broadcast_to(jnp.asarray(q), (NUM_SAMPLES, VOCAB))
    drafts = jax.random.categorical(k_draft, jnp.log(q_rows)).astype(jnp.int32)
    u = jax.random.uniform(k_u, (NUM_SAMPLES,))
    gumbel = jax.random.gumbel(k_g, (NUM_SAMPLES, VOCAB))
    out = jax.jit(sampler)(p_rows, q_rows, drafts, u, gumbel)
    return np.asarray(drafts), np.asarray(out), np.asarray(u)


def chi_square(p, tokens):
    """Pearson's statistic of the token counts against p, over p's support (a token outside
    it is an outright failure) -> (statistic, p-value)."""
    counts = np.bincount(tokens, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0, f"sampled tokens p excludes: {counts}"
    expected = p[support].astype(np.float64)
    expected = expected / expected.sum() * len(tokens)
    return stats.chisquare(counts[support], expected)


@pytest.mark.parametrize("case", list(_cases()))
def test_output_is_distributed_as_the_target(case):
    p, q = _cases()[case]
    drafts, out, u = draw(p, q)
    statistic, p_value = chi_square(p, out)
    print(f"{case}: chi2={statistic:.2f} (dof {int((p > 0).sum()) - 1}), p-value={p_value:.3f}")
    assert p_value > MIN_P_VALUE, (case, statistic)
    # Output == proposal exactly when accepted (u < p(d)/q(d)): the scheduler's rule.
    accepted = u * q[drafts] < p[drafts]
    np.testing.assert_array_equal(out == drafts, accepted)
    # And it accepts as often as theory says: sum_x min(p(x), q(x)).
    assert abs(accepted.mean() - np.minimum(p, q).sum()) < 0.01
    if case == "q_equals_p":
        assert accepted.all()


def _accept_always(p, q, draft, u, gumbel):
    return draft


def _resample_from_p(p, q, draft, u, gumbel):
    """Rejects correctly but resamples from p instead of the residual: biased towards the
    tokens q over-proposes."""
    p_d = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    resampled = jnp.argmax(jnp.log(p) + gumbel, axis=-1)
    return jnp.where(u * q_d < p_d, draft, resampled).astype(jnp.int32)


@pytest.mark.parametrize("wrong", [_accept_always, _resample_from_p])
def test_a_wrong_sampler_fails_the_same_test(wrong):
    p, q = _cases()["overlapping"]
    _, out, _ = draw(p, q, sampler=wrong)
    statistic, p_value = chi_square(p, out)
    print(f"{wrong.__name__}: chi2={statistic:.1f}, p-value={p_value:.2e}")
    assert p_value < 1e-12 and statistic > 100
