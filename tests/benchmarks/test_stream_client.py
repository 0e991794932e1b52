"""The load generator's streaming client (`AiohttpStreams`, jaxbatch/benchmarks/serve_client.py)
against a raw asyncio server that frames its bodies every way HTTP/1.1 allows, split at awkward
places."""
from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")

from jaxbatch.benchmarks.serve_client import AiohttpStreams  # noqa: E402

EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\r\n\r\n', b"data: [DONE]\n\n"]
WANT_LINES = ['data: {"a": 1}', "", 'data: {"b": "\u00e9"}', "", "data: [DONE]", ""]
BODY = b"".join(EVENTS)
CUTS = (5, 22, BODY.index(b"\xc3") + 1, BODY.index(b"[DONE]"))   # mid-line, mid-character


def _pieces(data: bytes, cuts=CUTS):
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def _chunked(pieces):
    out = b""
    for p in pieces:
        out += f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


CHUNKED = _chunked(_pieces(BODY))
# Each response: its head, then its body, written in the pieces listed (so a body spans reads).
RESPONSES = {
    "/chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                 _pieces(CHUNKED, (3, 7, 40, 41))),                 # cut inside size lines too
    "/length": (f"HTTP/1.1 200 OK\r\nContent-Length: {len(BODY)}\r\n\r\n".encode(),
                _pieces(BODY)),
    "/close": (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n", _pieces(BODY)),
    "/interim": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
                 b"HTTP/1.1 200 OK\r\n\r\n", _pieces(BODY)),
    "/error": (b"HTTP/1.1 400 Bad Request\r\ncontent-length: 17\r\n\r\n", [b'{"error": "nope"}']),
    "/empty": (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", []),
    "/latin": (b"HTTP/1.1 200 OK\r\n\r\n", [b"data: caf\xe9\n\n"]),
    "/short": (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", [b"only this"]),
    "/garbage": (b"SSH-2.0-OpenSSH\r\n\r\n", []),
    "/negative": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", [b"-1\r\nx\r\n"]),
    "/overlong": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                  [b"2\r\nabc\r\n0\r\n\r\n"]),
}


async def _serve(received):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, v in (l.split(": ", 1) for l in lines[1:] if ": " in l)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        path = lines[0].split(" ")[1]
        received.append((lines[0], headers, body))
        response_head, pieces = RESPONSES[path.split("?")[0]]
        for piece in (response_head, *pieces):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)
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


def _lines(path):
    async def fn(base):
        async with AiohttpStreams("k") as client:
            async with client.stream("POST", base + path + "?x=1", json={"q": "\u00e9"}) as resp:
                return resp.status_code, [line async for line in resp.aiter_lines()]
    return _run(fn)


@pytest.mark.parametrize("path", ["/chunked", "/length", "/close", "/interim"])
def test_lines_come_out_whole_however_the_body_is_framed(path):
    (status, lines), received = _lines(path)
    assert status == 200 and lines == WANT_LINES
    request_line, headers, body = received[0]
    assert request_line == f"POST {path}?x=1 HTTP/1.1"
    assert headers["authorization"] == "Bearer k"
    assert headers["content-type"] == "application/json"
    assert headers["host"].startswith("127.0.0.1:")
    assert json.loads(body) == {"q": "\u00e9"}


def test_invalid_utf8_is_replaced_as_httpx_does():
    (status, lines), _ = _lines("/latin")
    assert lines == ["data: caf\ufffd", ""]


@pytest.mark.parametrize("path, status, body", [("/error", 400, b'{"error": "nope"}'),
                                                ("/empty", 204, b"")])
def test_a_status_and_its_body_are_read(path, status, body):
    async def fn(base):
        async with AiohttpStreams() as client:
            async with client.stream("POST", base + path, json={}) as resp:
                return resp.status_code, await resp.aread()
    assert _run(fn)[0] == (status, body)


# Not "/negative" nor "/overlong": aiohttp's C parser waits for more data after a bad chunk
# (aio-libs/aiohttp#10596), so such a request ends at the client's whole-request timeout.
@pytest.mark.parametrize("path", ["/short", "/garbage"])
def test_a_broken_response_raises(path):
    async def fn(base):
        async with AiohttpStreams() as client:
            async with client.stream("POST", base + path, json={}) as resp:
                return await resp.aread()
    with pytest.raises(aiohttp.ClientError):
        _run(fn)
