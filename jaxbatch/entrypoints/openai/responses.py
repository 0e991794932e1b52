"""POST /v1/responses (stateless): OpenAI's Responses API over the chat path.

The request becomes a chat request (responses_protocol.py) and runs exactly as one
(OpenAIServing.start_chat: checks, admission, template, tools, grammar); the answer is shaped
as a Response: `output` holds a "reasoning" item (a reasoning model's thought, with
--reasoning-parser), then a "message" item with one "output_text" part, and/or one
"function_call" item per tool call. `status` is "completed", or "incomplete" with
`incomplete_details.reason = "max_output_tokens"` when the budget ran out.

Streaming sends OpenAI's event sequence, each with a `sequence_number`:
  response.created, response.in_progress,
  [reasoning]  response.output_item.added, response.content_part.added,
               response.reasoning_text.delta ..., response.reasoning_text.done,
               response.content_part.done, response.output_item.done
  [message]    response.output_item.added, response.content_part.added,
               response.output_text.delta ..., response.output_text.done,
               response.content_part.done, response.output_item.done
  [calls]      response.output_item.added, response.function_call_arguments.delta,
               response.function_call_arguments.done, response.output_item.done
  response.completed (or response.incomplete)
Text streams as it is generated; with tools the output is read once it ends (a call is known
only then), so its message and calls are sent at the end.
"""
from __future__ import annotations

import json
import time
import uuid

