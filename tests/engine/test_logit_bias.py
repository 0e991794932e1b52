"""SamplingParams.logit_bias through a warmed-up engine: it steers exactly its request, the same
alone or in a batch, compiles nothing new, and an id outside the vocabulary is refused before
any state changes."""
from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from engines import run_all
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts


@pytest.fixture(scope="module")
def engine():
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=3))
    loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0,
                         from_cache=False)
    return LLMEngine(loaded=loaded, max_num_seqs=4, max_model_len=128, prefill_chunk_size=32,
                     warmup=True, compilation_cache=False)


PROMPTS = random_token_prompts(np.random.default_rng(5), [6, 40, 19])


def _tokens(engine, prompts, params):
    return [o.outputs[0].token_ids for o in run_all(engine, prompts, params)]


def test_bias_steers_its_request_only_and_is_batch_invariant(engine):
    compiled = engine.stats()["num_compilations"]
    greedy = lambda **kw: SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)  # noqa: E731
    plain = _tokens(engine, PROMPTS, [greedy()] * 3)

    forced = greedy(logit_bias={77: 100.0})
    banned = greedy(logit_bias={t: -100.0 for t in set(plain[2])})
    mixed = _tokens(engine, PROMPTS, [greedy(), forced, banned])
    assert mixed[0] == plain[0]                          # no bias: untouched by its neighbours
    assert mixed[1] == [77] * 6
    assert not set(mixed[2]) & set(plain[2])

    # Sampled with a seed: the same tokens alone as among the others.
    sampled = SamplingParams(temperature=1.0, seed=9, max_tokens=8, ignore_eos=True,
                             logit_bias={int(t): -5.0 for t in range(0, 256, 3)})
    alone = _tokens(engine, PROMPTS[1:2], [sampled])
    crowd = _tokens(engine, PROMPTS, [greedy(), sampled, forced])
    assert crowd[1] == alone[0]
    assert crowd[1] != _tokens(engine, PROMPTS[1:2], [SamplingParams(
        temperature=1.0, seed=9, max_tokens=8, ignore_eos=True)])[0]

    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0, engine.runner.compilations_after_warmup
    assert stats["num_compilations"] == compiled


def test_an_id_outside_the_vocabulary_is_refused_before_any_state_changes(engine):
    vocab = engine.model_config.vocab_size
    before = engine.stats()
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias.*outside the vocabulary"):
        engine.add_request("x", PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_free_blocks"] == before["num_free_blocks"]
    engine.add_request("x", PROMPTS[0], SamplingParams(logit_bias={vocab - 1: 1.0}, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
