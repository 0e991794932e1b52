"""POST /v1/embeddings (OpenAI's shape, vLLM's behaviour) on a `--runner pooling` server.

`input`: a string, a list of strings, token ids, or a list of token-id lists; each becomes
one engine request (prefill only, pooled: `engine/pooling.py`), all added or none, riding
the same continuous batch as every other request. `encoding_format` "float" (a list) or
"base64" (little-endian float32 bytes, what the `openai` client asks for by default);
`dimensions` keeps the first values of a Matryoshka model's embedding (a 400 elsewhere).
Caps, admission and the engine's verdict come before any byte is sent, as for completions
(serving.py), so every error is OpenAI's 400/503 body.
"""
from __future__ import annotations

import base64
import time
import types
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.errors import APIError
from jaxbatch.entrypoints.openai.preprocess import count_prompts
from jaxbatch.entrypoints.openai.serving import CUT, OpenAIServing
from jaxbatch.entrypoints.openai.streams import final_outputs, with_cancellation
from jaxbatch.pooling_params import PoolingParams


class EmbeddingRequest(P._Request):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class EmbeddingData(P._Model):
    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(P._Model):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(P._Model):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.llm, self.pre = serving.llm, serving.pre

    def _check(self, req: EmbeddingRequest) -> tuple[PoolingParams, int]:
        """400s that need no tokenizer -> (the requests' params, number of inputs)."""
        bad = P.check_fields(req)
        if bad:
            raise APIError(400, bad[1], bad[0])
        pooler = getattr(self.llm.engine, "pooler", None)
        if pooler is None:
            raise APIError(400, "this server generates text: /v1/embeddings needs a server "
                                "started with --runner pooling", "model")
        try:
            pooler.check_dimensions(req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from None
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts or any(t == "" for t in texts):
            raise APIError(400, "input must be a non-empty string, list of strings or token ids",
                           "input")
        count = count_prompts(req.input)
        if count > self.pre.max_prompts_per_request:
            raise APIError(400, f"at most {self.pre.max_prompts_per_request} inputs per request "
                                f"(got {count}; --max-prompts-per-request)", "input")
        if any(isinstance(t, str) and len(t) > self.pre.max_prompt_chars for t in texts):
            raise self.pre._too_long(max(len(t) for t in texts if isinstance(t, str)), "input")
        return PoolingParams(dimensions=req.dimensions), count

    async def create(self, req: EmbeddingRequest):
        arrival = time.monotonic()
        lora = self.serving.check_model(req.model)
        if lora is not None:
            raise APIError(400, "LoRA adapters are not supported for embeddings", "model")
        self.llm.check_admitting()
        params, count = self._check(req)
        ticket = self.serving._admit(count, "input")
        try:
            # The completions tokenizer path: the same prompt forms, off the event loop.
            prompts = await self.pre.completion_ids(
                types.SimpleNamespace(prompt=req.input, truncate_prompt_tokens=None))
            rid, streams = await self.serving._start("embd", prompts, params, 0, "input",
                                                     arrival)
            return await self._respond(req, rid, streams, prompts)
        finally:
            ticket.release()

    async def _respond(self, req, rid, streams, prompts) -> EmbeddingResponse:
        finals = await final_outputs(streams)
        if len(finals) < len(prompts) or any(not o.outputs.embedding for o in finals.values()):
            raise APIError(503, CUT, None, {"Retry-After": "5"})
        n_prompt = sum(len(p) for p in prompts)
        return EmbeddingResponse(
            id=rid, created=int(time.time()), model=req.model or self.serving.model_name,
            data=[EmbeddingData(index=k, embedding=encode(finals[k].outputs.embedding,
                                                          req.encoding_format))
                  for k in sorted(finals)],
            usage=EmbeddingUsage(prompt_tokens=n_prompt, total_tokens=n_prompt))


def embeddings_router(serving: OpenAIServing) -> APIRouter:
    router, embeddings = APIRouter(), EmbeddingServing(serving)

    @router.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, raw: Request):
        result = await with_cancellation(raw, embeddings.create(req))
        if result is None:     # the client disconnected; the requests were aborted
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    return router
