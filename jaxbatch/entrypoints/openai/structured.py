"""The server's structured outputs and tools: from a request body's `response_format`,
`structured_outputs`, `tools` and `tool_choice` to the engine's StructuredOutputsParams, and
from a finished (or streaming) output back to OpenAI's `tool_calls`.

  response_format {"type": "text"}                     no constraint
                  {"type": "json_object"}              any JSON object
                  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   (vLLM's)
  tool_choice "none"      tools only shown to the template
              "auto"      free text, calls parsed out of it (--tool-call-parser)
              "required"  output constrained to [{"name", "parameters"}, ...] (vLLM's shape)
              {"type": "function", "function": {"name"}}   output constrained to its arguments

At most one constraint per request; anything malformed, unknown or contradictory is a 400
naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import uuid

from jaxbatch.sampling_params import StructuredOutputsParams

# vLLM's deprecated guided_* fields: refused, naming what replaces them, never ignored.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_decoding_backend": None,
                 "guided_whitespace_pattern": None}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class ToolPlan:
    mode: str                        # "auto" | "required" | "named"
    tools: list[dict]                # OpenAI function tools
    name: str | None = None          # the named function
    parser: object = None            # auto: a tool_parsers parser

    def calls_from_text(self, text: str) -> tuple[str | None, list[dict]] | None:
        """(content, tool_calls) or None if the text holds no call (then it is content)."""
        if self.mode == "named":
            calls = [(self.name, text)]
            content = None
        elif self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return None
            calls = [(it["name"], json.dumps(it["parameters"], ensure_ascii=False,
                                               separators=(",", ":"))) for it in items]
            content = None
        else:
            content, calls = self.parser.extract(text)
            if not calls:
                return None
        return content, [tool_call(name, args) for name, args in calls]


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _function(tool, k: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict) \
            or not isinstance(tool["function"].get("name"), str):
        raise BadRequest(f"tools[{k}] must be a function tool: "
                         "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                         "tools")
    params = tool["function"].get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"tools[{k}].function.parameters must be a JSON schema object", "tools")
    return tool["function"]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_plan(tools, tool_choice, parallel_tool_calls, auto_parser_name: str | None
              ) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    """What `tools` + `tool_choice` ask for: the plan for reading calls back, and the output's
    constraint (named and required); (None, None) without tools or with "none"."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None, None
        raise BadRequest("tool_choice needs tools", "tool_choice")
    if not tools:
        return None, None
    functions = [_function(t, k) for k, t in enumerate(tools)]
    if tool_choice is None:
        tool_choice = "auto"          # OpenAI's default when tools are given
    if tool_choice == "none":
        return None, None
    if tool_choice == "auto":
        if auto_parser_name is None:
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                             '--tool-call-parser to be set (or send tool_choice "none", '
                             '"required" or a named function)', "tool_choice")
        from jaxbatch.entrypoints.openai.tool_parsers import get_tool_parser
        return ToolPlan("auto", tools, parser=get_tool_parser(auto_parser_name)), None
    if tool_choice == "required":
        item = {"anyOf": [{"type": "object",
                           "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                          "parameters": _parameters(f)},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for f in functions]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools), StructuredOutputsParams(json=schema)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        match = [f for f in functions if f["name"] == name]
        if not match:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not in tools",
                             "tool_choice")
        return ToolPlan("named", tools, name=name), StructuredOutputsParams(json=_parameters(match[0]))
    raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, not {tool_choice!r}",
                     "tool_choice")


def response_format_constraint(response_format) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema must be an object with a 'schema' "
                             "object", "response_format")
        # `strict` is honoured either way: the output always follows the schema.
        return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"})
    raise BadRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                     f"not {kind!r}", "response_format")


def structured_outputs_body(body) -> StructuredOutputsParams | None:
    if body is None:
        return None
    if not isinstance(body, dict):
        raise BadRequest("structured_outputs must be an object", "structured_outputs")
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"structured_outputs: unsupported keys {extra}; supported: "
                         f"{sorted(known)}", "structured_outputs")
    try:
        return StructuredOutputsParams(**body)
    except ValueError as e:
        raise BadRequest(str(e), "structured_outputs") from None


