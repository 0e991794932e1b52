"""Prompt logprobs (what `echo` returns over HTTP) come from the prefill a request runs anyway:
the same numbers whatever its chunk size and whatever runs beside it."""
from __future__ import annotations

import numpy as np

from jaxbatch import SamplingParams
from engines import run_all, tiny_engine
from tiny_models import make_hf_model, random_token_prompts


def test_prompt_logprobs_are_the_same_chunked_or_not_alone_or_batched():
    model = make_hf_model("llama_untied_gqa2", seed=3)
    prompts = random_token_prompts(np.random.default_rng(1), [70, 9, 33])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    results = {}
    for chunk in (16, 128):            # 70 tokens: five chunks, or one
        engine = tiny_engine(model, max_num_seqs=4, prefill_chunk_size=chunk)
        batched = [o.prompt_logprobs for o in run_all(engine, prompts, [params] * 3)]
        alone = run_all(engine, prompts[:1], [params])[0].prompt_logprobs
        assert alone == batched[0]
        results[chunk] = batched
    assert results[16] == results[128]
    for lps, prompt in zip(results[16], prompts):
        assert lps[0] is None and all(lp is not None and prompt[p] in lp
                                      for p, lp in enumerate(lps) if p)
