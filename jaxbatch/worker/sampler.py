"""Sampling on device, one row per sequence, every row independent of the others: its softmax
sums go through `ordered_sum`, whose result does not depend on how many rows the call has (top-p's
cumulative sum is still `jnp.cumsum`).

Randomness comes from a key folded from (sequence seed, position of the sampled token), so a
sequence draws the same noise alone or in any batch, and again after a preemption.

Logit bias, penalties, logprobs (the log-softmax over the vocabulary; top-k on top) and
min_tokens' held-back ids are runtime branches (`lax.cond` on a flag), not compile-time variants: one
executable per shape serves every request, so nothing compiles mid-serving when the first
request asking for them arrives, and a step where no row asks pays nothing for them.

A grammar's packed bitmask (structured outputs, jaxbatch/structured/) is a runtime input of the
same kind: `any_bitmask` false on steps without grammar rows, whose all-ones mask stays on
device (the runner keeps one per row count), so they transfer and compile nothing new.

Speculative decoding with sampled drafts (`draft_sampling="sampled"`) adds two functions that
only such engines compile: `sample_with_probs` (the draft model: its tokens and the q each came
from) and `sample_verified` (the target's decode calls carrying q: the rejection step of
jaxbatch/worker/rejection_sampler.py against the same p plain sampling draws from). `sample` is
unchanged by them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.core.plan import SamplingRow
from jaxbatch.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxbatch.worker.argmax import two_level_argmax
from jaxbatch.worker.rejection_sampler import rejection_sample
from pallas_kernels.ordered_sum import ordered_log_softmax, ordered_softmax

MAX_BANNED = 16   # EOS + stop_token_ids held back while min_tokens is not reached
VERIFY_SALT = 0x5EC0DE   # folded into a row's key for the rejection step's uniform


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    temperature: jax.Array      # [N] f32; 0 = greedy
    top_k: jax.Array            # [N] i32; 0 = off
    top_p: jax.Array            # [N] f32
    min_p: jax.Array            # [N] f32
    presence: jax.Array         # [N] f32
    frequency: jax.Array        # [N] f32
    repetition: jax.Array       # [N] f32
    seed: jax.Array             # [N] u32
    position: jax.Array         # [N] i32
    banned: jax.Array           # [N, MAX_BANNED] i32, -1 = none
    history: jax.Array          # [N, H] i32 prompt + output tokens, -1 padded (H = max_model_len)
    num_prompt: jax.Array       # [N] i32
    any_penalties: jax.Array    # [] bool: some row has a penalty (and its history filled)
    any_logprobs: jax.Array     # [] bool: some row wants top-k logprobs
    any_token_logprob: jax.Array  # [] bool: some row wants its token's logprob (logprobs set)
    bitmask: jax.Array          # [N, ceil(V/32)] i32 packed allowed tokens (bit v%32 of word v//32)
    any_bitmask: jax.Array      # [] bool: some row follows a grammar (its bitmask row filled)
    bias_ids: jax.Array         # [N, MAX_LOGIT_BIAS] i32 logit_bias token ids, -1 = none
    bias_values: jax.Array      # [N, MAX_LOGIT_BIAS] f32 the bias added to each of them
    any_bias: jax.Array         # [] bool: some row has a logit_bias (its bias rows filled)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_sampling_arrays(rows: list[SamplingRow | None], history_len: int,
                          unused_history=None, bitmask: np.ndarray | None = None,
                          unused_bitmask=None, vocab_size: int | None = None,
                          unused_bias=None) -> SamplingArrays:
    """Host side: rows (None = empty slot, sampled greedily and ignored) -> numpy arrays.
    `unused_history`: an [N, history_len] array of -1 to pass when no row has a penalty (the
    runner keeps one on device per row count, so such steps transfer nothing for it).
    `bitmask`: [N, ceil(V/32)] int32 from the grammar matchers, or None when no row has a
    grammar; then `unused_bitmask` (all -1, kept on device) or a new one for `vocab_size`.
    `unused_bias`: (ids all -1, values 0), kept on device, for steps where no row has a
    logit_bias."""
    n = len(rows)
    f32 = lambda attr, default: np.array([getattr(r, attr) if r else default for r in rows], np.float32)
    banned = np.full((n, MAX_BANNED), -1, np.int32)
    any_penalties = any(r is not None and r.history for r in rows)
    if any_penalties or unused_history is None:
        history = np.full((n, history_len), -1, np.int32)
    else:
        history = unused_history
    for i, r in enumerate(rows):
        if r is None:
            continue
        if len(r.banned_token_ids) > MAX_BANNED:
            raise ValueError(f"at most {MAX_BANNED} EOS + stop_token_ids can be held back by min_tokens")
        banned[i, :len(r.banned_token_ids)] = r.banned_token_ids
        if r.history:
            history[i, :len(r.history)] = r.history
    bias_ids, bias_values, any_bias = _bias_arrays(rows, unused_bias)
    any_bitmask = bitmask is not None
    if bitmask is None:
        bitmask = (unused_bitmask if unused_bitmask is not None
                   else np.full((n, bitmask_words(vocab_size)), -1, np.int32))
    return SamplingArrays(
        temperature=f32("temperature", 0.0), top_k=np.array([r.top_k if r else 0 for r in rows], np.int32),
        top_p=f32("top_p", 1.0), min_p=f32("min_p", 0.0), presence=f32("presence_penalty", 0.0),
        frequency=f32("frequency_penalty", 0.0), repetition=f32("repetition_penalty", 1.0),
        seed=np.array([(r.seed if r else 0) & 0xFFFFFFFF for r in rows], np.uint32),
        position=np.array([r.position if r else 0 for r in rows], np.int32),
        banned=banned, history=history,
        num_prompt=np.array([r.num_prompt_tokens if r else 0 for r in rows], np.int32),
        any_penalties=np.bool_(any_penalties),
        any_logprobs=np.bool_(any(r is not None and r.logprobs for r in rows)),
        any_token_logprob=np.bool_(any(r is not None and r.logprobs is not None for r in rows)),
        bitmask=bitmask, any_bitmask=np.bool_(any_bitmask),
        bias_ids=bias_ids, bias_values=bias_values, any_bias=np.bool_(any_bias))


def _bias_arrays(rows: list[SamplingRow | None], unused_bias):
    """(ids [N, MAX_LOGIT_BIAS], values, any): each row's logit_bias, -1 / 0 padded."""
    n = len(rows)
    if not any(r is not None and r.logit_bias for r in rows):
        if unused_bias is not None:
            return (*unused_bias, False)
        return np.full((n, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((n, MAX_LOGIT_BIAS), np.float32), False
    ids = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(rows):
        if r is None or not r.logit_bias:
            continue
        if len(r.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries per request")
        ids[i, :len(r.logit_bias)] = list(r.logit_bias)
        values[i, :len(r.logit_bias)] = list(r.logit_bias.values())
    return ids, values, True


def _apply_bias(logits, s: SamplingArrays):
    """Adds each row's bias at its ids (OpenAI's logit_bias; padding entries add 0 to id 0)."""
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], s.bias_ids.shape)
    return logits.at[rows, jnp.maximum(s.bias_ids, 0)].add(
        jnp.where(s.bias_ids >= 0, s.bias_values, 0.0))


def _apply_penalties(logits, s: SamplingArrays):
    """vLLM semantics: repetition over prompt + output; presence/frequency over output only."""
    n, vocab = logits.shape
    valid = s.history >= 0
    is_output = valid & (jnp.arange(s.history.shape[1])[None, :] >= s.num_prompt[:, None])
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], s.history.shape)
    ids = jnp.where(valid, s.history, 0)
    seen = jnp.zeros((n, vocab), jnp.bool_).at[rows, ids].max(valid)
    counts = jnp.zeros((n, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    rep = s.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - s.frequency[:, None] * counts - s.presence[:, None] * (counts > 0)


def _apply_bitmask(logits, bitmask):
    """-inf where the row's grammar bans the token (the bits past V, and the vocabulary's padding
    ids the grammar's tokenizer does not know, are 0: banned)."""
    ids = jnp.arange(logits.shape[-1])
    words = bitmask[:, ids >> 5]                                                # [N, V] i32
    allowed = ((words >> (ids & 31)) & 1).astype(jnp.bool_)                     # [N, V]
    return jnp.where(allowed, logits, -jnp.inf)


def _filter_top_k_top_p(scaled, top_k, top_p):
    """Masks (-inf) what top-k and top-p exclude; needs one sort per row."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)                                   # [N, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)          # [N, 1]
    probs = ordered_softmax(sorted_desc)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < top_p[:, None]                                   # first always kept
    pth = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)


def _distribution(processed, s: SamplingArrays):
    """The logits plain sampling draws from: temperature, top-k / top-p, min-p (-inf where
    excluded). Their softmax is the row's distribution p."""
    scaled = processed / jnp.maximum(s.temperature, 1e-6)[:, None]
    needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
    scaled = jax.lax.cond(needs_sort, _filter_top_k_top_p, lambda x, k, p: x, scaled, s.top_k, s.top_p)
    # p / max(p) = exp(scaled - max(scaled)): no sum, so nothing that depends on the batch.
    keep = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)) >= s.min_p[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def _gumbel(s: SamplingArrays, vocab: int):
    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (vocab,), jnp.float32)
    return jax.vmap(gumbel)(s.seed, s.position)                                 # [N, V]


