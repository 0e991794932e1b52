"""Prefix caching through the engine on a tiny random model: with the cache on, every request
gets exactly the tokens, and the log-probabilities, it gets with the cache off — cold, warm, in
a crowd, after eviction, after preemption, with n > 1, with prompt logprobs and a forced hash
collision — and the hits it reports are the ones the chunk-boundary rule allows.

Log-probabilities are compared to 1e-5: a hit changes which sequences share later decode steps,
and the decode matmul's row count moves the last bits (~5e-7 here) exactly as any other traffic
does without the cache (`test_batch_composition_noise_is_the_same_without_the_cache`).

Block size 4, prefill chunk 16: prompt lengths below cover shorter than a block (3), a block (4),
a chunk (16), a chunk plus one (17), and several chunks plus a partial block (50)."""
from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.core import prefix_cache
from jaxbatch.engine.llm_engine import LLMEngine
from engines import LOGPROB_TOL, Close, result, run_all, tiny_engine  # noqa: F401
from tiny_models import make_hf_model, random_token_prompts

CHUNK = 16
SETTINGS = dict(max_num_seqs=4, block_size=4, prefill_chunk_size=CHUNK, max_num_batched_tokens=64,
                max_model_len=128)


@pytest.fixture(scope="module")
def model():
    return make_hf_model("llama_untied_gqa2", seed=21)


@pytest.fixture(scope="module")
def engines(model):
    """(cache on, cache off) on one runner: the same compiled steps and pool."""
    on = tiny_engine(model, enable_prefix_caching=True, num_blocks=200, **SETTINGS)
    off = LLMEngine(loaded=on.loaded, runner=on.runner, enable_prefix_caching=False,
                    num_blocks=200, warmup=False, compilation_cache=False, **SETTINGS)
    return on, off


rng = np.random.default_rng(4)
BASE = random_token_prompts(rng, [60])[0]
OTHER = random_token_prompts(rng, [60])[0]
LENGTHS = [3, 4, 16, 17, 50]
PROMPTS = [BASE[:n] for n in LENGTHS] + [BASE[:40] + OTHER[:7], OTHER[:33]]


def sampling(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i, max_tokens=10,
                              logprobs=2, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)


def expected_hit(n: int) -> int:
    return (n - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def reference(engines):
    _, off = engines
    return [result(o) for o in run_all(off, PROMPTS, [sampling(i) for i in range(len(PROMPTS))])]


def test_cold_warm_and_crowded_runs_match_the_cache_off_run(engines, reference):
    on, _ = engines
    on.reset_prefix_cache()
    params = [sampling(i) for i in range(len(PROMPTS))]
    cold = run_all(on, PROMPTS, params)
    assert [result(o) for o in cold] == reference
    warm = run_all(on, PROMPTS, params)
    assert [result(o) for o in warm] == reference
    hits = [o.num_cached_tokens for o in warm]
    assert hits == [expected_hit(len(p)) for p in PROMPTS]
    assert hits[LENGTHS.index(50)] == 48 and hits[LENGTHS.index(17)] == 16
    # In a crowd: the same requests between strangers, warm again.
    crowd = random_token_prompts(np.random.default_rng(8), [5, 40, 21, 64, 9, 30])
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(PROMPTS):
        mixed_prompts += [crowd[i % len(crowd)], p]
        mixed_params += [SamplingParams(temperature=0.7, seed=i, max_tokens=6), params[i]]
    mixed = run_all(on, mixed_prompts, mixed_params)
    assert [result(o) for o in mixed[1::2]] == reference


def test_batch_composition_noise_is_the_same_without_the_cache(engines, reference):
    """The tolerance's reason: the cache-off engine alone vs in a batch."""
    _, off = engines
    for i, prompt in enumerate(PROMPTS):
        assert result(run_all(off, [prompt], [sampling(i)])[0]) == reference[i]


def test_after_eviction_pressure_outputs_still_match(model, reference):
    """A pool of 60 blocks: strangers evict most cached prefixes before the warm run."""
    on = tiny_engine(model, enable_prefix_caching=True, num_blocks=60, **SETTINGS)
    params = [sampling(i) for i in range(len(PROMPTS))]
    assert [result(o) for o in run_all(on, PROMPTS, params)] == reference
    strangers = random_token_prompts(np.random.default_rng(12), [50, 60, 45, 55, 64, 40])
    run_all(on, strangers, [SamplingParams(temperature=0, max_tokens=8)] * len(strangers))
    on.scheduler.blocks.check_invariants()
    again = run_all(on, PROMPTS, params)
    assert [result(o) for o in again] == reference
    stats = on.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_with_preemption_outputs_match_and_victims_reuse_their_prefix(model, reference):
    """33 usable blocks of 4 for 4 sequences of up to 50 + 40 tokens: sequences are preempted,
    and re-admitted ones start from their own cached chunks."""
    on = tiny_engine(model, enable_prefix_caching=True, num_blocks=34, **SETTINGS)
    long_params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)]
    prompts = [BASE[:50], OTHER[:50], BASE[:49], OTHER[:45]]
    params = long_params * 2
    off = LLMEngine(loaded=on.loaded, runner=on.runner, enable_prefix_caching=False,
                    num_blocks=34, warmup=False, compilation_cache=False, **SETTINGS)
    want = [result(o) for o in run_all(off, prompts, params)]
    got = run_all(on, prompts, params)
    assert [result(o) for o in got] == want
    assert on.stats()["num_preemptions"] > 0
    assert on.stats()["prefix_cache_hits"] > 0


