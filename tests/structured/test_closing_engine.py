"""Answers that close within max_tokens, on the embedded model: greedy and sampled json_object,
json_schema and tool-call answers parse (and validate) at every max_tokens where steering
starts near the answer's first tokens (the grammar's shortest answer up to past its guard and
CLOSE_MARGIN), then at a stride up to 256, all budgets in one batched generate call; one token
less than the shortest answer is a ValueError before any work."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxbatch import LLM, SamplingParams, StructuredOutputsParams
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.structured.closing import CLOSE_MARGIN

MAX_BUDGET = 256
# Past the dense budgets, one in STRIDE: a longer budget steers the same way at a later token
# (the seeds differ, so sampled answers are cut at varied points all the same).
STRIDE = 7
# Bounded strings and lists: answers stay short, so the sweep stays cheap.
CAT = {"type": "object",
       "properties": {"name": {"type": "string", "maxLength": 12},
                      "age": {"type": "integer", "minimum": 0, "maximum": 30},
                      "colors": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                 "minItems": 1, "maxItems": 3}},
       "required": ["name", "age", "colors"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM(loaded=embedded, max_num_seqs=64, max_model_len=MAX_BUDGET + 128)


def _prompt(llm, text, tools=None):
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tools=tools, tokenize=False,
        add_generation_prompt=True)


def budgets(shortest: int) -> list[int]:
    """Every budget whose steering starts within the first tokens: the shortest answer, one
    more, and each around the guard (`shortest` wide) and CLOSE_MARGIN before the close; then
    one in STRIDE, and the largest."""
    dense_to = 2 * shortest + CLOSE_MARGIN + 3
    return sorted(set(range(shortest, dense_to))
                  | set(range(dense_to, MAX_BUDGET, STRIDE)) | {MAX_BUDGET})


def _cases(llm):
    """(name, prompt, constraint, check(text) -> None, temperatures swept)."""
    named, named_so = S.tool_plan([WEATHER], {"type": "function",
                                              "function": {"name": "get_weather"}}, None, None)
    required, required_so = S.tool_plan([WEATHER], "required", None, None)
    arguments = WEATHER["function"]["parameters"]

    def calls(plan):
        def check(text):
            _, found = plan.calls_from_text(text)
            assert found and all(c["function"]["name"] == "get_weather" for c in found)
            for c in found:
                jsonschema.validate(json.loads(c["function"]["arguments"]), arguments)
        return check

    ask_weather = _prompt(llm, "What is the weather in Paris?", [WEATHER])
    return [
        ("json_object", _prompt(llm, "Describe a cat as a JSON object."),
         StructuredOutputsParams(json_object=True),
         lambda text: json.loads(text).keys(), (0.0, 1.0)),
        ("json_schema", _prompt(llm, "Describe a cat as JSON: name, age, colors."),
         StructuredOutputsParams(json=CAT),
         lambda text: jsonschema.validate(json.loads(text), CAT), (0.0, 1.0)),
        # a tool call: the required array (a comma may open a second call) greedy, a named
        # function's arguments sampled
        ("required tool", ask_weather, required_so, calls(required), (0.0,)),
        ("named tool", ask_weather, named_so, calls(named), (1.0,)),
    ]


def test_budgets_from_the_shortest_answer_to_256_close_greedy_and_sampled(llm):
    engine = llm.llm_engine
    prompts, params, checks = [], [], []
    for name, prompt, so, check, temperatures in _cases(llm):
        shortest = engine.structured.shortest_answer(SamplingParams(structured_outputs=so))
        assert 1 <= shortest <= 24, name
        for temperature in temperatures:
            for budget in budgets(shortest):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=temperature, seed=budget,
                                             max_tokens=budget, structured_outputs=so))
                checks.append((name, temperature, budget, check))
    outs = llm.generate(prompts, params, use_tqdm=False)
    steered = 0
    for (name, temperature, budget, check), out in zip(checks, outs):
        c = out.outputs[0]
        assert len(c.token_ids) <= budget
        try:
            check(c.text)
        except Exception as e:
            raise AssertionError(f"{name}, temperature {temperature}, max_tokens {budget}: "
                                 f"{c.text!r} ({c.finish_reason})") from e
        steered += c.finish_reason == "length"
    assert steered > 0          # some answers were closed at their very last token
    # batch-invariant: a steered answer alone is the same tokens as among the sweep's
    k = next(i for i, (name, t, b, _) in enumerate(checks)
             if name == "json_object" and t == 1.0 and outs[i].outputs[0].finish_reason == "length")
    alone = llm.generate([prompts[k]], params[k], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outs[k].outputs[0].token_ids
    stats = engine.stats()
    assert stats["structured_num_close_overshoots"] == 0
    assert stats["structured_num_rejected_tokens"] == 0
    assert stats["num_compilations_after_warmup"] == 0


def test_budget_below_the_shortest_answer_is_refused_before_any_work(llm):
    engine = llm.llm_engine
    so = StructuredOutputsParams(json=CAT)
    shortest = engine.structured.shortest_answer(SamplingParams(structured_outputs=so))
    steps = engine.stats()["num_steps"]
    with pytest.raises(ValueError, match=f"max_tokens={shortest - 1} is too small"):
        llm.generate(["A cat as JSON."], SamplingParams(max_tokens=shortest - 1,
                                                        structured_outputs=so), use_tqdm=False)
    assert engine.stats()["num_steps"] == steps and not engine.has_unfinished_requests()
