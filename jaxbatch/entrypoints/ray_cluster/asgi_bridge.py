"""An HTTP request carried from the Ray Serve ingress to an engine replica, and run there
through the replica's own FastAPI app (the app `jaxbatch serve` runs), so every route, field,
error body and stream behaves exactly as on one server.

The ingress sends a `ForwardedRequest` through a streaming deployment handle; the replica
answers with the response's start (`ResponseStart`: status and headers) and then its body
chunks, one item per ASGI send. When the ingress stops reading (its client left), Ray cancels
the replica's generator: the app then receives `http.disconnect`, as under uvicorn, and aborts
the request.
"""
from __future__ import annotations

import asyncio
import dataclasses


@dataclasses.dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_key: str = ""        # what the request router matches prefixes on (router.py)


@dataclasses.dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def _scope(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": "http",
            "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query_string, "headers": list(request.headers),
            "client": ("ray-serve-ingress", 0), "server": ("jaxbatch-replica", 0)}


async def run_asgi(app, request: ForwardedRequest):
    """Yields the response of `app` to `request`: a ResponseStart, then body chunks (bytes)."""
    sent: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_given = False

    async def receive():
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    async def call():
        try:
            await app(_scope(request), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(call())
    complete = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        if complete:     # an error the app raised after answering was already answered
            await asyncio.gather(task, return_exceptions=True)
        else:
            await task
    finally:
        # Reached early when the reader went away: the app sees its client leave and aborts
        # the request, then finishes on its own.
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
