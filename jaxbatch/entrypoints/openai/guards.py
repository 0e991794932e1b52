"""Pure-ASGI guards in front of the routes, checked before the work they protect.

- `BodyLimit`: a request body larger than --max-request-body-bytes is a 413 while it is being
  read (a Content-Length above the cap is refused before a byte of the body is read), so a
  20 MB body never reaches the JSON parser or the tokenizer; a body that trickles in slower
  than `read_timeout` is a 408. The body read is handed to the app as one message; later
  receive() calls (the disconnect watch) go to the connection.
- `ConcurrencyGuard`: at most --max-concurrent-requests requests in the app at once, 503 +
  Retry-After beyond; the probes (/health, /metrics, /version) are never counted nor refused,
  so an orchestrator still sees the server when clients flood it.
Pure ASGI, not BaseHTTPMiddleware (which would wrap streaming responses and disconnects).
"""
from __future__ import annotations

import asyncio
import time

from jaxbatch.entrypoints.openai.errors import error_response

PROBES = ("/health", "/metrics", "/version")


class BodyLimit:
    def __init__(self, app, max_bytes: int, read_timeout: float = 30.0):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        deadline = time.monotonic() + self.read_timeout
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                response = error_response(408, f"the request body did not arrive within "
                                               f"{self.read_timeout:g} s",
                                          headers={"Connection": "close"})
                return await response(scope, receive, send)
            if message["type"] != "http.request":   # the client left mid-body
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"the request body is larger than {self.max_bytes} "
                                       f"bytes (--max-request-body-bytes)",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


class ConcurrencyGuard:
    def __init__(self, app, limit: int):
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            response = error_response(503, f"too many concurrent requests (limit {self.limit},"
                                           f" --max-concurrent-requests)",
                                      headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
