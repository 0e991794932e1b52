"""The sampler's own reductions (jaxbatch/worker/sampler.py)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.worker.argmax import two_level_argmax as first_argmax


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


@pytest.mark.parametrize("vocab", [100, 128, 4096, 49152, 4099])
def test_argmax_among_many_ties_across_and_within_chunks(vocab):
    """Few distinct values: every row has its maximum many times, in several chunks of the
    two-level search and several times within a chunk; the first must win, NaN as +inf."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(0, 4, (64, vocab)).astype(np.float32)
    x[::7, rng.integers(0, vocab, 8)] = np.nan
    x[::5, rng.integers(0, vocab, 3)] = np.inf
    x[3] = -np.inf
    x[4, vocab - 1] = 9.0                         # the last element, past the last full chunk
    expected = np.argmax(np.where(np.isnan(x), np.inf, x), axis=-1)
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), expected)


def _row(seq_id, logprobs=None, banned=()):
    from jaxbatch.core.plan import SamplingRow
    return SamplingRow(seq_id=seq_id, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                       presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                       seed=seq_id, position=7, num_prompt_tokens=3, history=[],
                       banned_token_ids=list(banned), logprobs=logprobs)


def test_logprobs_and_held_back_tokens_reach_exactly_the_rows_that_ask():
    """Logprobs and min_tokens' held-back ids are branches a step without such a row skips:
    the rows that ask get them, the others' tokens are unchanged."""
    import jax

    from jaxbatch.sampling_params import MAX_LOGPROBS
    from jaxbatch.worker.sampler import build_sampling_arrays, sample

    rng = np.random.default_rng(1)
    vocab = 1000
    logits = rng.standard_normal((4, vocab)).astype(np.float32) * 3
    greedy = np.argmax(logits, axis=-1)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    run = jax.jit(sample)

    def sample_rows(rows):
        arrays = build_sampling_arrays(rows, 16, vocab_size=vocab)
        return [np.asarray(a) for a in run(jnp.asarray(logits), jax.tree.map(jnp.asarray, arrays))]

    tokens, token_lp, top_ids, top_lp = sample_rows([_row(i) for i in range(4)])
    np.testing.assert_array_equal(tokens, greedy)
    assert not token_lp.any() and not top_ids.any() and not top_lp.any()   # nobody asked

    # logprobs=0 alone: the token's logprob, no top-k.
    tokens, token_lp, top_ids, _ = sample_rows([_row(0), _row(1, logprobs=0), _row(2), _row(3)])
    np.testing.assert_allclose(token_lp[1], raw[1, tokens[1]], rtol=1e-5, atol=1e-5)
    assert not top_ids.any()

    # Row 1 wants its token's logprob only, row 2 the top 3 too, row 3 holds back its argmax.
    tokens, token_lp, top_ids, top_lp = sample_rows(
        [_row(0), _row(1, logprobs=0), _row(2, logprobs=3), _row(3, banned=[greedy[3]])])
    np.testing.assert_array_equal(tokens[:3], greedy[:3])
    assert tokens[3] != greedy[3]
    assert tokens[3] == np.argsort(-logits[3])[1]
    for i in (1, 2):
        np.testing.assert_allclose(token_lp[i], raw[i, tokens[i]], rtol=1e-5, atol=1e-5)
    order = np.argsort(-raw[2])[:MAX_LOGPROBS]
    np.testing.assert_array_equal(top_ids[2], order)
    np.testing.assert_allclose(top_lp[2], raw[2, order], rtol=1e-5, atol=1e-5)


def test_logit_bias_moves_exactly_its_rows_and_leaves_logprobs_raw():
    """A bias is added to its row's logits before sampling: +100 makes a token the greedy
    choice, -100 takes the argmax away; rows without one sample as before, and a sampled
    row with a seed draws the same token alone as in the batch (batch invariance)."""
    import dataclasses

    import jax

    from jaxbatch.worker.sampler import build_sampling_arrays, sample

    rng = np.random.default_rng(2)
    vocab = 1000
    logits = rng.standard_normal((4, vocab)).astype(np.float32) * 3
    greedy = np.argmax(logits, axis=-1)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    run = jax.jit(sample)

    def sample_rows(rows, which=slice(None)):
        arrays = build_sampling_arrays(rows, 16, vocab_size=vocab)
        out = run(jnp.asarray(logits[which]), jax.tree.map(jnp.asarray, arrays))
        return [np.asarray(a) for a in out]

    lift = int(np.argsort(-logits[1])[500])            # far from the top
    sampled = dataclasses.replace(_row(3, logprobs=0), temperature=1.0,
                                  logit_bias={int(greedy[3]): -100.0, 17: 2.5})
    rows = [_row(0), dataclasses.replace(_row(1, logprobs=0), logit_bias={lift: 100.0}),
            dataclasses.replace(_row(2), logit_bias={int(greedy[2]): -100.0}), sampled]
    tokens, token_lp, _, _ = sample_rows(rows)
    assert tokens[0] == greedy[0]
    assert tokens[1] == lift
    np.testing.assert_allclose(token_lp[1], raw[1, lift], rtol=1e-5, atol=1e-5)   # raw
    assert tokens[2] == np.argsort(-logits[2])[1]
    assert tokens[3] != greedy[3]
    alone, _, _, _ = sample_rows([sampled], slice(3, 4))
    assert alone[0] == tokens[3]
    # All rows greedy (the step's plain-argmax shortcut must not skip the bias).
    np.testing.assert_array_equal(sample_rows(rows[:3], slice(0, 3))[0],
                                  [greedy[0], lift, np.argsort(-logits[2])[1]])
    # Without any bias the same rows give the plain choices.
    plain = [dataclasses.replace(r, logit_bias=None) for r in rows[:3]]
    np.testing.assert_array_equal(sample_rows(plain, slice(0, 3))[0], greedy[:3])
