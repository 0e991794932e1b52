"""The load generator's HTTP client for streaming requests: a few lines of asyncio HTTP/1.1.

The load generator shares the machine with the server it measures, so every cycle it spends
reading chunks is taken from the server. httpx parses each chunk through several layers of
pure Python (httpcore, h11, anyio); here a chunk costs a few StreamReader calls, and a pass of
the served workload takes a fraction of httpx's CPU (docs/BENCHMARKS.md). vLLM's `bench
serve` reads its streams through aiohttp's C parser for the same reason.

`LeanClient.stream("POST", url, json=...)` offers the subset of httpx's `AsyncClient.stream`
that `serve_client.send_request` uses: `status_code`, `aread()`, `aiter_lines()`. One
connection per request (the server may keep it open: the response's framing says where it
ends). Bodies come framed by Content-Length, chunked transfer encoding, or the connection's
close.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0


class ProtocolError(Exception):
    """The server's response is not HTTP/1.1 this client can read."""


class StreamedResponse:
    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict):
        self._reader, self.status_code, self.headers = reader, status_code, headers

    async def aiter_bytes(self):
        reader, headers = self._reader, self.headers
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()).strip():    # trailers, then the blank line
                        pass
                    return
                data = await reader.readexactly(size + 2)       # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise ProtocolError(f"the connection closed {left} bytes before the body's end")
                left -= len(data)
                yield data
        else:
            while data := await reader.read(1 << 16):
                yield data

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    async def aiter_lines(self):
        """Lines without their line ending (LF or CRLF), as httpx yields them."""
        pending = b""
        async for data in self.aiter_bytes():
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.rstrip(b"\r").decode()


class LeanClient:
    def __init__(self, headers: dict | None = None):
        self.headers = dict(headers or {})

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, json=None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// URLs are supported, got {url!r}")
        tls = parts.scheme == "https"
        host, port = parts.hostname, parts.port or (443 if tls else 80)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl.create_default_context() if tls else None,
                                    limit=1 << 20),
            CONNECT_TIMEOUT_S)
        try:
            writer.write(_request_bytes(method, parts, host, port, self.headers, json))
            status, headers = await _read_head(reader)
            yield StreamedResponse(reader, status, headers)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _request_bytes(method, parts, host, port, headers, body) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: */*",
             "Connection: close", f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _read_head(reader) -> tuple[int, dict]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"the connection closed before a response ({e.partial[:60]!r})") from None
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers
