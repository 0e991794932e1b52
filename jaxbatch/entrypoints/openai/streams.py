"""Streaming plumbing shared by the handlers: SSE framing, disconnect races, merged streams."""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi import Request
from starlette.responses import StreamingResponse

from jaxbatch.entrypoints.openai import protocol as P


def sse(model: P._Model | dict) -> str:
    body = model.model_dump_json() if isinstance(model, P._Model) else json.dumps(model)
    return f"data: {body}\n\n"


class TextChunks:
    """SSE lines of stream chunks whose only news is text: the bytes `sse(chunk_of(index,
    text))` gives, without building and serializing pydantic models per token. A choice
    index's line is rendered once by pydantic around a marker; the text's JSON string takes
    the marker's place (both encoders escape exactly `"`, `\\` and the control characters).
    `chunk_of(index, text)`: the response model of a chunk carrying only that text."""
    _MARK = "jaxbatch-text-marker"

    def __init__(self, chunk_of: Callable[[int, str], P._Model]):
        self._chunk_of = chunk_of
        self._frames: dict[int, tuple[str, str] | None] = {}

    def __call__(self, index: int, text: str) -> str:
        if index not in self._frames:
            self._frames[index] = self._frame(index)
        frame = self._frames[index]
        if frame is None:                  # an id or model name equal to the marker
            return sse(self._chunk_of(index, text))
        return frame[0] + json.dumps(text, ensure_ascii=False) + frame[1]

    def _frame(self, index: int) -> tuple[str, str] | None:
        line, mark = sse(self._chunk_of(index, self._MARK)), json.dumps(self._MARK)
        if line.count(mark) != 1:
            return None
        head, _, tail = line.partition(mark)
        return head, tail


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


async def final_outputs(streams) -> dict:
    """{k: stream k's last output} of a non-streamed request's streams; every stream is
    aborted on the way out (a no-op for a finished one), whatever ends the wait."""
    finals = {}
    try:
        async for k, out in merge(streams):
            finals[k] = out
    finally:
        for s in streams:
            s.abort()
    return finals
