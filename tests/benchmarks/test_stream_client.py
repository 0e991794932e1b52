"""The load generator's lean HTTP client (jaxbatch/benchmarks/stream_client.py) against a raw
asyncio server that frames its bodies every way HTTP/1.1 allows, split at awkward places."""
from __future__ import annotations

import asyncio
import json

import pytest

from jaxbatch.benchmarks.stream_client import LeanClient, ProtocolError

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\r\n\r\n', b"data: [DONE]\n\n"]
WANT_LINES = ['data: {"a": 1}', "", 'data: {"b": "\u00e9"}', "", "data: [DONE]", ""]


def _chunked(pieces):
    out = b""
    for p in pieces:
        out += f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def _awkward(data: bytes):
    """The same bytes split mid-line and mid-character, and two events in one piece."""
    return [data[:5], data[5:22], data[22:23], data[23:]]


BODY = b"".join(EVENTS)
RESPONSES = {
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(_awkward(BODY)),
    "/length": f"HTTP/1.1 200 OK\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY,
    "/close": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + BODY,
    "/error": b'HTTP/1.1 400 Bad Request\r\ncontent-length: 17\r\n\r\n{"error": "nope"}',
    "/short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this",
    "/garbage": b"SSH-2.0-OpenSSH\r\n\r\n",
}


async def _serve(received):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, v in (l.split(": ", 1) for l in lines[1:] if ": " in l)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        path = lines[0].split(" ")[1]
        received.append((lines[0], headers, body))
        data = RESPONSES[path.split("?")[0]]
        for piece in _awkward(data):          # the response itself arrives in pieces
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _run(fn):
    async def go():
        received = []
        server, base = await _serve(received)
        async with server:
            return await fn(base), received
    return asyncio.run(go())


@pytest.mark.parametrize("path", ["/chunked", "/length", "/close"])
def test_lines_come_out_whole_however_the_body_is_framed(path):
    async def fn(base):
        async with LeanClient({"Authorization": "Bearer k"}) as client:
            async with client.stream("POST", base + path + "?x=1", json={"q": "\u00e9"}) as resp:
                return resp.status_code, [line async for line in resp.aiter_lines()]
    (status, lines), received = _run(fn)
    assert status == 200 and lines == WANT_LINES
    request_line, headers, body = received[0]
    assert request_line == f"POST {path}?x=1 HTTP/1.1"
    assert headers["authorization"] == "Bearer k"
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"q": "\u00e9"}


def test_an_error_status_and_its_body_are_read():
    async def fn(base):
        async with LeanClient() as client:
            async with client.stream("POST", base + "/error", json={}) as resp:
                return resp.status_code, await resp.aread()
    (status, body), _ = _run(fn)
    assert status == 400 and json.loads(body) == {"error": "nope"}


@pytest.mark.parametrize("path, message", [("/short", "before the body's end"),
                                           ("/garbage", "not an HTTP/1.x status line")])
def test_a_broken_response_raises(path, message):
    async def fn(base):
        async with LeanClient() as client:
            async with client.stream("POST", base + path, json={}) as resp:
                return await resp.aread()
    with pytest.raises(ProtocolError, match=message):
        _run(fn)


def test_only_http_urls():
    async def fn():
        async with LeanClient() as client:
            async with client.stream("POST", "ftp://127.0.0.1/x", json={}):
                pass
    with pytest.raises(ValueError, match="only http"):
        asyncio.run(fn())