def _random_choice(processed, s: SamplingArrays, argmax):
    scaled = _distribution(processed, s)
    return argmax(scaled + _gumbel(s, scaled.shape[-1]))


def _random_choice_with_probs(processed, s: SamplingArrays, argmax):
    """A draft model's sampled proposals: the token, and the distribution q it was drawn from
    (Gumbel-max over `scaled` samples exactly softmax(scaled))."""
    scaled = _distribution(processed, s)
    tokens = argmax(scaled + _gumbel(s, scaled.shape[-1]))
    return tokens, ordered_softmax(scaled)


def _verified_choice(processed, s: SamplingArrays, draft_token, draft_probs, argmax):
    """Rows with a sampled proposal (draft_token >= 0) go through the rejection step against
    this row's p; the others sample as plain decoding does. u comes from the row's (seed,
    position) key folded with a salt, independent of the Gumbel noise (the residual's) and of
    the draft's own noise (the draft samples under another seed)."""
    scaled = _distribution(processed, s)
    gumbel = _gumbel(s, scaled.shape[-1])
    plain = argmax(scaled + gumbel)

    def uniform(seed, position):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), VERIFY_SALT)
        return jax.random.uniform(key, (), jnp.float32)
    u = jax.vmap(uniform)(s.seed, s.position)                                   # [N]
    verified = rejection_sample(ordered_softmax(scaled), draft_probs,
                                jnp.maximum(draft_token, 0), u, gumbel, argmax)
    return jnp.where(draft_token >= 0, verified, plain)


