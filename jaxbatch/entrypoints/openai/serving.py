"""/v1/completions and /v1/chat/completions: from a validated request body to a response.

A request's path through `OpenAIServing.create_*` (all on the event loop unless noted):

 1. `admit()`       counted against --max-num-queued-reqs at once, before any await (503 if full,
                    starting or draining). The ticket is released when the response is done.
 2. checks          unsupported fields, SamplingParams (400 with the field named).
 3. render          chat template + tokenization in AsyncLLM's worker thread; too long -> 400.
 4. add_request     the engine thread validates and queues it; a rejection -> 400.
                    Up to here nothing has been sent, so every error is a proper HTTP error.
 5. respond         stream: an SSE response whose generator turns cumulative outputs into
                    deltas; non-stream: wait for the final output, racing the client's disconnect.
    Leaving early (client gone, cancelled) aborts the request in the engine (`finally`).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

from fastapi import Request
from starlette.responses import StreamingResponse

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.entrypoints.async_llm import AsyncLLM, EngineDeadError

MIN_LOGPROB = -9999.0   # JSON has no -inf; vLLM clamps the same way


class APIError(Exception):
    """Answered as {"error": {...}} with this status (see app.py)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _checked_params(req, max_tokens, logprobs):
    """The request's SamplingParams, or a 400 naming the unsupported or invalid field."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], bad[0])
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise _params_error(e) from None


def _constrained(req, params, tool_parser, chat):
    """Structured outputs and tools (structured.py): (tool plan, constraining field); 400s."""
    try:
        return S.apply_constraint(req, params, tool_parser, chat)
    except S.BadRequest as e:
        raise APIError(400, str(e), e.param) from None


def _params_error(e: ValueError, param: str | None = None) -> APIError:
    """400 naming the field: SamplingParams' messages start with "SamplingParams.<field>"."""
    m = re.match(r"SamplingParams\.(\w+)", str(e))
    return APIError(400, str(e), m.group(1) if m else param)


def sse(model: P._Model | dict) -> str:
    body = model.model_dump_json() if isinstance(model, P._Model) else json.dumps(model)
    return f"data: {body}\n\n"


