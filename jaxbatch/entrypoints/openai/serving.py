"""/v1/completions and /v1/chat/completions: from a validated request body to a response.

A request's path through `OpenAIServing.create_*` (all on the event loop unless noted):

 1. checks          unsupported fields, SamplingParams, caps that need no tokenizer (prompt
                    count, characters, request templates): 400 with the field named.
 2. `admit(cost)`   prompts x n counted against --max-num-queued-reqs at once, before any await
                    (503 if full, starting or draining). Released when the response is done.
 3. render          chat template + tokenization on the TokenizerPool (preprocess.py).
 4. add_request     the engine thread validates and queues it; a rejection -> 400.
                    Up to here nothing has been sent, so every error is a proper HTTP error.
 5. respond         stream: an SSE response whose generator turns cumulative outputs into
                    deltas; non-stream: wait for the final output, racing the client's disconnect.
    Leaving early (client gone, cancelled) aborts the request in the engine (`finally`).

The engine's finish reasons are "stop", "length" and "abort"; only OpenAI's reach the wire. An
abort the client did not cause (the drain's deadline, a second SIGTERM/SIGINT) is a 503 for a
non-streaming request, never a 200 with partial text; a stream ends its open choices with
finish_reason "length" (cut before its natural end), then an error event, then [DONE].
"""
from __future__ import annotations

import re
import time
import uuid

from jaxbatch.entrypoints.openai import echo as E
from jaxbatch.entrypoints.openai.echo import MIN_LOGPROB
from jaxbatch.entrypoints.openai import structured as S
from jaxbatch.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.errors import APIError
from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry
from jaxbatch.entrypoints.openai.preprocess import Preprocessor
from jaxbatch.entrypoints.openai.streams import (  # noqa: F401
    SSEResponse, TextChunks, final_outputs, merge, sse, with_cancellation)

CUT = "the server is shutting down: this request was aborted before it finished"


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


def wire_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason values only: an abort cut the output short, as a limit does."""
    return "length" if reason == "abort" else reason


def _text(c, req) -> str:
    """With include_stop_str_in_output, the matched stop string too: the engine cuts its text
    exactly where the stop string begins, so appending it gives vLLM's output."""
    if req.include_stop_str_in_output and c.finish_reason == "stop" \
            and isinstance(c.stop_reason, str):
        return c.text + c.stop_reason
    return c.text


def _check_not_cut(outputs) -> None:
    if any(c.finish_reason == "abort" for c in outputs):
        raise APIError(503, CUT, None, {"Retry-After": "5"})