def request_constraint(req, tool_constraint: StructuredOutputsParams | None = None
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the one constraint of the request, the field it came from)."""
    for field, replacement in GUIDED_FIELDS.items():
        if getattr(req, field, None) is not None:
            hint = (f'use "structured_outputs": {{"{replacement}": ...}} or response_format'
                    if replacement else 'use "structured_outputs" (llguidance is the only backend)')
            raise BadRequest(f"{field} is not supported: {hint}", field)
    found = [(c, f) for c, f in (
        (response_format_constraint(req.response_format), "response_format"),
        (structured_outputs_body(req.structured_outputs), "structured_outputs"),
        (tool_constraint, "tool_choice")) if c is not None]
    if len(found) > 1:
        raise BadRequest(f"only one of {', '.join(f for _, f in found)} may constrain the "
                         "output", found[1][1])
    return found[0] if found else (None, None)


def apply_constraint(req, params, tool_parser: str | None, chat: bool
                     ) -> tuple[ToolPlan | None, str | None]:
    """Sets `params.structured_outputs` from the request (BadRequest if malformed); returns
    how to read tool calls back (chat with tools) or None, and the field that constrained the
    output (to name it when the engine refuses the grammar)."""
    plan = tool_constraint = None
    if chat:
        plan, tool_constraint = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                                          tool_parser)
    constraint, field = request_constraint(req, tool_constraint)
    if constraint is not None:
        params.structured_outputs = constraint
    return plan, field


def _may_hold_calls(plan: ToolPlan, finish_reason: str | None) -> bool:
    """A finished output is read for calls when it stopped, or when the grammar made it (named
    and required): the engine closes a constrained answer within max_tokens, so a "length"
    finish parses too."""
    return finish_reason == "stop" or plan.mode == "named" \
        or (plan.mode == "required" and finish_reason == "length")


def chat_message(text: str, finish_reason: str | None, plan: ToolPlan | None
                 ) -> tuple[dict, str | None]:
    """(ChatMessageOut fields, finish_reason) of a finished choice."""
    if plan is None:
        return {"content": text}, finish_reason
    parsed = plan.calls_from_text(text) if _may_hold_calls(plan, finish_reason) else None
    if parsed is None:
        return {"content": text}, finish_reason
    content, calls = parsed
    return {"content": content, "tool_calls": calls}, (
        "tool_calls" if finish_reason == "stop" else finish_reason)


class ToolStream:
    """One streamed choice's deltas when tools are in play, as OpenAI streams them: a call's
    first delta carries index, id, type and name, later ones argument text. A named function's
    arguments stream as they are generated; "required" and "auto" calls are known only once
    the output ends (auto streams the content before them)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.sent, self.call_id = plan, 0, None

    def delta(self, text: str, finished: bool, finish_reason: str | None
              ) -> tuple[dict | None, str | None]:
        """(DeltaMessage fields or None for nothing to send yet, finish_reason to report)."""
        plan = self.plan
        if plan.mode == "named":
            new, self.sent = text[self.sent:], len(text)
            if self.call_id is None:
                self.call_id = tool_call(plan.name, "")["id"]
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": plan.name, "arguments": new}}
            elif new:
                call = {"index": 0, "function": {"arguments": new}}
            else:
                return None, ("tool_calls" if finish_reason == "stop" else finish_reason)
            return {"tool_calls": [call]}, (
                "tool_calls" if finish_reason == "stop" else finish_reason)
        if not finished:
            if plan.mode == "required":
                return None, None
            safe = plan.parser.safe_content_len(text)
            if safe <= self.sent:
                return None, None
            new, self.sent = text[self.sent:safe], safe
            return {"content": new}, None
        parsed = plan.calls_from_text(text) if _may_hold_calls(plan, finish_reason) else None
        if parsed is None:
            new, self.sent = text[self.sent:], len(text)
            return {"content": new or None}, finish_reason
        calls = [{"index": k, **call} for k, call in enumerate(parsed[1])]
        return {"tool_calls": calls}, ("tool_calls" if finish_reason == "stop" else finish_reason)
