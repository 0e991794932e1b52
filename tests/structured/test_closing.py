"""Answers that close within max_tokens, on the host (no model run): the closing path found
from a matcher's state completes the text to valid JSON; a budget below the grammar's shortest
answer is a ValueError naming max_tokens; and whatever tokens a sequence draws among those its
masks allow (here drawn at random, longer and stranger than a model's), it ends as valid JSON
at every budget from the shortest answer up."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from jaxbatch import SamplingParams, StructuredOutputsParams
from jaxbatch.core.plan import SamplingRow
from jaxbatch.core.request import Sequence
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.structured import StructuredOutputManager
from jaxbatch.structured.grammar import grammar_for

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
# tool_choice "required"'s shape for one function (an enum value next to its closing braces:
# there the masks refuse tokens the matcher would take, such as `"}`)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TOOL_CALLS = S.tool_plan([WEATHER], "required", None, None)[1].json


@pytest.fixture(scope="module")
def manager():
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    tokenizer = load_tokenizer(embedded_gguf_path())      # (the tokenizer alone: no weights)
    return StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                                   max_model_len=512)


def _matcher(manager, so, prefix: str):
    from llguidance import LLMatcher
    tokenizer = manager._ll_tokenizer()
    matcher = LLMatcher(tokenizer, grammar_for(so), log_level=0)
    assert matcher.consume_tokens(tokenizer.tokenize_str(prefix) if prefix else [])
    return matcher


@pytest.mark.parametrize("schema, prefixes", [
    (None, ['', '{', '{"a', '{"a":', '{"a":[1,2', '{"a":{"b":"x\\"y', '{"a":tr', '{"a":-',
            '{"a":1.5e', '{"a":"\\u00']),
    (PERSON, ['', '{"name":"Bo', '{"name":"Bob","age":1', '{"name":"Bob","age":12,"tags":["a']),
    (TOOL_CALLS, ['', '[{"name":"get_weather","parameters":{"city":"Par']),
])
def test_closing_path_completes_the_text(manager, schema, prefixes):
    so = (StructuredOutputsParams(json_object=True) if schema is None
          else StructuredOutputsParams(json=schema))
    manager._ll_tokenizer()
    closer = manager._closer
    for prefix in prefixes:
        matcher = _matcher(manager, so, prefix)
        path = closer.find(matcher)
        assert matcher.is_accepting() is (path.text == b"")     # the matcher is left as it was
        value = json.loads(prefix.encode() + path.text)
        if schema is not None:
            jsonschema.validate(value, schema)
        assert 1 <= path.tokens_needed <= len(path.text)
        # the tokens it allows next spell its start and leave enough to finish it
        for t in closer.next_tokens(path, path.tokens_needed):
            piece = closer.token_bytes[t]
            assert path.text.startswith(piece)
            assert 1 + path.after(piece).tokens_needed <= path.tokens_needed


def test_budget_below_the_shortest_answer_is_a_value_error(manager):
    so = StructuredOutputsParams(json=PERSON)
    shortest = manager.shortest_answer(SamplingParams(structured_outputs=so))
    # {"name":"","age":0,"tags":[""]}: more than one token, fewer than its bytes
    assert 1 < shortest < len('{"name":"","age":0,"tags":[""]}')
    manager.check(SamplingParams(max_tokens=shortest, structured_outputs=so), 10)
    with pytest.raises(ValueError, match=rf"max_tokens={shortest - 1} is too small .* "
                                         rf"takes {shortest} tokens"):
        manager.check(SamplingParams(max_tokens=shortest - 1, structured_outputs=so), 10)
    with pytest.raises(ValueError, match="max_tokens: a prompt of 500 tokens leaves 12"):
        manager.check(SamplingParams(max_tokens=None, structured_outputs=so), 500)
    assert manager.num_sequences == 0


def _row(seq) -> SamplingRow:
    return SamplingRow(seq.seq_id, 1.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, seq.num_tokens,
                       seq.num_prompt_tokens, [], [], None)


def _answer(manager, so, budget: int, pick, seq_id: int) -> tuple[bytes, int]:
    """Takes each token `pick(allowed ids)` chooses among those the sequence's mask allows,
    to the budget or EOS; -> (the answer's bytes, tokens)."""
    params = SamplingParams(max_tokens=budget, structured_outputs=so)
    seq = Sequence(seq_id, f"r{seq_id}", 0, [1, 2, 3], params, 0, 0.0, 0, 0)
    manager.add(seq)
    closer, eos = manager._closer, set(manager.eos_token_ids)
    try:
        while seq.num_output_tokens < budget:
            bits = manager.fill_bitmask([_row(seq)])[0].view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:manager.vocab_size])
            token = int(pick(allowed))
            if token in eos:
                break
            seq.output_token_ids.append(token)
            manager.advance(seq)
    finally:
        manager.remove(seq.seq_id)
    return b"".join(closer.token_bytes[t] for t in seq.output_token_ids), seq.num_output_tokens


@pytest.mark.parametrize("schema", [None, PERSON, TOOL_CALLS])
@pytest.mark.parametrize("chooser", ["random", "shortest", "longest"])
def test_any_tokens_close_at_every_budget(manager, schema, chooser):
    """Tokens drawn at random, or always the fewest bytes (one character at a time, so the
    close costs the most tokens), or always the most."""
    so = (StructuredOutputsParams(json_object=True) if schema is None
          else StructuredOutputsParams(json=schema))
    shortest = manager.shortest_answer(SamplingParams(structured_outputs=so))
    rng = np.random.default_rng(0)
    size = np.vectorize(lambda t: len(manager._closer.token_bytes[t]))
    pick = {"random": rng.choice,
            "shortest": lambda ids: ids[np.argmin(size(ids))],
            "longest": lambda ids: ids[np.argmax(size(ids))]}[chooser]
    before = manager.stats()
    for budget in range(shortest, shortest + 30):
        text, n = _answer(manager, so, budget, pick, 1000 + budget)
        value = json.loads(text)         # valid JSON (UTF-8) whatever was drawn
        if schema is not None:
            jsonschema.validate(value, schema)
        assert n <= budget
    after = manager.stats()
    assert after["structured_num_closing_rows"] > before["structured_num_closing_rows"]
    for counter in ("structured_num_close_overshoots", "structured_num_rejected_tokens"):
        assert after[counter] == before[counter], counter
