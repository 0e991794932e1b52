"""Tool calls and request constraints without a model: the hermes and llama3_json parsers on
canned text, the constraint each tool_choice / response_format makes, and their 400s."""
from __future__ import annotations

import json

import jsonschema
import pytest

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                                      get_tool_parser)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def chat(**body):
    return P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)


def test_hermes_parser_canned_text():
    p = HermesToolParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("get_time", {"tz": "CET"})]
    assert p.extract("no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert p.extract(broken) == (broken, [])
    # streaming: a partial marker is held back, the content before it is not
    assert p.safe_content_len("Sure <tool") == len("Sure ")
    assert p.safe_content_len("Sure <tool_call>{") == len("Sure ")
    assert p.safe_content_len("a < b") == len("a < b")


def test_llama3_json_parser_canned_text():
    p = get_tool_parser("llama3_json")
    assert isinstance(p, Llama3JsonToolParser)
    content, calls = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                               '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert content is None
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "Oslo"}
    assert p.extract("The weather is fine.") == ("The weather is fine.", [])
    assert p.safe_content_len('{"name"') == 0 and p.safe_content_len("Hello") == 5
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")


def test_tool_choice_constraints():
    plan, so = S.tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                           None, None)
    assert plan.mode == "named" and so.json == TIME["function"]["parameters"]
    content, calls = plan.calls_from_text('{"tz":"UTC"}')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"

    plan, so = S.tool_plan([WEATHER, TIME], "required", None, None)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, so.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"tz": "x"}}], so.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], so.json)
    _, calls = plan.calls_from_text(json.dumps(good))
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    assert S.tool_plan([WEATHER], "required", False, None)[1].json["maxItems"] == 1
    assert S.tool_plan([WEATHER], "none", None, None) == (None, None)
    assert S.tool_plan([WEATHER], "auto", None, "hermes")[0].mode == "auto"


@pytest.mark.parametrize("body, param, message", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "not in tools"),
    (dict(tools=[WEATHER]), "tool_choice", "enable-auto-tool-choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function"}], tool_choice="required"), "tools", r"tools\[0\] must be"),
    (dict(response_format={"type": "yaml"}), "response_format", "response_format.type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
     "response_format", "schema"),
    (dict(structured_outputs={"json_schema": {}}), "structured_outputs", "unsupported keys"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "choice"),
    (dict(guided_json={"type": "object"}), "guided_json", "structured_outputs"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs", "only one of"),
])
def test_bad_requests_name_the_field(body, param, message):
    from jaxbatch import SamplingParams
    params = SamplingParams()
    with pytest.raises(S.BadRequest, match=message) as e:
        S.apply_constraint(chat(**body), params, None, chat=True)
    assert e.value.param == param
    assert params.structured_outputs is None          # nothing was set


def test_response_format_and_body_field():
    from jaxbatch import SamplingParams
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body, expect in [
            (dict(response_format={"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema, "strict": True}}),
             ("json", schema)),
            (dict(response_format={"type": "json_object"}), ("json_object", True)),
            (dict(structured_outputs={"regex": "[0-9]+"}), ("regex", "[0-9]+")),
            (dict(response_format={"type": "text"}), None)]:
        params = SamplingParams()
        _, field = S.apply_constraint(chat(**body), params, None, chat=True)
        if expect is None:
            assert params.structured_outputs is None and field is None
        else:
            assert getattr(params.structured_outputs, expect[0]) == expect[1]
            assert field == next(iter(body))


def test_tool_stream_deltas():
    plan, _ = S.tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                          None, None)
    ts = S.ToolStream(plan)
    first, _ = ts.delta('{"ci', False, None)
    call = first["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"ci'}
    second, _ = ts.delta('{"city":"X"}', True, "stop")
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"X"}'}}]}

    auto, _ = S.tool_plan([WEATHER], "auto", None, "hermes")
    ts = S.ToolStream(auto)
    assert ts.delta("Sure <tool", False, None) == ({"content": "Sure "}, None)
    fields, finish = ts.delta('Sure <tool_call>{"name": "get_weather", "arguments": {"city": "A"}}'
                              '</tool_call>', True, "stop")
    assert finish == "tool_calls" and fields["tool_calls"][0]["function"]["name"] == "get_weather"
    ts = S.ToolStream(auto)
    assert ts.delta("plain answer", True, "stop") == ({"content": "plain answer"}, "stop")



def test_required_calls_closed_at_length_are_read():
    """The engine closes a constrained answer within max_tokens, so a "required" answer that
    ends by length still holds its calls (finish_reason stays "length"); auto's free text
    cut by length is content."""
    required, _ = S.tool_plan([WEATHER], "required", None, None)
    text = '[{"name":"get_weather","parameters":{"city":""}}]'
    fields, finish = S.chat_message(text, "length", required)
    assert finish == "length" and fields["tool_calls"][0]["function"]["arguments"] == '{"city":""}'
    fields, finish = S.ToolStream(required).delta(text, True, "length")
    assert finish == "length" and fields["tool_calls"][0]["function"]["name"] == "get_weather"
    auto, _ = S.tool_plan([WEATHER], "auto", None, "hermes")
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
    assert S.chat_message(cut, "length", auto) == ({"content": cut}, "length")
