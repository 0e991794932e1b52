"""Speculative decoding with sampled drafts (speculative_config draft_sampling="sampled") through
the engine, on tiny random models: a twin draft is accepted nearly always at temperature 1; a
foreign draft is accepted sometimes, leaks nothing, compiles nothing after warm-up, keeps greedy
requests token-identical and the counters right; and the tokens at speculated positions follow
the target's exact distribution (chi-square against probabilities computed with Hugging Face)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.core.plan import PENDING_TOKEN
from jaxbatch.model.loader import LoadedModel
from jaxbatch.spec_decode.speculative import SpeculativeConfig
from engines import result, run_all, tiny_engine
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts


def as_loaded(model) -> LoadedModel:
    return LoadedModel(*ours_from_hf(model), tokenizer=None, source="tiny", load_seconds=0.0,
                       from_cache=False)


def sampled_config(draft, k=3, **extra):
    return {"method": "draft_model", "model": as_loaded(draft), "num_speculative_tokens": k,
            "draft_sampling": "sampled", **extra}


def check_counters(engine: LLMEngine) -> dict:
    """Wraps the scheduler's update to count, from each plan's proposals and the tokens each
    speculating sequence gained, what the spec_* counters must say; also checks that a step
    emits exactly the accepted proposals, then a token that differs from the next proposal
    (the rejection step never resamples a rejected proposal). Returns the running counts."""
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "with_q": 0}
    update = engine.scheduler.update

    def counting(plan, result_, seqs):
        # Tokens already read (the output ends with the PENDING_TOKEN this step will replace).
        read = lambda seq: len([t for t in seq.output_token_ids if t != PENDING_TOKEN])  # noqa: E731
        drafted = {d.seq_id: (d.draft_token_ids, read(seqs[d.seq_id]))
                   for d in plan.decodes if d.draft_token_ids}
        advanced = update(plan, result_, seqs)
        for seq_id, (drafts, before) in drafted.items():
            seq = seqs[seq_id]
            gained = seq.output_token_ids[before:]
            accepted = len(gained) - 1
            assert gained[:accepted] == drafts[:accepted]
            if accepted < len(drafts) and not seq.is_finished:
                assert gained[accepted] != drafts[accepted]
            counts["drafts"] += 1
            counts["draft_tokens"] += len(drafts)
            counts["accepted"] += accepted
        counts["with_q"] += sum(d.draft_probs is not None for d in plan.decodes)
        return advanced
    engine.scheduler.update = counting
    return counts


def assert_counters(engine, counts):
    s = engine.stats()
    assert (s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]) == (
        counts["drafts"], counts["draft_tokens"], counts["accepted"])
    assert sum(s["spec_accepted_per_position"]) == s["spec_num_accepted_tokens"]


def acceptance(engine) -> float:
    s = engine.stats()
    return s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]


@pytest.mark.parametrize("bad, why", [
    (dict(method="draft_model", model="x", draft_sampling="random"), "draft_sampling='random'"),
    (dict(method="ngram", draft_sampling="sampled"), "only a draft_model")])
def test_draft_sampling_is_validated(bad, why):
    with pytest.raises(ValueError, match=why):
        SpeculativeConfig.from_dict(bad)
    assert SpeculativeConfig.from_dict({"method": "ngram"}).draft_sampling == "greedy"


def test_a_twin_draft_is_accepted_nearly_always_at_temperature_one():
    """Draft == target: q equals p up to rounding (the two engines batch differently), so a
    proposal is rejected only with probability 1 - p/q, about 1e-6."""
    target = make_hf_model("llama_untied_gqa2", seed=8)
    engine = tiny_engine(target, max_num_seqs=4, max_model_len=64,
                         speculative_config=sampled_config(target))
    counts = check_counters(engine)
    prompts = random_token_prompts(np.random.default_rng(3), [5, 20, 37])
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(3)]
    run_all(engine, prompts, params)
    assert counts["draft_tokens"] >= 15 and counts["with_q"] > 0
    print("twin acceptance", acceptance(engine), engine.stats()["spec_num_draft_tokens"])
    assert acceptance(engine) >= 0.98, engine.stats()
    assert_counters(engine, counts)


def test_a_foreign_draft_runs_leaks_nothing_and_compiles_nothing_after_warm_up():
    """Another random model as the draft, warmed up: proposals of sampled requests are
    sometimes accepted; greedy requests keep greedy proposals and plain decoding's tokens."""
    target = make_hf_model("llama_untied_gqa2", seed=8)
    other = make_hf_model("llama_tied_mha", seed=9)
    settings = dict(max_num_seqs=4, max_model_len=64, prefill_chunk_size=16,
                    max_num_batched_tokens=32)
    engine = tiny_engine(target, warmup=True, speculative_config=sampled_config(other),
                         **settings)
    counts = check_counters(engine)
    prompts = random_token_prompts(np.random.default_rng(4), [5, 20, 37, 11])
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=2,
                             max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2, min_tokens=5,
                             stop_token_ids=[9], max_tokens=40),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    outs = run_all(engine, prompts, params)
    for out in outs:
        assert all(0 <= t < 256 for t in out.outputs[0].token_ids)
    print("foreign acceptance", acceptance(engine), engine.stats()["spec_num_draft_tokens"])
    assert 0 < acceptance(engine) < 1, engine.stats()
    assert counts["with_q"] > 0          # the rejection step ran
    assert_counters(engine, counts)
    draft = engine.scheduler.speculation.proposer.engine
    for e in (engine, draft):
        s = e.stats()
        assert s["num_compilations_after_warmup"] == 0, e.runner.compilations_after_warmup
        assert s["num_free_blocks"] == s["num_total_blocks"]
    assert draft.runner.kept_probs == {}
    plain = LLMEngine(loaded=engine.loaded, runner=engine.runner, warmup=False,
                      compilation_cache=False, **settings)
    assert result(run_all(plain, prompts[3:], params[3:])[0]) == result(outs[3])


