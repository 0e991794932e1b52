"""The engine end to end on the embedded SmolLM2-135M-Instruct in float32: Hugging Face greedy
equality, batch invariance, static vs continuous, preemption, aborts, bad input."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine

MAX_MODEL_LEN = 1024


def mixed_prompts(tokenizer, long_prompt_ids):
    texts = ["What is the capital of France?", "Write a short poem about autumn leaves.",
             "Explain photosynthesis to a child.", "List three prime numbers.", "Hi",
             "Translate 'good morning' into Spanish and explain the grammar in detail please.",
             "Why is the sky blue? Give a precise physical explanation."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    return prompts[:3] + [list(long_prompt_ids)] + prompts[3:]


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM(loaded=embedded, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def prompts(embedded, long_prompt_ids):
    return mixed_prompts(embedded.tokenizer, long_prompt_ids)


def hf_greedy(model, ids, n):
    """Greedy tokens and the raw log-probability of each (EOS held back, like min_tokens)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.eos_token_id)
    tokens = out.sequences[0, len(ids):].tolist()
    logits = torch.stack(out.logits)[:, 0].float()
    return tokens, torch.log_softmax(logits, -1).numpy(), logits.numpy()


def assert_greedy_equal(ours, ref_tokens, ref_logits, what):
    """Identical, except after a position where the reference's top-2 logits nearly tie."""
    for i, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] < 1e-3 * max(1.0, abs(top2[1])), (
                f"{what}: token {i} differs ({a} vs {b}) without a near-tie")
            return
    assert len(ours) == len(ref_tokens), what


def test_greedy_matches_hugging_face(llm, hf_embedded, prompts):
    n = 32
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(prompts) >= 8 and llm.llm_engine.config.max_num_seqs < len(prompts)
    assert max(len(p) for p in prompts) >= 500
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs, ref_logits = hf_greedy(hf_embedded, prompt, n)
        ours = out.outputs[0].token_ids
        assert_greedy_equal(ours, ref_tokens, ref_logits, f"prompt of {len(prompt)} tokens")
        for i, (token, lp) in enumerate(zip(ours, out.outputs[0].logprobs)):
            if token != ref_tokens[i]:
                break
            assert abs(lp[token] - ref_logprobs[i, token]) < 2e-3
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_outputs_come_back_in_input_order_with_text(llm):
    outs = llm.generate(["Hi", "What is 2 + 2?"], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hi", "What is 2 + 2?"]
    for o in outs:
        assert o.finished and o.outputs[0].text == llm.get_tokenizer().decode(
            o.outputs[0].token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"   # the model ends its turn with EOS


BATCH_SEED = 7         # the crowd's prompts and lengths; every request's sampling seed is fixed


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=12),
], ids=["greedy", "seeded"])
def test_batch_invariance(llm, embedded, long_prompt_ids, params):
    """Three targets (a 12-token question, ~70 tokens, and 300 tokens: two prefill chunks of
    256 and decode contexts past 8 pages) each alone, then all three inside a crowd of twelve
    requests of random lengths (seed BATCH_SEED) that start, run and finish around them."""
    tok = embedded.tokenizer
    targets = [tok("Tell me about the history of the printing press.")["input_ids"],
               tok(" ".join(["Describe the water cycle, the seasons and the tides."] * 6))[
                   "input_ids"],
               list(long_prompt_ids[:300])]
    assert [len(t) > n for t, n in zip(targets, (8, 60, 299))] == [True] * 3
    alone = [llm.generate([t], params, use_tqdm=False)[0].outputs[0].token_ids for t in targets]
    rng = random.Random(BATCH_SEED)
    words = "alpha beta gamma delta river mountain city engine yellow quietly".split()
    crowd = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))) for _ in range(12)]
    crowd_params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i,
                                   max_tokens=rng.randint(2, 20)) for i in range(12)]
    prompts = crowd[:3] + [targets[0]] + crowd[3:7] + [targets[1]] + crowd[7:9] + [targets[2]] \
        + crowd[9:]
    all_params = crowd_params[:3] + [params] + crowd_params[3:7] + [params] + \
        crowd_params[7:9] + [params] + crowd_params[9:]
    outs = llm.generate(prompts, all_params, use_tqdm=False)
    mixed = [outs[i].outputs[0].token_ids for i in (3, 8, 11)]
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert a == m, f"target {i} ({len(targets[i])} tokens): alone {a} vs in a crowd {m}"


