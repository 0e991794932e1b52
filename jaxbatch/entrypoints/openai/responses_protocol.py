"""/v1/responses' request body, and its translation into the chat request the server already
runs (same template, tools, grammar, sampling and admission; responses.py shapes the answer).

Stateless: the server keeps no response, so a request must carry its whole conversation in
`input`; anything that would need stored state (`previous_response_id`, `store: true`,
`background: true`, `conversation`) is a 400 naming it. Every other field is honoured or a 400.

  input          a string (one user message) or items: messages {"role", "content": str |
                 [{"type": "input_text" | "output_text", "text"}]}, "function_call" and
                 "function_call_output" items, "reasoning" items (an earlier thought, handed to
                 the template with the assistant turn that follows it)
  instructions   a system message before the input
  text.format    {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}
  tools          function tools {"type": "function", "name", "description", "parameters"}
  tool_choice    "none" | "auto" | "required" | {"type": "function", "name"}
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.errors import APIError
from jaxbatch.entrypoints.openai.protocol_base import _Request, check_fields

STATEFUL = {
    "previous_response_id": "previous_response_id needs a stored response: this server is "
                            "stateless, send the whole conversation in input",
    "store": "store: true needs stored responses: this server is stateless (send store: false "
             "or leave it out)",
    "background": "background: true needs stored responses: this server is stateless",
    "conversation": "conversation needs stored state: this server is stateless, send the "
                    "whole conversation in input"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None          # "disabled" (OpenAI's default) only
    include: list[str] | None = None       # nothing extra to include
    # Stateful: refused unless off (STATEFUL).
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)

    def unsupported(self) -> tuple[str, str] | None:
        for name, why in STATEFUL.items():
            value = getattr(self, name)
            if value is not None and value is not False:
                return name, why
        bad = check_fields(self)
        if bad:
            return bad
        if self.truncation not in (None, "disabled"):
            return "truncation", "only truncation 'disabled' is supported (a prompt too long " \
                                 "for the context is a 400)"
        if self.include:
            return "include", f"include {self.include} is not supported"
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            return "max_output_tokens", "max_output_tokens must be an integer >= 1"
        return None


def _content(item: dict, k: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{k}].content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS \
                or not isinstance(part.get("text"), str) \
                or set(part) - {"type", "text", "annotations", "logprobs"}:
            raise APIError(400, f"input[{k}]: only text content parts ({', '.join(TEXT_PARTS)}) "
                                "are supported", "input")
        texts.append(part["text"])
    return "".join(texts)


def _thought(item: dict, k: int) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if item.get("encrypted_content") is not None or not isinstance(parts, list) \
            or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"input[{k}]: a reasoning item needs its text in content "
                            "(reasoning_text parts) or summary; encrypted_content is not "
                            "supported", "input")
    return "\n".join(p["text"] for p in parts)


def _check_keys(item: dict, k: int, allowed: set[str]) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise APIError(400, f"input[{k}]: unsupported keys {extra}", "input")


def messages_of(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages; a 400 for any item that is not honoured."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    thought = None
    for k, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            _check_keys(item, k, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{k}].role must be user, system, developer or "
                                    f"assistant, not {role!r}", "input")
            msg = {"role": role, "content": _content(item, k)}
        elif kind == "function_call":
            _check_keys(item, k, {"type", "call_id", "name", "arguments", "id", "status"})
            if not all(isinstance(item.get(f), str) for f in ("call_id", "name", "arguments")):
                raise APIError(400, f"input[{k}]: a function_call needs call_id, name and "
                                    "arguments (strings)", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last \
                    and thought is None:
                last["tool_calls"].append(call)     # parallel calls: one assistant turn
                continue
            msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            _check_keys(item, k, {"type", "call_id", "output", "id", "status"})
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise APIError(400, f"input[{k}]: a function_call_output needs call_id and "
                                    "output (strings)", "input")
            msg = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
        elif kind == "reasoning":
            _check_keys(item, k, {"type", "id", "summary", "content", "encrypted_content",
                                  "status"})
            thought = _thought(item, k)
            continue
        else:
            raise APIError(400, f"input[{k}]: item type {kind!r} is not supported (message, "
                                "function_call, function_call_output, reasoning)", "input")
        if thought is not None:
            if msg["role"] != "assistant":
                raise APIError(400, f"input[{k}]: a reasoning item must come before the "
                                    "assistant message or function call it led to", "input")
            msg["reasoning_content"], thought = thought, None
        messages.append(msg)
    if thought is not None:
        raise APIError(400, "input: a reasoning item must come before the assistant message or "
                            "function call it led to", "input")
    if not messages:
        raise APIError(400, "input is empty", "input")
    return messages


def _response_format(text: dict | None) -> dict | None:
    if text is None:
        return None
    extra = sorted(set(text) - {"format"})
    if extra:
        raise APIError(400, f"text: unsupported keys {extra}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'",
                       "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if extra or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format json_schema needs a 'schema' object"
                            + (f"; unsupported keys {extra}" if extra else ""), "text")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.get("name", "response"), "schema": fmt["schema"],
        "strict": fmt.get("strict")}}


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("name"), str) \
                or set(tool) - {"type", "name", "description", "parameters", "strict"}:
            raise APIError(400, f"tools[{k}]: only function tools {{'type': 'function', 'name', "
                                "'description', 'parameters', 'strict'}} are supported", "tools")
        out.append({"type": "function", "function": {
            k2: tool[k2] for k2 in ("name", "description", "parameters") if k2 in tool}})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': "
                        "'function', 'name': ...}", "tool_choice")


def chat_request(req: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat request that runs this one (its checks then apply as for chat)."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], bad[0])
    body = {"messages": messages_of(req), "stream": req.stream, "priority": req.priority,
            "max_completion_tokens": req.max_output_tokens,
            "response_format": _response_format(req.text), "tools": _tools(req.tools),
            "tool_choice": _tool_choice(req.tool_choice)}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "top_k", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                 "cache_salt"):
        body[name] = getattr(req, name)
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return P.ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise APIError(400, f"input: {e}", "input") from None