class SSEResponse(StreamingResponse):
    """text/event-stream that always closes its generator, so the generator's `finally`
    (abort + ticket release) runs at once however the response ends: done, client gone
    (Starlette cancels the send loop), or server shutdown."""
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def with_cancellation(request: Request, coro):
    """Runs `coro`, cancelling it if the client disconnects first (vLLM's `with_cancellation`):
    Starlette notices a disconnect only while it streams, so a non-streaming request would
    otherwise generate to max_tokens and hold its KV blocks for nobody. Returns None if the
    client left."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    return None


async def merge(streams):
    """(k, output) from several RequestStreams (a completions request with several prompts).
    Like the mailboxes, it keeps only each stream's newest (cumulative) output, so a slow
    client never makes outputs pile up here either."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    latest: dict = {}
    wake = asyncio.Event()

    async def pump(k, stream):
        try:
            async for out in stream:
                latest[k] = out
                wake.set()
        except Exception as e:   # noqa: BLE001 - handed to the consumer
            latest[k] = e
            wake.set()

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            await wake.wait()
            wake.clear()
            items = sorted(latest.items(), key=lambda kv: kv[0])
            latest.clear()
            for k, item in items:
                if isinstance(item, Exception):
                    raise item
                left -= item.finished
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, tool_parser: str | None = None):
        """`tool_parser`: the --tool-call-parser of tool_choice "auto" (None: auto refused)."""
        self.llm, self.model_name, self.tool_parser = llm, served_model_name, tool_parser
        self._token_strings: dict[int, str] = {}

    # ---- shared steps ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len

    def _check_length(self, ids: list[int], param: str) -> None:
        if len(ids) + 1 > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, your prompt has {len(ids)} tokens (plus one "
                                f"to generate).", param)

    def _token_str(self, token_id: int) -> str:
        # Decoding one token is a dict lookup after the first time; cheap enough for the loop.
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.llm.tokenizer.decode([token_id])
        return s

    def render_chat(self, req: P.ChatCompletionRequest) -> list[int]:
        """Runs in the worker thread. The same call as LLM.chat, so the tokens are the same."""
        tok = self.llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        try:
            extra = {"tools": req.tools} if req.tools else {}     # templates show the tools
            p = tok.apply_chat_template(req.conversation(), tokenize=True, return_dict=False,
                                        add_generation_prompt=req.add_generation_prompt,
                                        **extra, **(req.chat_template_kwargs or {}))
        except Exception as e:   # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"chat template failed: {e}", "messages") from None
        return list(p["input_ids"]) if hasattr(p, "keys") else list(p)

    def render_prompts(self, prompt) -> list[list[int]]:
        """Runs in the worker thread: the completions `prompt` field as token-id lists."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.llm.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
                p = self.llm.tokenizer(p)["input_ids"]
            out.append(list(p))
        return out

    async def _start(self, prefix, prompts, params, priority, param, arrival):
        """Step 4: one engine request per prompt; all or nothing. `arrival`: when the HTTP
        request came in, so TTFT and queue-time metrics include templating and queueing."""
        for ids in prompts:
            self._check_length(ids, param)
        base, streams = f"{prefix}-{uuid.uuid4().hex}", []
        try:
            for k, ids in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{k}"
                streams.append(await self.llm.add_request(rid, ids, params, priority, arrival))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ValueError):     # (a grammar that does not compile: `param` names
                raise _params_error(e, param) from None   # the field that constrained it)
            raise
        return base, streams

    # ---- logprobs ----------------------------------------------------------------------------
    def _chat_logprobs(self, c, start: int, k: int) -> P.ChatLogProbs:
        entries = []
        for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
            entries.append(P.ChatLogProb(
                **self._top(tid, lps[tid]),
                top_logprobs=[P.TopLogprob(**self._top(t, v)) for t, v in top]))
        return P.ChatLogProbs(content=entries)

    def _top(self, tid, value) -> dict:
        s = self._token_str(tid)
        return {"token": s, "logprob": max(value, MIN_LOGPROB), "bytes": list(s.encode())}

    def _completion_logprobs(self, c, start: int, offset: int) -> P.CompletionLogProbs:
        lp = P.CompletionLogProbs()
        for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self._token_str(tid)
            lp.tokens.append(s)
            lp.token_logprobs.append(max(lps[tid], MIN_LOGPROB))
            lp.top_logprobs.append({self._token_str(t): max(v, MIN_LOGPROB) for t, v in lps.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    # ---- chat --------------------------------------------------------------------------------
    async def create_chat(self, req: P.ChatCompletionRequest):
        arrival = time.monotonic()
        self.check_model(req.model)
        ticket = self.llm.admit()
        handed_off = False
        try:
            k = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            params = _checked_params(req, max_tokens, k)
            tools, field = _constrained(req, params, self.tool_parser, chat=True)
            ids = await self.llm.run_in_pool(self.render_chat, req)
            rid, streams = await self._start("chatcmpl", [ids], params, req.priority,
                                             field or "messages", arrival)
            if req.stream:
                handed_off = True
                return SSEResponse(self._chat_stream(req, rid, streams[0], len(ids), ticket, tools))
            return await self._chat_full(req, rid, streams[0], len(ids), tools)
        finally:
            if not handed_off:
                ticket.release()

    async def _chat_full(self, req, rid, stream, n_prompt, tools=None):
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.abort()
        choices = []
        for c in final.outputs:
            message, finish_reason = S.chat_message(c.text, c.finish_reason, tools)
            choices.append(P.ChatChoice(
                index=c.index, message=P.ChatMessageOut(**message),
                logprobs=self._chat_logprobs(c, 0, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason))
        n_gen = sum(len(c.token_ids) for c in final.outputs)
        return P.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                        usage=P.UsageInfo.of(n_prompt, n_gen, final.num_cached_tokens))

    async def _chat_stream(self, req, rid, stream, n_prompt, ticket, tools=None):
        created, n, k = int(time.time()), req.n, req.top_logprobs or 0
        chunk = lambda choice: P.ChatCompletionChunk(id=rid, created=created,   # noqa: E731
                                                     model=self.model_name, choices=[choice])
        sent_text, sent_tok, done = [""] * n, [0] * n, [False] * n
        tool_streams = [S.ToolStream(tools) for _ in range(n)] if tools else None
        cached = 0
        try:
            for i in range(n):   # OpenAI opens every choice with the role
                yield sse(chunk(P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))))
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    i, fin = c.index, c.finish_reason is not None
                    delta = c.text[len(sent_text[i]):]
                    new_tokens = len(c.token_ids) > sent_tok[i]
                    if done[i] or not (delta or fin or (req.logprobs and new_tokens)):
                        continue
                    finish_reason = c.finish_reason
                    if tool_streams is not None:   # tool calls (structured.py): maybe held back
                        fields, finish_reason = tool_streams[i].delta(c.text, fin, c.finish_reason)
                        if fields is None and not fin:
                            continue
                        message = P.DeltaMessage(**(fields or {}))
                    else:
                        message = P.DeltaMessage(content=delta or (None if fin else ""))
                    lp = self._chat_logprobs(c, sent_tok[i], k) if req.logprobs else None
                    sent_text[i], sent_tok[i], done[i] = c.text, len(c.token_ids), fin
                    yield sse(chunk(P.ChatStreamChoice(
                        index=i, delta=message, logprobs=lp, finish_reason=finish_reason,
                        stop_reason=c.stop_reason)))
            if req.include_usage:
                usage = P.UsageInfo.of(n_prompt, sum(sent_tok), cached)
                yield sse(P.ChatCompletionChunk(id=rid, created=created, model=self.model_name,
                                                choices=[], usage=usage))
        except EngineDeadError as e:
            yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="InternalServerError", code=500)))
        finally:
            stream.abort()
            ticket.release()
        yield "data: [DONE]\n\n"

    # ---- completions ---------------------------------------------------------------------------
    async def create_completion(self, req: P.CompletionRequest):
        arrival = time.monotonic()
        self.check_model(req.model)
        ticket = self.llm.admit()
        handed_off = False
        try:
            params = _checked_params(req, req.max_tokens, req.logprobs)
            _, field = _constrained(req, params, None, chat=False)
            prompts = await self.llm.run_in_pool(self.render_prompts, req.prompt)
            rid, streams = await self._start("cmpl", prompts, params, req.priority,
                                             field or "prompt", arrival)
            n_prompt = sum(len(p) for p in prompts)
            if req.stream:
                handed_off = True
                return SSEResponse(self._completion_stream(req, rid, streams, n_prompt, ticket))
            return await self._completion_full(req, rid, streams, n_prompt)
        finally:
            if not handed_off:
                ticket.release()

    async def _completion_full(self, req, rid, streams, n_prompt):
        finals = {}
        try:
            async for k, out in merge(streams):
                finals[k] = out
        finally:
            for s in streams:
                s.abort()
        choices = [P.CompletionChoice(
            index=k * req.n + c.index, text=c.text,
            logprobs=self._completion_logprobs(c, 0, 0) if req.logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for k in sorted(finals) for c in finals[k].outputs]
        n_gen = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return P.CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                    usage=P.UsageInfo.of(n_prompt, n_gen, cached))

    async def _completion_stream(self, req, rid, streams, n_prompt, ticket):
        created, total = int(time.time()), len(streams) * req.n
        sent_text, sent_tok, done = [""] * total, [0] * total, [False] * total
        cached: dict[int, int] = {}
        try:
            async for k, out in merge(streams):
                cached[k] = out.num_cached_tokens
                for c in out.outputs:
                    i, fin = k * req.n + c.index, c.finish_reason is not None
                    delta = c.text[len(sent_text[i]):]
                    new_tokens = len(c.token_ids) > sent_tok[i]
                    if done[i] or not (delta or fin or (req.logprobs is not None and new_tokens)):
                        continue
                    lp = None
                    if req.logprobs is not None:
                        lp = self._completion_logprobs(c, sent_tok[i], len(sent_text[i]))
                    sent_text[i], sent_tok[i], done[i] = c.text, len(c.token_ids), fin
                    yield sse(P.CompletionResponse(
                        id=rid, created=created, model=self.model_name,
                        choices=[P.CompletionChoice(index=i, text=delta, logprobs=lp,
                                                    finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason)]))
            if req.include_usage:
                usage = P.UsageInfo.of(n_prompt, sum(sent_tok), sum(cached.values()))
                yield sse(P.CompletionResponse(id=rid, created=created, model=self.model_name,
                                               choices=[], usage=usage))
        except EngineDeadError as e:
            yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="InternalServerError", code=500)))
        finally:
            for s in streams:
                s.abort()
            ticket.release()
        yield "data: [DONE]\n\n"