def test_static_and_continuous_agree_and_continuous_takes_fewer_steps(embedded, llm, prompts):
    lengths = [4, 40, 8, 24, 6, 36, 10, 30]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    static = LLM(loaded=embedded, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, batching="static")
    runs = {}
    for name, engine in (("static", static), ("continuous", llm)):
        before = engine.llm_engine.stats()["num_steps"]
        outs = engine.generate(prompts, params, use_tqdm=False)
        runs[name] = ([o.outputs[0].token_ids for o in outs],
                      engine.llm_engine.stats()["num_steps"] - before)
    assert runs["static"][0] == runs["continuous"][0]
    assert [len(t) for t in runs["continuous"][0]] == lengths
    assert runs["continuous"][1] < runs["static"][1]


def test_preemption_gives_identical_outputs(embedded, llm, prompts):
    short = [p for p in prompts if len(p) < 100][:6]
    params = SamplingParams(temperature=0, max_tokens=72, ignore_eos=True)
    # 4 running sequences of ~80-90 tokens need 24 blocks of 16; the pool has 16.
    small = LLM(loaded=embedded, max_num_seqs=4, max_model_len=256, num_blocks=17)
    got = small.generate(short, params, use_tqdm=False)
    want = llm.generate(short, params, use_tqdm=False)
    stats = small.llm_engine.stats()
    assert stats["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in got) == stats["num_preemptions"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    small.llm_engine.scheduler.blocks.check_invariants()


def test_abort_storm_leaks_nothing(llm):
    engine: LLMEngine = llm.llm_engine
    rng = random.Random(3)
    ids = [f"storm-{i}" for i in range(36)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [rng.randint(3, 40000) for _ in range(rng.randint(1, 80))],
                           SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randint(1, 24)))
    finished: dict[str, str] = {}
    aborted = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "finished twice"
                finished[out.request_id] = out.outputs[0].finish_reason
        live = [r for r in ids if r not in finished and r not in aborted]
        if live and rng.random() < 0.4:
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted.add(victim)
    for out in engine.step():   # aborts of the last step report here
        assert out.request_id not in finished
        finished[out.request_id] = out.outputs[0].finish_reason
    assert set(finished) == set(ids)
    assert {r for r, why in finished.items() if why == "abort"} == aborted
    assert engine.step() == []
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.scheduler.blocks.check_invariants()


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "empty"),
    ("", None, "empty"),
    ([1] * MAX_MODEL_LEN, None, "max_model_len"),
    ([5, 10**9], None, "vocabulary"),
    ([5, -1], None, "vocabulary"),
    ("hello", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ("hello", "not params", "SamplingParams"),
])
def test_bad_requests_are_refused_and_others_keep_running(llm, prompt, params, match):
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("good", "Count to five.", good)
    engine.step()
    before = engine.stats()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert engine.stats() == before and engine.get_num_unfinished_requests() == 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", good)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and len(outs[-1].outputs[0].token_ids) == 6


def test_invalid_sampling_params_raise(llm):
    for kwargs in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                   dict(n=0), dict(min_tokens=5, max_tokens=2)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            llm.generate("x", SamplingParams(**kwargs), use_tqdm=False)


def test_prompt_larger_than_pool_is_refused(embedded):
    engine = LLMEngine(loaded=embedded, max_num_seqs=2, max_model_len=64, num_blocks=5,
                       max_num_batched_tokens=34, prefill_chunk_size=32)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("r", [5] * 64, SamplingParams())
    assert engine.stats()["num_waiting"] == 0


def test_sampling_features(llm):
    tok = llm.get_tokenizer()
    prompt = "Once upon a time, in a land far away,"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    top1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=10),
                        use_tqdm=False)[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids

    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, n=3)
    a, b = (llm.generate(prompt, seeded, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in a.outputs}) > 1

    text = greedy.outputs[0].text
    stop = text[3:9]               # a stop string that spans a token boundary
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:3] and stop not in stopped.text

    stop_id = greedy.outputs[0].token_ids[2]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == greedy.outputs[0].token_ids[:3] and by_id.stop_reason == stop_id
    assert tok.decode(greedy.outputs[0].token_ids)


# ---- log-probabilities and penalties against Hugging Face + numpy ---------------------------

