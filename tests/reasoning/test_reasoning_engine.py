"""Reasoning offline (`LLM(..., reasoning_parser="qwen3")`), end to end on a tiny random Qwen3
that thinks (thinking_model.py: its chat template opens the thought, and the model itself writes
</think> after THOUGHT_TOKENS tokens). The thought leaves `text` for `reasoning`; a thought cut
by max_tokens stays reasoning; thinking off leaves no reasoning; a JSON schema constrains only
the answer (the thought is the free one, token for token) and the answer validates (with
speculation too)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxbatch import LLM, SamplingParams, StructuredOutputsParams

from kernel_cache import cache_sharing_kernels
from thinking_model import PROMPT, THOUGHT_TOKENS, write_thinking_model

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
KW = dict(warmup=False, dtype="float32", max_model_len=256, max_num_seqs=4, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXBATCH_CACHE", cache_sharing_kernels(str(root / "cache")))
        yield write_thinking_model(str(root / "model"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, reasoning_parser="qwen3", **KW)


def chat(llm, params, **kw):
    return llm.chat(PROMPT, params, use_tqdm=False, **kw)[0].outputs[0]


def test_the_thought_leaves_the_text(llm):
    out = chat(llm, SamplingParams(temperature=0, max_tokens=16))
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    assert out.token_ids.index(end) == THOUGHT_TOKENS      # the model closed its thought
    tok = llm.get_tokenizer()
    assert out.reasoning == tok.decode(out.token_ids[:THOUGHT_TOKENS])
    assert out.text == tok.decode(out.token_ids[THOUGHT_TOKENS + 1:]).lstrip()
    assert "<think>" not in out.reasoning and "</think>" not in out.reasoning
    raw = chat(llm, SamplingParams(temperature=0, max_tokens=16, split_reasoning=False))
    assert raw.reasoning is None and raw.text == tok.decode(out.token_ids)


def test_a_thought_cut_by_max_tokens_stays_reasoning(llm):
    full = chat(llm, SamplingParams(temperature=0, max_tokens=16))
    out = chat(llm, SamplingParams(temperature=0, max_tokens=THOUGHT_TOKENS - 1))
    assert out.finish_reason == "length" and out.text == ""
    assert out.reasoning and full.reasoning.startswith(out.reasoning)


def test_thinking_off_leaves_no_reasoning(llm):
    out = chat(llm, SamplingParams(temperature=0, max_tokens=8),
               chat_template_kwargs={"enable_thinking": False})
    assert out.reasoning is None and out.text
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids)


def test_without_a_parser_the_thought_stays_in_the_text(checkpoint, llm):
    plain = LLM(checkpoint, runner=llm.llm_engine.runner, loaded=llm.llm_engine.loaded, **KW)
    out = chat(plain, SamplingParams(temperature=0, max_tokens=16))
    assert out.reasoning is None and "</think>" in out.text


def json_params(**kw):
    return SamplingParams(**{"max_tokens": 48, **kw},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_a_schema_constrains_only_the_answer(llm):
    free = chat(llm, SamplingParams(temperature=0, max_tokens=16))
    out = chat(llm, json_params(temperature=0))
    assert out.finish_reason == "stop"
    assert out.token_ids[:THOUGHT_TOKENS + 1] == free.token_ids[:THOUGHT_TOKENS + 1]
    assert out.reasoning == free.reasoning
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.llm_engine.stats()["structured_num_rejected_tokens"] == 0


def test_sampled_thoughts_are_free(llm):
    """Sampling (a random model rarely samples </think> among ~49k tokens): the thought is
    not held to the schema: it starts with tokens JSON cannot, and nothing is refused."""
    tok = llm.get_tokenizer()
    outs = [chat(llm, json_params(temperature=1.0, seed=s, max_tokens=12)) for s in range(4)]
    for out in outs:
        assert out.reasoning is not None
        if "</think>" not in tok.decode(out.token_ids):
            assert out.text == ""
    assert any(not tok.decode(out.token_ids[:1]).lstrip().startswith("{") for out in outs)
    assert llm.llm_engine.stats()["structured_num_rejected_tokens"] == 0


def test_thinking_off_constrains_from_the_first_token(llm):
    out = chat(llm, json_params(temperature=0), chat_template_kwargs={"enable_thinking": False})
    assert out.reasoning is None
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_speculation_gives_the_same_thought_and_answer(checkpoint, llm):
    spec = LLM(checkpoint, reasoning_parser="qwen3", loaded=llm.llm_engine.loaded,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 2}, **KW)
    for params in (SamplingParams(temperature=0, max_tokens=24), json_params(temperature=0)):
        want, got = chat(llm, params), chat(spec, params)
        assert (got.reasoning, got.text, got.token_ids) == (want.reasoning, want.text,
                                                            want.token_ids)
    stats = spec.llm_engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["structured_num_rejected_tokens"] == 0


def test_a_model_without_thought_tags_is_refused(embedded):
    with pytest.raises(ValueError, match="no token <think> or </think>"):
        LLM(loaded=embedded, reasoning_parser="qwen3", **KW)
