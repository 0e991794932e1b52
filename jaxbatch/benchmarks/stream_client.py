"""The load generator's HTTP client for streaming requests: a few lines of asyncio HTTP/1.1.

The load generator shares the machine with the server it measures, so every cycle it spends
reading chunks is taken from the server. httpx parses each chunk through several layers of
pure Python (httpcore, h11, anyio); here a chunk costs a few StreamReader calls, and a pass of
the served workload takes a fraction of httpx's CPU (docs/BENCHMARKS.md). vLLM's `bench
serve` reads its streams through aiohttp's C parser for the same reason.

`LeanClient.stream("POST", url, json=...)` offers the subset of httpx's `AsyncClient.stream`
that `serve_client.send_request` uses: `status_code`, `aread()`, `aiter_lines()`. Each
request opens its own connection and asks the server to close it (`Connection: close`), so a
request's TTFT includes its TCP connect, as it would for a fresh client. Bodies come framed by
Content-Length, chunked transfer encoding, or the connection's close; interim 1xx responses
are skipped. A whole request may take up to REQUEST_TIMEOUT_S (httpx's read timeout here was
as long), so a server that stalls mid-stream fails the request instead of holding the run.
"""
from __future__ import annotations

import asyncio
import contextlib
import json as json_lib
import re
import ssl
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 6 * 3600.0
_HEX = re.compile(rb"[0-9a-fA-F]+")


class ProtocolError(Exception):
    """The server's response is not HTTP/1.1 this client can read."""


class StreamedResponse:
    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict,
                 has_body: bool = True):
        self._reader, self.status_code, self.headers = reader, status_code, headers
        self._has_body = has_body

    async def aiter_bytes(self):
        reader, headers = self._reader, self.headers
        if not self._has_body:
            return
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                digits = size_line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(digits):
                    raise ProtocolError(f"bad chunk size line {size_line[:40]!r}")
                size = int(digits, 16)
                if size == 0:
                    while (await reader.readline()).strip():    # trailers, then the blank line
                        pass
                    return
                data = await reader.readexactly(size + 2)       # the chunk and its CRLF
                if data[-2:] != b"\r\n":
                    raise ProtocolError("a chunk does not end where its size line says")
                yield data[:-2]
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise ProtocolError(
                        f"the connection closed {left} bytes before the body's end")
                left -= len(data)
                yield data
        else:
            while data := await reader.read(1 << 16):
                yield data

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    async def aiter_lines(self):
        """Lines without their line ending (LF or CRLF), decoded as UTF-8 with invalid bytes
        replaced, as httpx decodes them. Split before decoding: a character that straddles
        two chunks is never cut, since no UTF-8 sequence holds a newline byte."""
        pending = b""
        async for data in self.aiter_bytes():
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", "replace")


class LeanClient:
    def __init__(self, headers: dict | None = None):
        self.headers = dict(headers or {})

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, json=None):
        """`json`: the request body, sent as JSON (httpx's name for it)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// URLs are supported, got {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, port, limit=1 << 20,
                                        ssl=ssl.create_default_context() if tls else None),
                CONNECT_TIMEOUT_S)
            try:
                writer.write(_request_bytes(method, parts, self.headers, json))
                status, headers = await _read_head(reader)
                has_body = method != "HEAD" and status not in (204, 304)
                yield StreamedResponse(reader, status, headers, has_body)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()


def _request_bytes(method, parts, headers, body) -> bytes:
    data = b"" if body is None else json_lib.dumps(body).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]          # keeps an IPv6 literal's brackets
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Accept: */*",
             "Connection: close", f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _read_head(reader) -> tuple[int, dict]:
    """The final response's status and headers (lower-cased names); 1xx interim ones are
    skipped, as httpx skips them."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            raise ProtocolError(
                f"the connection closed before a response ({e.partial[:60]!r})") from None
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        fields = status_line.split(" ", 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(fields[1])
        if 100 <= status < 200 and status != 101:
            continue
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return status, headers