def _cut_event() -> str:
    return sse(P.ErrorResponse(error=P.ErrorInfo(message=CUT, type="ServiceUnavailableError",
                                                 code=503)))


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, pre: Preprocessor,
                 tool_parser: str | None = None, lora=None):
        """`tool_parser`: the --tool-call-parser of tool_choice "auto" (None: auto refused).
        `lora`: the adapters a request may name in "model" (lora_routes.py LoRARegistry)."""
        self.llm, self.model_name, self.pre = llm, served_model_name, pre
        self.tool_parser = tool_parser
        self.lora = lora or LoRARegistry(served_model_name)
        self._token_strings: dict[int, str] = {}

    # ---- shared steps ----------------------------------------------------------------------
    def check_model(self, name: str | None):
        """None (the base model) or the LoRARequest of the adapter `name` names; 404 if neither."""
        return self.lora.resolve(name)

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len

    def _check_length(self, ids: list[int], param: str) -> None:
        if len(ids) + 1 > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, your prompt has {len(ids)} tokens (plus one "
                                f"to generate).", param)

    def _token_str(self, token_id: int, as_id: bool = False) -> str:
        if as_id:    # vLLM's return_tokens_as_token_ids: unambiguous where bytes split tokens
            return f"token_id:{token_id}"
        # Decoding one token is a dict lookup after the first time; cheap enough for the loop.
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.llm.tokenizer.decode([token_id])
        return s

    async def _start(self, prefix, prompts, params, priority, param, arrival, lora=None):
        """Step 4: one engine request per prompt; all or nothing. `arrival`: when the HTTP
        request came in, so TTFT and queue-time metrics include templating and queueing."""
        for ids in prompts:
            self._check_length(ids, param)
        base, streams = f"{prefix}-{uuid.uuid4().hex}", []
        try:
            for k, ids in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{k}"
                streams.append(await self.llm.add_request(rid, ids, params, priority, arrival,
                                                            lora))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ValueError):     # (a grammar that does not compile: `param` names
                raise _params_error(e, param) from None   # the field that constrained it)
            raise
        return base, streams

    # ---- logprobs ----------------------------------------------------------------------------
    def _chat_logprobs(self, c, start: int, k: int, as_id: bool) -> P.ChatLogProbs:
        entries = []
        for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
            entries.append(P.ChatLogProb(
                **self._top(tid, lps[tid], as_id),
                top_logprobs=[P.TopLogprob(**self._top(t, v, as_id)) for t, v in top]))
        return P.ChatLogProbs(content=entries)

    def _top(self, tid, value, as_id) -> dict:
        s = self._token_str(tid, as_id)
        return {"token": s, "logprob": max(value, MIN_LOGPROB), "bytes": list(s.encode())}

    def _completion_logprobs(self, c, start: int, offset: int, as_id: bool
                             ) -> P.CompletionLogProbs:
        lp = P.CompletionLogProbs()
        for tid, lps in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self._token_str(tid, as_id)
            lp.tokens.append(s)
            lp.token_logprobs.append(max(lps[tid], MIN_LOGPROB))
            lp.top_logprobs.append({self._token_str(t, as_id): max(v, MIN_LOGPROB)
                                    for t, v in lps.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    def _prompt_logprobs(self, out) -> list | None:
        """vLLM's shape: per prompt position None (the first) or {token id: {logprob, token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if lps is None else
                {str(t): {"logprob": max(v, MIN_LOGPROB), "decoded_token": self._token_str(t)}
                 for t, v in lps.items()} for lps in out.prompt_logprobs]

    def _admit(self, cost: int, param: str, lora=None):
        cap = self.llm.max_queued_requests
        if cap is not None and cost > cap:
            raise APIError(400, f"this request asks for {cost} sequences (prompts x n), more "
                                f"than the server ever queues (--max-num-queued-reqs={cap})",
                           param)
        return self.lora.hold(self.llm.admit(cost), lora)   # LoRA: held until released

    # ---- chat --------------------------------------------------------------------------------
    async def create_chat(self, req: P.ChatCompletionRequest):
        rid, stream, n_prompt, ticket, tools = await self.start_chat(req)
        if req.stream:
            return SSEResponse(self._chat_stream(req, rid, stream, n_prompt, ticket, tools))
        try:
            return await self._chat_full(req, rid, stream, n_prompt, tools)
        finally:
            ticket.release()

    async def start_chat(self, req: P.ChatCompletionRequest, prefix: str = "chatcmpl"):
        """Steps 1-4 of a chat request (/v1/responses too): -> (request id, its stream,
        prompt tokens, the admission ticket (the caller releases it), tool plan)."""
        arrival = time.monotonic()
        lora = self.check_model(req.model)
        self.llm.check_admitting()       # 503 while starting: the checks below need the engine
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = _checked_params(req, max_tokens, k)
        self.pre.check_chat(req)
        ticket = self._admit(req.n, "n", lora)
        try:
            tools, field = _constrained(req, params, self.tool_parser, chat=True)
            ids = await self.pre.chat_ids(req)
            rid, streams = await self._start(prefix, [ids], params, req.priority,
                                             field or "messages", arrival, lora)
        except BaseException:
            ticket.release()
            raise
        return rid, streams[0], len(ids), ticket, tools

    async def _chat_full(self, req, rid, stream, n_prompt, tools=None):
        final = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.abort()
        _check_not_cut(final.outputs)
        choices = []
        for c in final.outputs:
            message, finish_reason = S.chat_message(_text(c, req), c.finish_reason, tools)
            if c.reasoning is not None:   # a reasoning model's thought; a cut one leaves no content
                message = {**message, "reasoning": c.reasoning,
                           "content": message["content"] or None}
            choices.append(P.ChatChoice(
                index=c.index, message=P.ChatMessageOut(**message),
                logprobs=self._chat_logprobs(c, 0, req.top_logprobs or 0,
                                             req.return_tokens_as_token_ids)
                if req.logprobs else None,
                finish_reason=wire_reason(finish_reason), stop_reason=c.stop_reason))
        n_gen = sum(len(c.token_ids) for c in final.outputs)
        return P.ChatCompletionResponse(id=rid, model=req.model or self.model_name, choices=choices,
                                        usage=P.UsageInfo.of(n_prompt, n_gen, final.num_cached_tokens),
                                        prompt_logprobs=self._prompt_logprobs(final))

    async def _chat_stream(self, req, rid, stream, n_prompt, ticket, tools=None):
        created, n, k = int(time.time()), req.n, req.top_logprobs or 0
        chunk = lambda choice: P.ChatCompletionChunk(id=rid, created=created,   # noqa: E731
                                                     model=req.model or self.model_name, choices=[choice])
        text_chunk = TextChunks(lambda i, text: chunk(
            P.ChatStreamChoice(index=i, delta=P.DeltaMessage(content=text))))
        sent_text, sent_tok, done = [""] * n, [0] * n, [False] * n
        sent_thought = [""] * n    # a reasoning model's: its thought streams as delta.reasoning
        tool_streams = [S.ToolStream(tools) for _ in range(n)] if tools else None
        cached, cut = 0, False
        try:
            for i in range(n):   # OpenAI opens every choice with the role
                yield sse(chunk(P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))))
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    i, fin = c.index, c.finish_reason is not None
                    delta = _text(c, req)[len(sent_text[i]):]
                    new_tokens = len(c.token_ids) > sent_tok[i]
                    thought = (c.reasoning or "")[len(sent_thought[i]):]
                    if thought and not done[i]:
                        sent_thought[i] = c.reasoning
                        yield sse(chunk(P.ChatStreamChoice(
                            index=i, delta=P.DeltaMessage(reasoning=thought))))
                    if done[i] or not (delta or fin or (req.logprobs and new_tokens)):
                        continue
                    finish_reason = c.finish_reason
                    if tool_streams is not None:   # tool calls (structured.py): maybe held back
                        fields, finish_reason = tool_streams[i].delta(_text(c, req), fin,
                                                                      c.finish_reason)
                        if fields is None and not fin:
                            continue
                        message = P.DeltaMessage(**(fields or {}))
                    else:
                        message = None             # text: a pydantic model only if needed
                    lp = (self._chat_logprobs(c, sent_tok[i], k, req.return_tokens_as_token_ids)
                          if req.logprobs else None)
                    sent_text[i], sent_tok[i], done[i] = _text(c, req), len(c.token_ids), fin
                    cut |= c.finish_reason == "abort"
                    if message is None:
                        if lp is None and not fin and c.stop_reason is None:
                            yield text_chunk(i, delta)   # text only: most chunks of a stream
                            continue
                        message = P.DeltaMessage(content=delta or (None if fin else ""))
                    yield sse(chunk(P.ChatStreamChoice(
                        index=i, delta=message, logprobs=lp,
                        finish_reason=wire_reason(finish_reason), stop_reason=c.stop_reason)))
            if cut:
                yield _cut_event()
            if req.include_usage:
                usage = P.UsageInfo.of(n_prompt, sum(sent_tok), cached)
                yield sse(P.ChatCompletionChunk(id=rid, created=created, model=req.model or self.model_name,
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
        lora = self.check_model(req.model)
        self.llm.check_admitting()       # 503 while starting: the checks below need the engine
        params = E.ask_prompt_logprobs(req, _checked_params(req, E.max_tokens(req), req.logprobs))
        params.split_reasoning = False   # completions are raw text, a thought included
        count = self.pre.check_completion(req)
        ticket = self._admit(count * req.n, "prompt" if count > 1 else "n", lora)
        handed_off = False
        try:
            _, field = _constrained(req, params, None, chat=False)
            prompts = await self.pre.completion_ids(req)
            rid, streams = await self._start("cmpl", prompts, params, req.priority,
                                             field or "prompt", arrival, lora)
            n_prompt = sum(len(p) for p in prompts)
            if req.stream:
                handed_off = True
                return SSEResponse(self._completion_stream(req, rid, streams, n_prompt, ticket))
            return await self._completion_full(req, rid, streams, n_prompt, prompts)
        finally:
            if not handed_off:
                ticket.release()

    async def _completion_full(self, req, rid, streams, n_prompt, prompts):
        finals = await final_outputs(streams)
        _check_not_cut([c for out in finals.values() for c in out.outputs])
        if req.echo:
            return await self._echoed(req, rid, finals, n_prompt, prompts)
        choices = [P.CompletionChoice(
            index=k * req.n + c.index, text=_text(c, req),
            logprobs=(self._completion_logprobs(c, 0, 0, req.return_tokens_as_token_ids)
                      if req.logprobs is not None else None),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_logprobs=self._prompt_logprobs(finals[k]) if c.index == 0 else None)
            for k in sorted(finals) for c in finals[k].outputs]
        n_gen = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return P.CompletionResponse(id=rid, model=req.model or self.model_name, choices=choices,
                                    usage=P.UsageInfo.of(n_prompt, n_gen, cached))

    async def _echoed(self, req, rid, finals, n_prompt, prompts):
        """echo (echo.py): each choice's prompt, then its completion (none when prompt-only)."""
        as_id = req.return_tokens_as_token_ids
        texts = await E.prompt_texts(req, prompts, self.pre.detokenize)
        choices, n_gen = [], 0
        for k in sorted(finals):
            prompt_part = None
            if req.logprobs is not None:
                prompt_part = E.prompt_logprobs(prompts[k], finals[k].prompt_logprobs,
                                                req.logprobs, lambda t: self._token_str(t, as_id))
            for c in finals[k].outputs:
                text, logprobs = texts[k], prompt_part
                finish_reason, stop_reason = "length", None
                if not E.prompt_only(req):
                    text += _text(c, req)
                    n_gen += len(c.token_ids)
                    finish_reason, stop_reason = c.finish_reason, c.stop_reason
                    if prompt_part is not None:
                        logprobs = E.joined(prompt_part, self._completion_logprobs(
                            c, 0, E.end_offset(prompt_part), as_id))
                choices.append(P.CompletionChoice(
                    index=k * req.n + c.index, text=text, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=stop_reason,
                    prompt_logprobs=(self._prompt_logprobs(finals[k])
                                     if c.index == 0 and req.prompt_logprobs is not None else None)))
        cached = sum(out.num_cached_tokens for out in finals.values())
        return P.CompletionResponse(id=rid, model=req.model or self.model_name, choices=choices,
                                    usage=P.UsageInfo.of(n_prompt, n_gen, cached))

    async def _completion_stream(self, req, rid, streams, n_prompt, ticket):
        created, total = int(time.time()), len(streams) * req.n
        chunk = lambda choices, **extra: P.CompletionResponse(   # noqa: E731
            id=rid, created=created, model=req.model or self.model_name, choices=choices, **extra)
        text_chunk = TextChunks(lambda i, text: chunk([P.CompletionChoice(index=i, text=text)]))
        sent_text, sent_tok, done = [""] * total, [0] * total, [False] * total
        cached: dict[int, int] = {}
        cut = False
        try:
            async for k, out in merge(streams):
                cached[k] = out.num_cached_tokens
                for c in out.outputs:
                    i, fin = k * req.n + c.index, c.finish_reason is not None
                    delta = _text(c, req)[len(sent_text[i]):]
                    new_tokens = len(c.token_ids) > sent_tok[i]
                    if done[i] or not (delta or fin or (req.logprobs is not None and new_tokens)):
                        continue
                    lp = None
                    if req.logprobs is not None:
                        lp = self._completion_logprobs(c, sent_tok[i], len(sent_text[i]),
                                                       req.return_tokens_as_token_ids)
                    sent_text[i], sent_tok[i], done[i] = _text(c, req), len(c.token_ids), fin
                    cut |= c.finish_reason == "abort"
                    if lp is None and not fin and c.stop_reason is None:
                        yield text_chunk(i, delta)   # text only: most chunks of a stream
                        continue
                    yield sse(chunk([P.CompletionChoice(
                        index=i, text=delta, logprobs=lp,
                        finish_reason=wire_reason(c.finish_reason), stop_reason=c.stop_reason)]))
            if cut:
                yield _cut_event()
            if req.include_usage:
                usage = P.UsageInfo.of(n_prompt, sum(sent_tok), sum(cached.values()))
                yield sse(chunk([], usage=usage))
        except EngineDeadError as e:
            yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="InternalServerError", code=500)))
        finally:
            for s in streams:
                s.abort()
            ticket.release()
        yield "data: [DONE]\n\n"
