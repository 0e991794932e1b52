"""Every registered family against Hugging Face on a tiny random checkpoint loaded by
`LLM(model=dir)`: mixed-length prompts under continuous batching (4 prompts, 3 slots, prefill
in chunks of 16 across windows of 8), every prompt logprob and every generated token's logprob
equal to HF's teacher-forced forward pass on the same tokens within 2e-3, each greedy token
HF's argmax (Gemma against its eager attention)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from families import FAMILIES
from jaxbatch import LLM, SamplingParams

LENGTHS = (5, 19, 40, 27)
NEW_TOKENS = 6
TOLERANCE = 2e-3


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()                                 # [T, V]


def check_against_hf(llm, model, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1, prompt_logprobs=1,
                            ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
        assert len(gen) == NEW_TOKENS
        ref = _hf_logprobs(model, prompt + gen)
        ours = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
        theirs = ref[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, err_msg="prompt logprobs")
        rows = len(prompt) - 1 + np.arange(len(gen))
        ours = [out.outputs[0].logprobs[j][t] for j, t in enumerate(gen)]
        np.testing.assert_allclose(ours, ref[rows, gen], atol=TOLERANCE, err_msg="token logprobs")
        assert gen == ref[rows].argmax(-1).tolist(), "greedy tokens are not HF's argmax"
    return outs


def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_hugging_face(checkpoint, name):
    folder, model = checkpoint(name)
    llm = LLM(model=folder, dtype="float32", max_num_seqs=3, max_model_len=128,
              prefill_chunk_size=16, warmup=False, compilation_cache=False)
    assert llm.llm_engine.model_config.architecture == type(model).__name__
    check_against_hf(llm, model, _prompts(seed=len(name)))


def test_text_prompts_use_the_tokenizer_saved_beside_and_warmup_covers_every_shape(checkpoint):
    """Gemma 2 (windows, soft caps, sandwich norms) warmed up: text prompts through the
    checkpoint's tokenizer, and nothing compiles after warm-up."""
    folder, model = checkpoint("gemma2")
    llm = LLM(model=folder, dtype="float32", max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=18, compilation_cache=False)
    text = [" ".join(f"w{i}" for i in range(3 + k, 40 + 3 * k, 2)) for k in range(3)]
    outs = check_against_hf(llm, model, text)
    assert outs[0].prompt_token_ids == llm.get_tokenizer()(text[0])["input_ids"]
    assert llm.llm_engine.stats()["num_compilations_after_warmup"] == 0
