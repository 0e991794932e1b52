"""Tool calls parsed out of free text (`tool_choice="auto"`, `--tool-call-parser NAME`), as
vLLM's parsers of the same names read them:

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number; the text
               before the first one is the message's content
  llama3_json  {"name": ..., "parameters": {...}} (optionally after <|python_tag|>), several
               separated by ";"; the whole output is calls or it is plain content

`extract(text)` -> (content or None, [(name, arguments as a JSON string)]); no calls -> (text, []).
`safe_content_len(text)`: while streaming, how much of the text so far is surely content (the
rest may be the start of a call, held back until the output ends).
"""
from __future__ import annotations

import json
import re

ToolCall = tuple[str, str]


def _arguments(value) -> str | None:
    if isinstance(value, str):      # some models emit the arguments already as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return text, []     # a malformed call: hand the text back untouched
            args = _arguments(obj.get("arguments", {})) if isinstance(obj, dict) else None
            if args is None or not isinstance(obj.get("name"), str):
                return text, []
            calls.append((obj["name"], args))
        content = text[:text.index(self.START)].strip()
        return content or None, calls

    def safe_content_len(self, text: str) -> int:
        i = text.find(self.START)
        if i >= 0:
            return i
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = _arguments(obj.get("parameters", obj.get("arguments", {})))
            if args is None:
                return text, []
            calls.append((obj["name"], args))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def safe_content_len(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[:len(self.TAG)]):
            return 0
        return len(text)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str):
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