def test_n_samples_share_the_prompt_and_match(engines):
    on, off = engines
    on.reset_prefix_cache()
    sp = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=8, logprobs=1)
    want = result(run_all(off, [BASE[:50]], [sp])[0])
    out = run_all(on, [BASE[:50]], [sp])[0]
    assert result(out) == want
    hits = on.stats()["prefix_cache_hits"]
    assert out.num_cached_tokens == 0       # nothing came from an earlier request
    assert hits >= 2 * 48                   # the later samples started from the first one's prompt


def test_prompt_logprobs_are_computed_not_served(engines):
    on, off = engines
    on.reset_prefix_cache()
    run_all(on, [BASE[:50]], [SamplingParams(max_tokens=1)])          # fills the cache
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    want = run_all(off, [BASE[:50]], [sp])[0]
    got = run_all(on, [BASE[:50]], [sp])[0]
    assert got.prompt_logprobs == want.prompt_logprobs and result(got) == result(want)
    assert got.num_cached_tokens == 0


def test_salts_reset_and_counters(engines):
    on, _ = engines
    on.reset_prefix_cache()
    before = on.stats()
    salted = lambda salt: SamplingParams(max_tokens=1, cache_salt=salt)
    run_all(on, [BASE[:40]], [salted("a")])
    outs = run_all(on, [BASE[:40]] * 3, [salted("b"), salted(None), salted("a")])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32]
    stats = on.stats()
    assert stats["prefix_cache_queries"] - before["prefix_cache_queries"] == 4 * 40
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert stats["enable_prefix_caching"] is True
    on.reset_prefix_cache()
    assert run_all(on, [BASE[:40]], [salted("a")])[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_a_forced_hash_collision_serves_no_wrong_kv(engines, reference, monkeypatch):
    on, _ = engines
    on.reset_prefix_cache()
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: b"\x07" * 32)
    for s in on._seqs.values():
        s.block_keys.clear()
    params = [sampling(i) for i in range(len(PROMPTS))]
    for _ in range(2):
        assert [result(o) for o in run_all(on, PROMPTS, params)] == reference
    on.reset_prefix_cache()


def test_engines_sharing_a_runner_never_hit_each_others_overwritten_blocks(engines, reference):
    """The off engine writes into blocks the on engine has parked; the on engine must forget
    its cache when it steps again."""
    on, off = engines
    params = [sampling(i) for i in range(len(PROMPTS))]
    on.reset_prefix_cache()
    cold = [o.num_cached_tokens for o in run_all(on, PROMPTS, params)]   # hits within the run
    run_all(off, random_token_prompts(np.random.default_rng(2), [60] * 6),
            [SamplingParams(max_tokens=30, ignore_eos=True)] * 6)
    outs = run_all(on, PROMPTS, params)
    assert [result(o) for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == cold


def test_block_granularity_shares_prefixes_shorter_than_a_chunk(engines, reference):
    """prefix_cache_granularity="block" (vLLM's): hits on any block boundary, every full block
    a prefill computed is cached (also those of the last, partial chunk), so a 17-token prompt
    finds 16 cached tokens even from a 16-token one; tokens equal the cache-off run's."""
    on, _ = engines
    block = LLMEngine(loaded=on.loaded, runner=on.runner, enable_prefix_caching=True,
                      prefix_cache_granularity="block", num_blocks=200, warmup=False,
                      compilation_cache=False, **SETTINGS)
    params = [sampling(i) for i in range(len(PROMPTS))]
    cold = run_all(block, PROMPTS, params)
    warm = run_all(block, PROMPTS, params)
    assert [result(o) for o in cold] == reference
    assert [result(o) for o in warm] == reference
    bs = SETTINGS["block_size"]
    assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // bs * bs for p in PROMPTS]
    # Blocks of a partial last chunk count: after a 30-token prompt (one full chunk of 16, then
    # 14 tokens), a longer prompt sharing them finds 28 (the chunk rule: 16).
    for engine, expected in ((block, 28), (on, 16)):
        engine.reset_prefix_cache()
        run_all(engine, [BASE[:30]], [sampling(0)])
        assert run_all(engine, [BASE[:40] + OTHER[:7]], [sampling(0)])[0].num_cached_tokens == expected
    assert block.stats()["num_free_blocks"] == block.stats()["num_total_blocks"]
    with pytest.raises(ValueError, match="prefix_cache_granularity"):
        LLMEngine(loaded=on.loaded, runner=on.runner, prefix_cache_granularity="page",
                  num_blocks=200, warmup=False, **SETTINGS)