from jaxbatch.entrypoints.async_llm import EngineDeadError
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.entrypoints.openai.responses_protocol import ResponsesRequest, chat_request
from jaxbatch.entrypoints.openai.serving import CUT, OpenAIServing, _check_not_cut
from jaxbatch.entrypoints.openai.streams import SSEResponse
from jaxbatch.reasoning import REASONING_PARSERS


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _function_call(call: dict) -> dict:
    return {"id": _id("fc"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self._end_tags: set[int] | None = None

    async def create(self, req: ResponsesRequest):
        chat = chat_request(req)
        rid, stream, n_prompt, ticket, tools = await self.serving.start_chat(chat, "resp")
        response_id = "resp_" + rid.rpartition("-")[2]
        if req.stream:
            return SSEResponse(self._events(req, response_id, stream, n_prompt, ticket, tools))
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.abort()
            ticket.release()
        _check_not_cut(final.outputs)
        c = final.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        return self._response(req, response_id, self._output(c, tools, status), c, n_prompt,
                              final.num_cached_tokens)

    # ---- the Response object -----------------------------------------------------------------
    def _output(self, c, tools, status) -> list[dict]:
        """The finished output's items: thought, message, calls."""
        items = [_reasoning(c.reasoning, status)] if c.reasoning is not None else []
        message, _ = S.chat_message(c.text, c.finish_reason, tools)
        if message.get("content"):
            items.append(_message(message["content"], status))
        items += [_function_call(call) for call in message.get("tool_calls") or ()]
        return items

    def _reasoning_tokens(self, c) -> int:
        """The thought's tokens, its end tag included (every token if it never ended)."""
        if c.reasoning is None:
            return 0
        if self._end_tags is None:
            vocab = self.serving.llm.tokenizer.get_vocab()
            self._end_tags = {vocab[end] for _, end, _ in REASONING_PARSERS.values()
                              if end in vocab}
        for i, t in enumerate(c.token_ids):
            if t in self._end_tags:
                return i + 1
        return len(c.token_ids)

    def _response(self, req, response_id, output, c, n_prompt, cached, status=None) -> dict:
        if status is None:
            status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
        n_out = len(c.token_ids) if c is not None else 0
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "model": req.model or self.serving.model_name, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "error": None, "instructions": req.instructions, "output": output,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "previous_response_id": None, "store": False, "background": False,
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if c is None else {
                "input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(c)},
                "total_tokens": n_prompt + n_out}}

    # ---- streaming ---------------------------------------------------------------------------
    async def _events(self, req, response_id, stream, n_prompt, ticket, tools):
        events = _EventWriter()
        yield events("response.created",
                     response=self._response(req, response_id, [], None, n_prompt, 0,
                                             "in_progress"))
        yield events("response.in_progress",
                     response=self._response(req, response_id, [], None, n_prompt, 0,
                                             "in_progress"))
        thought = text = None          # the open items: [item id, output index, text so far]
        output: list[dict] = []
        final = None
        try:
            async for out in stream:
                final, c = out, out.outputs[0]
                if c.finish_reason == "abort":
                    break
                if c.reasoning is not None and (thought is None or c.reasoning != thought[2]):
                    if thought is None:
                        thought = [_id("rs"), len(output), ""]
                        output.append(None)
                        for e in events.open_item(_reasoning("", "in_progress", thought[0]),
                                                  thought[1], {"type": "reasoning_text",
                                                               "text": ""}):
                            yield e
                    if c.reasoning[len(thought[2]):]:
                        yield events("response.reasoning_text.delta", item_id=thought[0],
                                     output_index=thought[1], content_index=0,
                                     delta=c.reasoning[len(thought[2]):])
                    thought[2] = c.reasoning
                if tools is not None or not c.text or (text is not None and c.text == text[2]):
                    continue
                if thought is not None and output[thought[1]] is None:
                    output[thought[1]] = _reasoning(thought[2], "completed", thought[0])
                    for e in events.close_reasoning(output[thought[1]], thought[1]):
                        yield e
                if text is None:
                    text = [_id("msg"), len(output), ""]
                    output.append(None)
                    for e in events.open_item(_message("", "in_progress", text[0]), text[1],
                                              _text_part("")):
                        yield e
                yield events("response.output_text.delta", item_id=text[0],
                             output_index=text[1], content_index=0,
                             delta=c.text[len(text[2]):], logprobs=[])
                text[2] = c.text
            if final is None or final.outputs[0].finish_reason == "abort":
                yield events("error", code="503", message=CUT, param=None)
                return
            c = final.outputs[0]
            status = "incomplete" if c.finish_reason == "length" else "completed"
            if thought is not None and output[thought[1]] is None:
                output[thought[1]] = _reasoning(thought[2], status, thought[0])
                for e in events.close_reasoning(output[thought[1]], thought[1]):
                    yield e
            if text is not None:
                output[text[1]] = _message(text[2], status, text[0])
                for e in events.close_message(output[text[1]], text[1]):
                    yield e
            else:      # tools (or no text at all): the message and calls, now that all is known
                for item in self._output(c, tools, status)[1 if thought is not None else 0:]:
                    output.append(item)
                    for e in events.whole_item(item, len(output) - 1):
                        yield e
            done = "response.incomplete" if status == "incomplete" else "response.completed"
            yield events(done, response=self._response(req, response_id, output, c, n_prompt,
                                                       final.num_cached_tokens))
        except EngineDeadError as e:
            yield events("error", code="500", message=str(e), param=None)
        finally:
            stream.abort()
            ticket.release()


class _EventWriter:
    """SSE frames of Responses events, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def open_item(self, item: dict, index: int, part: dict):
        opened = {**item, "content": []}
        yield self("response.output_item.added", output_index=index, item=opened)
        yield self("response.content_part.added", item_id=item["id"], output_index=index,
                   content_index=0, part=part)

    def close_reasoning(self, item: dict, index: int):
        part = item["content"][0]
        yield self("response.reasoning_text.done", item_id=item["id"], output_index=index,
                   content_index=0, text=part["text"])
        yield self("response.content_part.done", item_id=item["id"], output_index=index,
                   content_index=0, part=part)
        yield self("response.output_item.done", output_index=index, item=item)

    def close_message(self, item: dict, index: int):
        part = item["content"][0]
        yield self("response.output_text.done", item_id=item["id"], output_index=index,
                   content_index=0, text=part["text"], logprobs=[])
        yield self("response.content_part.done", item_id=item["id"], output_index=index,
                   content_index=0, part=part)
        yield self("response.output_item.done", output_index=index, item=item)

    def whole_item(self, item: dict, index: int):
        """A message or function call sent at once: added, its one delta, done."""
        if item["type"] == "message":
            yield from self.open_item(item, index, _text_part(""))
            yield self("response.output_text.delta", item_id=item["id"], output_index=index,
                       content_index=0, delta=item["content"][0]["text"], logprobs=[])
            yield from self.close_message(item, index)
            return
        yield self("response.output_item.added", output_index=index,
                   item={**item, "arguments": "", "status": "in_progress"})
        yield self("response.function_call_arguments.delta", item_id=item["id"],
                   output_index=index, delta=item["arguments"])
        yield self("response.function_call_arguments.done", item_id=item["id"],
                   output_index=index, name=item["name"], arguments=item["arguments"])
        yield self("response.output_item.done", output_index=index, item=item)
