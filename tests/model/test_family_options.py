"""Engine options on the new families: int8 KV pages and int8 weights (experts included) on a
windowed MoE model, n-gram speculation and prefix-cache hits on Gemma 3 (windows, q/k norms,
two RoPE bases), each against Hugging Face or the plain run."""
from __future__ import annotations

import numpy as np
import torch

from jaxbatch import LLM, SamplingParams
from jaxbatch.model.linear import Int8

SETTINGS = dict(dtype="float32", max_num_seqs=3, max_model_len=128, prefill_chunk_size=16,
                warmup=False, compilation_cache=False)


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1).numpy()


def test_int8_kv_and_int8_weights_on_windowed_experts(checkpoint):
    folder, model = checkpoint("mixtral")
    llm = LLM(model=folder, kv_cache_dtype="int8", quantization="int8", **SETTINGS)
    assert isinstance(llm.llm_engine.runner.params["layers"]["we_gate"], Int8)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (9, 33)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = _hf_logprobs(model, prompt)
        ours = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        err = np.abs(np.array(ours) - ref[np.arange(len(prompt) - 1), prompt[1:]]).max()
        # int8 rounding, not a wrong window or expert: those move logprobs by ~1 (see
        # test_families' deliberate breaks).
        assert err < 0.05, err


def test_ngram_speculation_and_prefix_hits_keep_the_tokens(checkpoint):
    folder, _ = checkpoint("gemma3")
    # 100 distinct tokens: with 1-token lookups (prompt_lookup_min=1) most generated tokens
    # are found earlier, so drafts get proposed even though a random model never repeats.
    base = np.random.default_rng(2).permutation(np.arange(3, 512))[:100].tolist()
    prompts = [base, base + [7, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=folder, enable_prefix_caching=False, **SETTINGS)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1}, **SETTINGS)
    # One at a time, so the second prompt's first chunks are prefix-cache hits.
    got = [spec.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == want
    stats = spec.llm_engine.stats()
    assert stats["spec_num_draft_tokens"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and got[1].num_cached_tokens > 0
