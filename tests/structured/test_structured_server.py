"""Structured outputs and tools over HTTP with the official `openai` client: one `jaxbatch serve`
subprocess for the module (auto tool choice on, hermes parser)."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from server_utils import MODEL, ServerProcess, metric

pytestmark = pytest.mark.slow
SETTINGS = ["--max-num-seqs", "4", "--max-model-len", "512", "--seed", "0",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
             "required": ["tz"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*SETTINGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def call(server, fn, timeout=300):
    async def go():
        async with AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                               timeout=timeout) as c:
            return await asyncio.wait_for(fn(c), timeout)
    return asyncio.run(go())


def post(server, body, path="/v1/chat/completions"):
    return httpx.post(server.base + path, json={"model": MODEL, **body}, timeout=300)


def test_parse_pydantic(server):
    out = call(server, lambda c: c.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_completion_tokens=48, temperature=1.0, seed=3))
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and out.choices[0].finish_reason == "stop"


def test_json_object_and_completions_json_schema(server):
    r = post(server, {"messages": [{"role": "user", "content": "A JSON object please."}],
                      "response_format": {"type": "json_object"}, "max_tokens": 64,
                      "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:                                       # an unbounded object: at least a JSON object's start
        assert choice["message"]["content"].startswith("{")
    r = post(server, {"prompt": "Person:", "max_tokens": 48, "temperature": 1.0, "seed": 1,
                      "structured_outputs": {"json": PERSON}}, "/v1/completions")
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


def test_streamed_json_schema_concatenates_to_valid_json(server):
    async def go(c):
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], stream=True,
            max_tokens=48, temperature=1.0, seed=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        parts, finish = [], None
        async for chunk in stream:
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return parts, finish
    parts, finish = call(server, go)
    assert finish == "stop" and len([p for p in parts if p]) > 1
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def _validate_calls(message, names):
    assert message.tool_calls, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for tc in message.tool_calls:
        assert tc.type == "function" and tc.id and tc.function.name in names
        jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])


def test_tool_choice_required_and_named(server):
    out = call(server, lambda c: c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
        temperature=0))
    assert out.choices[0].finish_reason == "tool_calls"
    _validate_calls(out.choices[0].message, {"get_weather", "get_time"})
    out = call(server, lambda c: c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48, temperature=1.0, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content is None
    _validate_calls(out.choices[0].message, {"get_weather"})


def test_named_tool_streams_argument_deltas(server):
    async def go(c):
        stream = await c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, stream=True, max_tokens=48, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        deltas, finish = [], None
        async for chunk in stream:
            for ch in chunk.choices:
                deltas += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        return deltas, finish
    deltas, finish = call(server, go)
    assert finish == "tool_calls" and len(deltas) > 1
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


def test_auto_tool_choice_answers(server):
    r = post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 24,
                      "temperature": 0})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message.get("content") or message.get("tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_bad_constraints_are_400_and_server_keeps_serving(server, body, param):
    r = post(server, {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    ok = post(server, {"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_structured_metrics(server):
    assert metric(server.base, "jaxbatch:structured_compile_seconds") > 0
    assert metric(server.base, "jaxbatch:structured_mask_seconds") > 0
    assert metric(server.base, "jaxbatch:structured_mask_fills") > 0


def test_answers_close_within_max_tokens(server):
    """A max_tokens below the shortest answer is a 400 naming max_tokens and saying how many
    tokens it takes; at exactly that many the answer (here a named tool's arguments, and a
    JSON object) still parses and validates."""
    import re
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = post(server, {"messages": ASK, "max_tokens": 2, "temperature": 1.0, "seed": 3, **named})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "too small" in error["message"]
    shortest = int(re.search(r"takes (\d+) tokens", error["message"]).group(1))
    r = post(server, {"messages": ASK, "max_tokens": shortest, "temperature": 1.0, "seed": 3,
                      **named})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]),
                        WEATHER_PARAMS)
    r = post(server, {"messages": [{"role": "user", "content": "List many numbers as JSON."}],
                      "max_tokens": 6, "temperature": 0, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
