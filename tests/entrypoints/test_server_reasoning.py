"""Reasoning over HTTP (issue 57, part 3), through the official `openai` client: one
`jaxbatch serve --reasoning-parser qwen3` subprocess on a tiny random Qwen3 that thinks
(thinking_model.py: its template opens the thought, the model writes </think> itself after
THOUGHT_TOKENS tokens). Each case streamed and not, the stream equal to the plain answer:
the thought in `reasoning`, a thought cut by max_tokens, thinking off, a JSON schema and a
required tool call applied after the thought; assistant reasoning given back as input; the
Responses API's reasoning items. (The same checkpoint offline: tests/reasoning.)"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from kernel_cache import cache_sharing_kernels
from server_utils import ServerProcess
from thinking_model import PROMPT, THOUGHT_TOKENS, write_thinking_model

pytestmark = pytest.mark.slow
NAME = "thinker"
FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0",
         "--no-warmup", "--served-model-name", NAME, "--reasoning-parser", "qwen3"]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object",
                                      "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                      "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_reasoning")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXBATCH_CACHE", cache_sharing_kernels(str(root / "cache")))
        yield write_thinking_model(str(root / "model"))


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = ServerProcess(checkpoint, *FLAGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def thought(client):
    """The greedy answer, not streamed: (reasoning, content); the model writes THOUGHT_TOKENS
    tokens of thought, then </think> (the offline engine's own split: test_reasoning_engine)."""
    r = client.chat.completions.create(model=NAME, messages=PROMPT, temperature=0, max_tokens=12)
    assert r.usage.completion_tokens == 12
    m = r.choices[0].message
    assert m.reasoning and m.content
    return m.reasoning, m.content


def chat(client, stream=False, **kw):
    """(reasoning, content, tool_calls, finish_reason), from one response or a stream's deltas;
    a stream also checks each delta carries one kind and the thought comes first."""
    kw = {"model": NAME, "messages": PROMPT, "temperature": 0, "max_tokens": 12, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        m = choice.message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
        return getattr(m, "reasoning", None), m.content, calls, choice.finish_reason
    reasoning, content, calls, finish, kinds = "", "", [], None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        d = choice.delta
        r = getattr(d, "reasoning", None)
        if r:
            reasoning += r
            kinds.append("reasoning")
        if d.content:
            content += d.content
            kinds.append("content")
        for c in d.tool_calls or ():
            calls.append((c.function.name, c.function.arguments))
            kinds.append("tool")
        finish = choice.finish_reason or finish
    assert kinds == sorted(kinds, key=["reasoning", "content", "tool"].index), kinds
    assert "</think>" not in reasoning + content and "<think>" not in reasoning
    return reasoning or None, content or None, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_the_thought_is_reasoning_the_rest_content(client, thought, stream):
    assert chat(client, stream) == (*thought, [], "length")
    assert len(thought[0]) > 0 and "</think>" not in thought[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_thought_cut_by_max_tokens(client, thought, stream):
    reasoning, content, calls, finish = chat(client, stream, max_tokens=THOUGHT_TOKENS - 1)
    assert finish == "length" and content is None and not calls
    assert reasoning and thought[0].startswith(reasoning)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off(client, stream):
    reasoning, content, _, _ = chat(client, stream,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning is None and content


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_after_the_thought(client, thought, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    reasoning, content, _, finish = chat(client, stream, max_tokens=40, response_format=fmt)
    assert reasoning == thought[0] and finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_follows_the_thought(client, thought, stream):
    reasoning, content, calls, finish = chat(client, stream, max_tokens=60, tools=TOOLS,
                                             tool_choice="required", parallel_tool_calls=False)
    assert reasoning == thought[0] and finish == "tool_calls" and not content
    [(name, arguments)] = calls
    assert name == "weather" and json.loads(arguments)["city"] in ("Paris", "Rome")


def test_assistant_reasoning_goes_back_to_the_template(server):
    """vLLM's input names: reasoning_content (and reasoning) on an assistant message reach
    the chat template; on another role they are a 400."""
    def tokens(message):
        r = httpx.post(server.base + "/tokenize", json={"messages": [
            PROMPT[0], message, {"role": "user", "content": "And now?"}]}, timeout=60)
        return r
    for field in ("reasoning_content", "reasoning"):
        r = tokens({"role": "assistant", "content": "yes", field: "clouds aside"})
        assert r.status_code == 200, r.text
        text = httpx.post(server.base + "/detokenize", json={"tokens": r.json()["tokens"]},
                          timeout=60).json()["prompt"]
        assert "<think>\nclouds aside\n</think>" in text
    r = tokens({"role": "user", "content": "x", "reasoning_content": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_responses_carry_a_reasoning_item(client, thought):
    r = client.responses.create(model=NAME, input=PROMPT[0]["content"], temperature=0,
                                max_output_tokens=12)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thought[0] and r.output_text == thought[1]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12
    assert r.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS + 1
    with client.responses.stream(model=NAME, input=PROMPT[0]["content"], temperature=0,
                                 max_output_tokens=40,
                                 text={"format": {"type": "json_schema", "name": "answer",
                                                  "schema": SCHEMA}}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    deltas = [k for k in kinds if k.endswith(".delta")]
    assert deltas[0] == "response.reasoning_text.delta"
    assert deltas[-1] == "response.output_text.delta"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert final.output[0].content[0].text == thought[0]
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_reasoning_items_given_back_as_input(client, server):
    """A reasoning item in `input` becomes the next assistant turn's reasoning_content."""
    items = [{"role": "user", "content": "Is the sky blue?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "clouds aside"}]},
             {"role": "assistant", "content": "yes"},
             {"role": "user", "content": "And now?"}]
    r = client.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=2)
    assert r.usage.input_tokens == len(httpx.post(server.base + "/tokenize", json={
        "messages": [items[0], {"role": "assistant", "content": "yes",
                                "reasoning_content": "clouds aside"}, items[3]]},
        timeout=60).json()["tokens"])
    bad = httpx.post(server.base + "/v1/responses", json={"model": NAME, "input": items[:2]},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_completions_keep_the_raw_text(client, server, thought):
    """/v1/completions returns the text as generated, its thought and tags included."""
    ids = httpx.post(server.base + "/tokenize", json={"messages": PROMPT},
                     timeout=60).json()["tokens"]
    r = client.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=12)
    text = r.choices[0].text
    assert text.startswith(thought[0] + "</think>") and text.endswith(thought[1])