def sample(logits, s: SamplingArrays, *, argmax=two_level_argmax):
    """logits [N, V] f32 -> (tokens [N], logprob of token [N], top ids [N, K], top logprobs [N, K]),
    K = MAX_LOGPROBS; logprobs are computed only when some row asks (`logprobs` set: its
    token's; above 0: the top-k too), zeros otherwise.

    Log-probabilities are those of the model's raw distribution (as vLLM reports by default).
    `argmax`: the engine's (`worker/kernels.py`), every choice's first maximum."""
    return _sample(logits, s, functools.partial(_random_choice, argmax=argmax), argmax)


def sample_with_probs(logits, s: SamplingArrays, *, argmax=two_level_argmax):
    """`sample`, plus [N, V] f32: the distribution each row with temperature > 0 drew from
    (zeros when every row is greedy). Only a draft model sampling its proposals runs it."""
    def greedy(processed, s_):
        return jnp.zeros(processed.shape[0], jnp.int32), jnp.zeros_like(processed)
    return _sample(logits, s, functools.partial(_random_choice_with_probs, argmax=argmax),
                   argmax, greedy)


def sample_verified(logits, s: SamplingArrays, draft_token, draft_probs, *,
                   argmax=two_level_argmax):
    """`sample` for a decode call verifying sampled proposals: draft_token [N] i32 (-1: the row
    verifies none), draft_probs [N, V] f32, the draft's q for that token (jaxbatch/worker/rejection_sampler.py)."""
    return _sample(logits, s, lambda p, s_: _verified_choice(p, s_, draft_token, draft_probs,
                                                             argmax), argmax)


