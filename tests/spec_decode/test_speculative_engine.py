"""Speculative decoding through the engine: on a tiny random model, speculation on vs off gives
identical tokens (logprobs within the batch-composition noise) for greedy and seeded sampling
with every sampling option, stops and max_tokens inside accepted runs, alone and in a crowd,
with preemption and prefix caching; warmed up, nothing compiles. On the embedded model, a
repetitive prompt is mostly accepted."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from engines import result, run_all, tiny_engine
from tiny_models import make_hf_model, random_token_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "max_batch_size": 4}
SETTINGS = dict(max_num_seqs=6, block_size=4, prefill_chunk_size=16, max_num_batched_tokens=64,
                max_model_len=128, num_blocks=200)


@pytest.fixture(scope="module")
def engines():
    model = make_hf_model("llama_gqa4_bias", seed=5)
    on = tiny_engine(model, speculative_config=SPEC, **SETTINGS)
    off = LLMEngine(loaded=on.loaded, runner=on.runner, warmup=False, compilation_cache=False,
                    **SETTINGS)
    return on, off


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random motifs repeated: prompt lookup finds proposals, the tiny model accepts some."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 200, rng.integers(2, 6))) * int(rng.integers(3, 8))
            for _ in range(n)]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=2, max_tokens=30,
                   ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.2, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[7, 50, 120], min_tokens=3),
    SamplingParams(temperature=0, max_tokens=9),
]


def test_alone_tokens_equal_speculation_off(engines):
    on, off = engines
    prompts = repetitive_prompts(len(PARAMS), 0)
    before = on.stats()["spec_num_draft_tokens"]
    for prompt, sp in zip(prompts, PARAMS):
        assert result(run_all(on, [prompt], [sp])[0]) == result(run_all(off, [prompt], [sp])[0])
    stats = on.stats()
    assert stats["spec_num_draft_tokens"] > before
    assert stats["spec_num_accepted_tokens"] > 0


def test_in_a_crowd_with_preemption_and_prefix_caching(engines):
    """Twelve requests through 6 slots and 40 blocks: preemptions happen, repeated prompts hit
    the prefix cache, and small batches speculate; some steps run their verify rows inside a
    prefill call (unified_step's mixed calls)."""
    on, _ = engines
    shared = list(range(100, 116))                 # one chunk every prompt starts with
    prompts = [shared + p for p in repetitive_prompts(6, 1)] * 2
    params = PARAMS * 2
    small = dict(SETTINGS, num_blocks=40)
    spec = tiny_engine(make_hf_model("llama_gqa4_bias", seed=5), speculative_config=SPEC, **small)
    plain = LLMEngine(loaded=spec.loaded, runner=spec.runner, warmup=False,
                      compilation_cache=False, **small)
    want = [result(o) for o in run_all(plain, prompts, params)]
    mixed_verifies = []         # per mixed call: whether its decode part verifies drafts
    dispatch = spec.runner._dispatch
    def recording(call, *rest):
        if call.parts is not None:
            mixed_verifies.append(any(j > 0 for _, j in call.parts[0].decode_rows))
        return dispatch(call, *rest)
    spec.runner._dispatch = recording
    got = [result(o) for o in run_all(spec, prompts, params)]
    assert got == want
    assert any(mixed_verifies)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_warmed_up_speculation_compiles_nothing():
    model = make_hf_model("llama_untied_gqa2", seed=6)
    engine = tiny_engine(model, speculative_config=SPEC, warmup=True, max_num_seqs=4,
                         max_model_len=64, prefill_chunk_size=16, max_num_batched_tokens=32)
    prompts = repetitive_prompts(8, 2)
    run_all(engine, prompts, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 8)
    stats = engine.stats()
    assert stats["spec_num_drafts"] > 0
    assert stats["num_compilations_after_warmup"] == 0


def test_bad_speculative_config_fails_before_loading():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(model="/nonexistent", speculative_config={"num_speculative_tokens": 0})


def test_repetitive_prompt_is_mostly_accepted_on_the_embedded_model(embedded):
    from jaxbatch import LLM
    llm = LLM(loaded=embedded, max_num_seqs=4, max_model_len=512, warmup=False,
              compilation_cache=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    items = ", ".join(["apple", "banana", "cherry", "date", "elderberry", "fig", "grape",
                       "honeydew", "kiwi", "lemon", "mango", "nectarine", "orange", "papaya"])
    out = llm.chat([{"role": "user", "content": f"Repeat this list exactly, once: {items}"}],
                   SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    stats = llm.llm_engine.stats()
    acceptance = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert "apple" in out.outputs[0].text
    assert acceptance > 0.8, (acceptance, out.outputs[0].text)
    plain = LLM(loaded=embedded, max_num_seqs=4, max_model_len=512, warmup=False,
                compilation_cache=False)
    again = plain.chat([{"role": "user", "content": f"Repeat this list exactly, once: {items}"}],
                       SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_draft_model_proposals_are_lossless_and_a_twin_draft_is_always_right():
    """The target itself as its own draft: every greedy proposal is accepted. A different
    random model as the draft: few are, and the tokens still equal plain decoding's."""
    from jaxbatch.model.loader import LoadedModel
    from tiny_models import ours_from_hf
    target = make_hf_model("llama_untied_gqa2", seed=8)
    other = make_hf_model("llama_tied_mha", seed=9)
    as_loaded = lambda m: LoadedModel(*ours_from_hf(m), tokenizer=None, source="tiny",  # noqa: E731
                                      load_seconds=0.0, from_cache=False)
    prompts = random_token_prompts(np.random.default_rng(3), [5, 20, 37])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)]
    plain = tiny_engine(target, max_num_seqs=4, max_model_len=64)
    want = [result(o) for o in run_all(plain, prompts, params)]
    for draft, greedy_acceptance in ((target, 1.0), (other, None)):
        config = {"method": "draft_model", "model": as_loaded(draft), "num_speculative_tokens": 3}
        engine = LLMEngine(loaded=plain.loaded, runner=plain.runner, max_num_seqs=4,
                           max_model_len=64, warmup=False, compilation_cache=False,
                           speculative_config=config)
        assert [result(o) for o in run_all(engine, prompts[:1], params[:1])] == want[:1]
        stats = engine.stats()
        acceptance = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
        if greedy_acceptance is not None:
            assert acceptance == greedy_acceptance
        assert [result(o) for o in run_all(engine, prompts, params)] == want
    with pytest.raises(ValueError, match="vocabulary"):
        small_vocab = LoadedModel(*ours_from_hf(target), tokenizer=None, source="tiny",
                                  load_seconds=0.0, from_cache=False)
        small_vocab.config = dataclasses.replace(small_vocab.config, vocab_size=100)
        LLMEngine(loaded=plain.loaded, runner=plain.runner, max_num_seqs=4, max_model_len=64,
                  warmup=False, compilation_cache=False,
                  speculative_config={"method": "draft_model", "model": small_vocab})