def hf_log_softmax(model, ids):
    """float64 log-probabilities [len(ids), V] of the next token after each prefix."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def assert_top_logprobs(got: dict, ref_row, k: int, token: int, what: str):
    """`got` = the reference's k most likely tokens plus `token`, each with the reference's
    log-probability (2e-3, as for sampled tokens); the k-th place may differ only at a
    near-tie with the (k+1)-th."""
    order = np.argsort(-ref_row)
    want = set(order[:k].tolist()) | {token}
    if ref_row[order[k - 1]] - ref_row[order[k]] >= 1e-3:
        assert set(got) == want, f"{what}: ids {sorted(got)} vs reference {sorted(want)}"
    else:
        assert set(got) <= set(order[:k + 1].tolist()) | {token}, what
    for t, lp in got.items():
        assert abs(lp - ref_row[t]) < 2e-3, f"{what}: token {t}: {lp} vs {ref_row[t]}"


def test_top_logprobs_match_hugging_face(llm, hf_embedded, prompts):
    """logprobs=3 on several prompts (a 500-token one included): at every generated position
    the reported top-3 and the sampled token's log-probability are those of Hugging Face's
    distribution given the same prefix (our own tokens fed back, so no greedy agreement is
    needed)."""
    chosen = [prompts[0], prompts[3], prompts[5]]
    outs = llm.generate(chosen, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                        use_tqdm=False)
    for prompt, out in zip(chosen, outs):
        ids = out.outputs[0].token_ids
        ref = hf_log_softmax(hf_embedded, list(prompt) + list(ids))
        for i, (token, got) in enumerate(zip(ids, out.outputs[0].logprobs)):
            assert_top_logprobs(got, ref[len(prompt) - 1 + i], 3, token,
                                f"prompt of {len(prompt)} tokens, output {i}")


def test_prompt_logprobs_match_hugging_face(llm, hf_embedded, embedded, long_prompt_ids):
    """prompt_logprobs=2 on a short prompt, a medium one and a 300-token one (two prefill
    chunks of 256: the position after the chunk boundary is scored from the first chunk)."""
    tok = embedded.tokenizer
    chosen = [tok("Once upon a time, in a land far away,")["input_ids"],
              tok(" ".join(["Name three rivers and the seas they reach."] * 5))["input_ids"],
              list(long_prompt_ids[:300])]
    outs = llm.generate(chosen, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                        use_tqdm=False)
    for prompt, out in zip(chosen, outs):
        ref = hf_log_softmax(hf_embedded, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert_top_logprobs(out.prompt_logprobs[p], ref[p - 1], 2, prompt[p],
                                f"prompt of {len(prompt)} tokens, position {p}")


def penalised_reference(logits, history, num_prompt, rep, freq, pres):
    """vLLM's penalties in numpy: repetition over prompt + output tokens (positive logits
    divided, negative multiplied), frequency x count and presence over output tokens only."""
    out = logits.astype(np.float64).copy()
    seen = np.unique(history)
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    counts = np.bincount(np.asarray(history[num_prompt:], np.int64), minlength=len(out))
    return out - freq * counts - pres * (counts > 0)


PENALTIES = [(1.8, 1.0, 1.0), (1.0, 0.7, 0.0), (1.3, 0.0, -0.5), (0.85, 0.0, 0.0),
             (1.0, -0.4, 0.6)]


def test_penalties_match_a_numpy_reference(llm, hf_embedded, embedded):
    """Greedy decoding under repetition / frequency / presence penalties, each setting on two
    prompts in one batch. At every step the token must be the argmax of Hugging Face's logits
    for our prefix with the penalties applied in numpy (a different token only at a near-tie
    of the penalised top-2, after which the request is not compared further)."""
    tok = embedded.tokenizer
    texts = ["the the the the the", "1, 2, 3, 1, 2, 3, 1, 2,"]
    prompts, params = [], []
    for rep, freq, pres in PENALTIES:
        for text in texts:
            prompts.append(tok(text)["input_ids"])
            params.append(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                         repetition_penalty=rep, frequency_penalty=freq,
                                         presence_penalty=pres))
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=10,
                                                     ignore_eos=True), use_tqdm=False)
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids
               for o, p in zip(outs, plain * len(PENALTIES))), "penalties changed nothing"
    for prompt, sp, out in zip(prompts, params, outs):
        ids = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf_embedded(torch.tensor([list(prompt) + ids])).logits[0].double().numpy()
        for i, token in enumerate(ids):
            history = np.asarray(list(prompt) + ids[:i])
            want = penalised_reference(logits[len(prompt) - 1 + i], history, len(prompt),
                                       sp.repetition_penalty, sp.frequency_penalty,
                                       sp.presence_penalty)
            best = int(np.argmax(want))
            if token != best:
                top2 = np.sort(want)[-2:]
                assert top2[1] - top2[0] < 1e-3 * max(1.0, abs(top2[1])), (
                    f"penalties {sp.repetition_penalty}/{sp.frequency_penalty}/"
                    f"{sp.presence_penalty}, prompt {prompt}: step {i} gave {token}, the "
                    f"reference {best} (penalised logits {want[token]:.4f} vs {want[best]:.4f})")
                break


def test_pallas_interpret_backend_gives_the_same_greedy_tokens(embedded, llm):
    prompts = ["The capital of France is", "Two plus two equals four because"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pallas = LLM(loaded=embedded, max_num_seqs=2, max_model_len=128,
                 attention_backend="pallas_interpret")
    got = pallas.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert pallas.llm_engine.stats()["attention_backend"] == "pallas_interpret"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_generate_is_all_or_nothing(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.step() == []