def _sample(logits, s: SamplingArrays, random_choice, argmax, all_greedy_choice=None):
    """`random_choice(processed, s)` -> tokens, or (tokens, extra) with `all_greedy_choice`
    giving the same structure when every row is greedy; extra is appended to the outputs.
    What only some requests ask for (a logit bias, penalties, a grammar, tokens held back by
    min_tokens, logprobs) is a runtime branch a step without such a row skips: the log-softmax over the
    vocabulary and the banned tokens' scatter are each a visible part of a CPU decode step.
    A call whose rows are all plain greedy takes the argmax of the logits as they are: each
    optional step's untaken branch would still copy the [N, V] logits through its cond."""
    plain_greedy = (jnp.all(s.temperature == 0.0) & ~s.any_penalties & ~s.any_bitmask
                    & ~s.any_bias & ~jnp.any(s.banned >= 0))

    def plain(x, s_):
        return (argmax(x),) + (() if all_greedy_choice is None else (jnp.zeros_like(x),))
    tokens, *extra = jax.lax.cond(
        plain_greedy, plain,
        lambda x, s_: _choose(x, s_, random_choice, all_greedy_choice, argmax), logits, s)
    logprobs = jax.lax.cond(s.any_token_logprob, _logprobs, _no_logprobs,
                            logits, tokens, s.any_logprobs)
    return (tokens,) + logprobs + tuple(extra)


def _choose(logits, s: SamplingArrays, random_choice, all_greedy_choice, argmax):
    """(tokens [N],) or (tokens, extra): `_sample`'s choice with every optional step."""
    # The bias first, on the model's logits (as vLLM orders it: before the penalties).
    processed = jax.lax.cond(s.any_bias, _apply_bias, lambda x, s_: x, logits, s)
    processed = jax.lax.cond(s.any_penalties, _apply_penalties, lambda x, s_: x, processed, s)
    processed = jax.lax.cond(s.any_bitmask, _apply_bitmask, lambda x, m: x, processed, s.bitmask)
    processed = jax.lax.cond(jnp.any(s.banned >= 0), _hold_back, lambda x, b: x,
                             processed, s.banned)
    greedy = argmax(processed)
    all_greedy = jnp.all(s.temperature == 0.0)
    extra = ()
    if all_greedy_choice is None:
        sampled = jax.lax.cond(all_greedy, lambda p, s_: greedy, random_choice, processed, s)
    else:
        sampled, probs = jax.lax.cond(all_greedy, all_greedy_choice, random_choice, processed, s)
        extra = (probs,)
    return (jnp.where(s.temperature == 0.0, greedy, sampled),) + extra


def _hold_back(processed, banned):
    """-inf at each row's banned ids [N, MAX_BANNED] (-1: none)."""
    rows = jnp.broadcast_to(jnp.arange(processed.shape[0])[:, None], banned.shape)
    return processed.at[rows, jnp.where(banned >= 0, banned, 0)].min(
        jnp.where(banned >= 0, -jnp.inf, jnp.inf))


def _logprobs(logits, tokens, any_top):
    """(logprob of each row's token [N], top ids [N, K], top logprobs [N, K]) of the model's
    raw distribution; the top-k only when some row asks (zeros otherwise)."""
    raw = ordered_log_softmax(logits)
    token_logprob = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return (token_logprob,) + jax.lax.cond(any_top, _top_logprobs, _no_top_logprobs, raw)


def _no_logprobs(logits, tokens, any_top):
    return (jnp.zeros(logits.shape[0], jnp.float32),) + _no_top_logprobs(logits)


def _top_logprobs(raw):
    values, ids = jax.lax.top_k(raw, MAX_LOGPROBS)
    return ids.astype(jnp.int32), values


def _no_top_logprobs(raw):
    n = raw.shape[0]
    return jnp.zeros((n, MAX_LOGPROBS), jnp.int32), jnp.zeros((n, MAX_LOGPROBS), jnp.float32)


def prompt_logprobs(logits, next_tokens):
    """logits [C, V] at chunk positions, next_tokens [C] -> (logprob of next token [C],
    top ids [C, K], top logprobs [C, K])."""
    raw = ordered_log_softmax(logits)
    target = jnp.take_along_axis(raw, jnp.maximum(next_tokens, 0)[:, None], axis=-1)[:, 0]
    top_ids, top_lp = _top_logprobs(raw)
    return target, top_ids, top_lp