# ---- the target distribution, through the engine ----------------------------------------------
VOCAB = 24        # at least MAX_LOGPROBS (20): the sampler's top-k needs it
TOP_K = 12        # the filtered p has holes where the draft's q (its own top 12) has mass
PROMPT = [3, 7, 9, 4, 11, 5]
NUM_REQUESTS = 2000
WAVE = 4          # requests in flight together: few enough that every decode step speculates


def peaked_model(seed: int):
    """A random Llama with a 24-token vocabulary; its LM head scaled up so next-token
    distributions are peaked like a trained model's (random init gives nearly uniform ones,
    which any sampler reproduces). Two seeds overlap by about 0.3 (sum of min(p, q))."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model.eval()


def exact_marginals(model, prompt, depth: int) -> list[np.ndarray]:
    """The distribution of output tokens 0 .. depth-1 (temperature 1, top-k TOP_K), by
    enumerating every continuation: [V] per position."""
    def next_probs(prefixes):                                    # [B, L] -> [B, V]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].double().numpy()
        kth = np.sort(logits, axis=-1)[:, -TOP_K][:, None]
        w = np.where(logits >= kth, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
        return w / w.sum(-1, keepdims=True)
    paths, weights, marginals = [list(prompt)], np.ones(1), []
    for _ in range(depth):
        joint = weights[:, None] * next_probs(paths)            # [paths, V]
        marginals.append(joint.sum(0))
        paths = [p + [t] for p in paths for t in range(VOCAB)]
        weights = joint.reshape(-1)
    return marginals


def chi_square(expected_probs, tokens):
    """Pearson's statistic, cells with expected count < 5 pooled (a token outside the
    support fails outright) -> (statistic, p-value, degrees of freedom)."""
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[expected_probs == 0].sum() == 0, counts
    expected = expected_probs * len(tokens)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    statistic, p_value = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    return statistic, p_value, len(obs) - 1


def test_speculated_tokens_follow_the_target_distribution():
    """2000 seeded requests of 4 tokens, in waves of 4: output 1 is always verified against a
    sampled proposal (acceptance about 0.17, so most are residual samples), output 2 often.
    The marginal of each of outputs 0-2 must match the exact one (p-value > 1e-3; fixed seeds
    make the statistics fixed numbers)."""
    target, draft = peaked_model(1), peaked_model(2)
    engine = tiny_engine(target, max_num_seqs=16, max_model_len=32, prefill_chunk_size=16,
                         max_num_batched_tokens=64,
                         speculative_config=sampled_config(draft, k=2, max_batch_size=WAVE))
    counts = check_counters(engine)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(NUM_REQUESTS)]
    tokens = []
    for start in range(0, NUM_REQUESTS, WAVE):
        outs = run_all(engine, [PROMPT] * WAVE, params[start:start + WAVE])
        tokens += [o.outputs[0].token_ids for o in outs]
    tokens = np.array(tokens)                                     # [requests, 4]
    assert counts["with_q"] >= NUM_REQUESTS                       # every request speculated
    assert_counters(engine, counts)
    for position, exact in enumerate(exact_marginals(target, PROMPT, 3)):
        statistic, p_value, dof = chi_square(exact, tokens[:, position])
        print(f"output {position}: chi2={statistic:.1f} dof={dof} p-value={p_value:.3f}")
        assert p_value > 1e-3, (position, statistic, dof)
    print("acceptance", acceptance(engine))
