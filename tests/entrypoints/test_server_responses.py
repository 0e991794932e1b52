"""POST /v1/responses (issue 57, part 4) on the embedded model, through the official `openai`
client's `responses.create` and `responses.stream`: text (equal to the same conversation over
chat), message items and instructions, the streamed event sequence, a JSON schema, function
tools (required, named, and a call's output given back), and the 400s: anything stateful, any
unknown or unimplemented field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from server_utils import MODEL, ServerProcess

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You answer in one short sentence."
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "4", "--max-model-len", "512", "--seed", "0",
                        "--no-warmup")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_answer(client, messages, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return r.choices[0], r.usage


def test_text_equals_the_same_conversation_over_chat(client):
    choice, usage = chat_answer(client, [{"role": "system", "content": INSTRUCTIONS},
                                         {"role": "user", "content": QUESTION}], max_tokens=64)
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                temperature=0, max_output_tokens=64)
    assert r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == choice.message.content
    assert r.status == ("completed" if choice.finish_reason == "stop" else "incomplete")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens,
                                                             usage.completion_tokens)
    parts = [{"role": "system", "content": INSTRUCTIONS},     # the same, as message items
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": QUESTION}]}]
    again = client.responses.create(model=MODEL, input=parts, temperature=0,
                                    max_output_tokens=64)
    assert again.output_text == r.output_text


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_the_streamed_event_sequence(client):
    plain = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                    max_output_tokens=64)
    assert plain.status == "completed", "the greedy answer should end within 64 tokens"
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0,
                                 max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == plain.output_text == final.output_text
    assert len({e.item_id for e in deltas}) == 1 and final.output[0].id == deltas[0].item_id
    assert final.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema(client, stream):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                       "strict": True}}
    kw = dict(model=MODEL, input="Invent a person.", temperature=0, max_output_tokens=64,
              text=text)
    if stream:
        with client.responses.stream(**kw) as s:
            for _ in s:
                pass
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_function_call(client, choice, stream):
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice=choice, temperature=0, max_output_tokens=64, parallel_tool_calls=False)
    if stream:
        with client.responses.stream(**kw) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    else:
        r = client.responses.create(**kw)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_function_calls_output_given_back(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=64, parallel_tool_calls=False)
    call = first.output[0]
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r = client.responses.create(model=MODEL, input=turn, tools=[WEATHER], tool_choice="none",
                                temperature=0, max_output_tokens=16)
    choice, usage = chat_answer(client, [
        turn[0], {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
        max_tokens=16, tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], tool_choice="none")
    assert r.output_text == choice.message.content
    assert r.usage.input_tokens == usage.prompt_tokens


@pytest.mark.parametrize("field, value", [
    ("previous_response_id", "resp_123"), ("store", True), ("background", True),
    ("conversation", "conv_1"), ("reasoning", {"effort": "low"}), ("include", ["x"]),
    ("truncation", "auto"), ("prompt_cache_key", "k"), ("max_output_tokens", 0),
    ("tools", [{"type": "web_search"}]), ("text", {"format": {"type": "yaml"}}),
    ("tool_choice", {"type": "file_search"}),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("input", [{"type": "item_reference", "id": "msg_1"}])])
def test_stateful_unknown_and_unimplemented_fields_are_400s(server, field, value):
    body = {"model": MODEL, "input": QUESTION, field: value}
    r = httpx.post(server.base + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    if field in ("previous_response_id", "store", "background", "conversation"):
        assert "stateless" in r.json()["error"]["message"]


def test_the_client_sees_the_refusal_and_store_false_is_fine(client):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    r = client.responses.create(model=MODEL, input=QUESTION, store=False, max_output_tokens=2,
                                metadata={"k": "v"}, user="u")
    assert r.store is False and r.usage.output_tokens == 2
