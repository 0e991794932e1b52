"""LoRA serving on a tiny random Llama with tiny random PEFT adapters: teacher-forced logprobs
equal Hugging Face with the adapter merged; a continuous batch mixing the base model and
adapters of different ranks and targets gives every request its tokens alone; more adapters
than slots all finish with no compilation after warm-up and no leaked blocks; KV is never
shared across adapters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adapters import teacher_forced_logprobs, write_adapter
from jaxbatch import LoRARequest, SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts

ADAPTERS = {   # name: (rank, targets, use_rslora)
    "a": (8, ["q_proj", "v_proj", "down_proj"], False),
    "b": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"], True),
    "c": (2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_hf_model("llama_untied_gqa2", seed=1)
    merged, requests = {}, {}
    for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items(), 1):
        merged[name] = write_adapter(model, str(root / name), r, targets, seed=10 + i,
                                     use_rslora=rs)
        requests[name] = LoRARequest(name, i, str(root / name))
    cfg, params = ours_from_hf(model)
    loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0,
                         from_cache=False)
    engine = LLMEngine(loaded=loaded, max_model_len=128, max_num_seqs=4, compilation_cache=False,
                       prefill_chunk_size=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    return model, merged, requests, engine, loaded


def run(engine, jobs):
    """jobs: [(prompt, params, lora_request)] -> outputs in order."""
    base = engine.num_steps
    for i, (prompt, params, lr) in enumerate(jobs):
        engine.add_request(f"{base}-{i}", prompt, params, lora_request=lr)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{base}-{i}"] for i in range(len(jobs))]


def test_teacher_forced_logprobs_equal_hugging_face_merged(setup):
    model, merged, requests, engine, _ = setup
    prompt = random_token_prompts(np.random.default_rng(0), [37])[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    jobs = [(prompt, params, None)] + [(prompt, params, requests[n]) for n in ADAPTERS]
    refs = [model] + [merged[n] for n in ADAPTERS]
    for out, ref in zip(run(engine, jobs), refs):
        got = [pl[t] for pl, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        np.testing.assert_allclose(got, teacher_forced_logprobs(ref, prompt), atol=2e-3)
    # Decoding (one row per sequence, the decode call's slots) too: greedy equals merged HF.
    n = 10
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = run(engine, [(prompt, greedy, None)] + [(prompt, greedy, requests[k]) for k in ADAPTERS])
    for out, ref in zip(outs, refs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
    # The adapters matter: each differs from the base model by far more than the tolerance.
    base = teacher_forced_logprobs(model, prompt)
    for n in ADAPTERS:
        assert np.max(np.abs(np.subtract(teacher_forced_logprobs(merged[n], prompt), base))) > 0.05


def test_mixed_batch_tokens_equal_each_run_alone_with_more_adapters_than_slots(setup):
    _, _, requests, engine, _ = setup
    rng = np.random.default_rng(3)
    prompts = random_token_prompts(rng, [5, 30, 12, 44, 3, 21, 9, 17, 26])
    which = [None, "a", "b", None, "a", "c", "b", "c", "a"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (9, 5, 14, 6, 11, 8, 7, 12, 4)]
    jobs = [(p, sp, requests[w] if w else None) for p, sp, w in zip(prompts, params, which)]
    loads_before = engine.stats()["lora_num_loads"]
    recorder = KeyRecorder()
    engine.runner.executable_observers.append(recorder)
    try:
        together = run(engine, jobs)
    finally:
        engine.runner.executable_observers.remove(recorder)
    # Prompts admitted beside decoding rows: adapter rows in one unified call (unified_step).
    assert "mixed_lora" in recorder.keys
    alone = [run(engine, [job])[0] for job in jobs]
    for t, a in zip(together, alone):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
    stats = engine.stats()
    # Three adapters, two slots: some were evicted and loaded again, all finished.
    assert stats["lora_num_resident"] <= 2 and stats["lora_num_evictions"] > 0
    assert stats["lora_num_loads"] - loads_before >= 3
    assert stats["num_compilations_after_warmup"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["lora_running"] == {}


def test_adapters_never_share_cached_kv(setup):
    _, _, requests, engine, _ = setup
    prompt = random_token_prompts(np.random.default_rng(7), [40])[0]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first_base, = run(engine, [(prompt, sp, None)])
    under_a, = run(engine, [(prompt, sp, requests["a"])])
    again_a, = run(engine, [(prompt, sp, requests["a"])])
    assert first_base.num_cached_tokens == 0 or first_base.num_cached_tokens is None
    assert not under_a.num_cached_tokens            # the base model's KV is not the adapter's
    assert again_a.num_cached_tokens > 0            # its own is
    assert again_a.outputs[0].token_ids == under_a.outputs[0].token_ids


def test_bad_lora_requests_are_value_errors_that_change_nothing(setup, tmp_path):
    _, _, requests, engine, loaded = setup
    before = engine.stats()
    bad = [LoRARequest("nope", 9, str(tmp_path / "missing")),
           LoRARequest("a", 7, requests["a"].lora_path),             # name taken by another id
           LoRARequest("other", 1, requests["b"].lora_path),         # id 1 names adapter a
           LoRARequest("z", 0, requests["a"].lora_path)]
    for lr in bad:
        with pytest.raises(ValueError):
            engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=2), lora_request=lr)
    assert not engine.has_unfinished_requests()
    after = engine.stats()
    assert {k: after[k] for k in ("lora_requests", "lora_num_loads", "num_free_blocks")} == \
        {k: before[k] for k in ("lora_requests", "lora_num_loads", "num_free_blocks")}
    plain = LLMEngine(loaded=loaded, max_model_len=64, max_num_seqs=2, warmup=False,
                      compilation_cache=False)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_request("x", [5, 6], SamplingParams(max_tokens=1),
                          lora_request=requests["a"])
    with pytest.raises(ValueError, match="speculative_config"):
        LLMEngine(loaded=loaded, enable_lora=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})


class KeyRecorder:
    def __init__(self):
        self.keys = []

    def on_executable(self, key, seconds):
        self.keys.append(key[0])


def test_calls_without_adapter_rows_run_the_plain_executables(setup):
    _, _, requests, engine, _ = setup
    recorder = KeyRecorder()
    engine.runner.executable_observers.append(recorder)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        run(engine, [([9, 8, 7, 6], sp, None)])
        assert recorder.keys and not any(k.endswith("_lora") for k in recorder.keys)
        recorder.keys.clear()
        run(engine, [([9, 8, 7, 6], sp, requests["b"])])
        assert {"prefill_lora", "decode_lora"} <= set(recorder.keys)
        assert not {"prefill", "decode"} & set(recorder.keys)
    finally:
        engine.runner.executable_observers.remove(recorder)
    assert engine.stats()["num_compilations_after_warmup"] == 0


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(setup):
    from jaxbatch import LLM
    _, _, requests, engine, _ = setup
    llm = LLM.from_engine(engine)
    prompts = random_token_prompts(np.random.default_rng(11), [6, 13])
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    mixed = llm.generate(prompts, sp, use_tqdm=False, lora_request=[None, requests["b"]])
    expected = [run(engine, [(prompts[0], sp, None)])[0], run(engine, [(prompts[1], sp, requests["b"])])[0]]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in expected]
    both = llm.generate(prompts, sp, use_tqdm=False, lora_request=requests["b"])
    assert both[1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(prompts, sp, use_tqdm=False, lora_request=[requests["b"]])


def test_preempted_adapter_sequences_resume_with_their_adapter(setup):
    """A pool too small for the batch, one adapter slot: sequences are preempted and swapped
    and still produce their tokens alone; nothing leaks."""
    _, _, requests, _, loaded = setup
    engine = LLMEngine(loaded=loaded, max_model_len=96, max_num_seqs=4, num_blocks=14,
                       block_size=8, warmup=False, compilation_cache=False,
                       prefill_chunk_size=16, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = random_token_prompts(np.random.default_rng(5), [30, 25, 34, 28])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    which = ["a", "a", None, "b"]
    jobs = [(p, sp, requests[w] if w else None) for p, w in zip(prompts, which)]
    together = run(engine, jobs)
    assert engine.stats()["num_preemptions"] > 0
    alone = [run(engine, [job])[0] for job in jobs]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["lora_running"] == {}
    assert engine.lora.seq_slot == {} and not engine.lora.live


def test_plain_keys_of_a_lora_engine_lower_to_the_engine_without_lora(setup):
    """Calls without adapter rows run exactly today's computation (the same lowered HLO)."""
    _, _, _, _, loaded = setup
    texts = []
    for kw in ({}, {"enable_lora": True}):
        runner = LLMEngine(loaded=loaded, max_model_len=64, max_num_seqs=2, warmup=False,
                           compilation_cache=False, **kw).runner
        keys = [k for k in runner.bucket_shapes() if k[0] in ("decode", "prefill")][:3]
        texts.append([runner.executables.lower(k, runner.example_args(k)).as_text() for k in keys])
    assert texts[0] == texts[1]
