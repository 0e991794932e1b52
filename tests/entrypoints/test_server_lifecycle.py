"""Server lifecycle on its own subprocess: the port answers (503) before the engine is ready,
--api-key (401), --max-num-queued-reqs (503 + Retry-After, counted at the moment of the check),
and SIGTERM (stop admitting, let in-flight requests finish, exit 0)."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from server_utils import MODEL, ServerProcess, idle, raw_post, read_until, wait_for

pytestmark = pytest.mark.slow
KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 2


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "4", "--max-model-len", "256", "--no-warmup",
                        "--api-key", KEY, "--max-num-queued-reqs", str(CAP),
                        "--shutdown-timeout", "120")
    early = {}

    def probe(s):   # the first moment the port answers: the engine should still be loading
        early["completion"] = httpx.post(s.base + "/v1/completions", headers=AUTH, timeout=10,
                                         json={"prompt": "hi", "max_tokens": 2})
    try:
        srv.wait_ready(on_first_answer=probe)
        srv.early = early
        yield srv
    finally:
        srv.stop()


def test_port_answers_503_before_the_engine_is_ready(server):
    assert server.health_seen[0] == 503 and server.health_seen[-1] == 200
    r = server.early["completion"]
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
    assert r.json()["error"]["code"] == 503


def test_api_key(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == 401 and r.json()["error"]["message"]
    assert httpx.get(server.base + "/v1/models", timeout=10).status_code == 401
    # The key is checked before the body is read: malformed JSON without it is still a 401.
    bad = httpx.post(server.base + "/v1/completions", content=b'{"bad', timeout=10,
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
    assert httpx.post(server.base + "/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 401
    assert httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    # Probes and scrapes stay open, as in vLLM.
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200

    async def with_key(key):
        async with AsyncOpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0) as c:
            return await c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(with_key("wrong"))
    assert asyncio.run(with_key(KEY)).choices[0].finish_reason == "length"


def _long(stream=True):
    return {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
            "stream": stream, "temperature": 0}


def test_queue_cap_is_counted_at_the_moment_of_the_check(server):
    assert wait_for(lambda: idle(server.base), 30)
    # A burst of 6 at once, while none can finish (200 tokens each): exactly CAP get in.
    async def burst():
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as c:
            async def one():
                async with c.stream("POST", server.base + "/v1/completions", json=_long()) as r:
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                return 200, None     # streaming: leave (disconnect) now
                    await r.aread()
                    return r.status_code, r
            return await asyncio.gather(*(one() for _ in range(6)))
    results = asyncio.run(asyncio.wait_for(burst(), 120))
    codes = sorted(code for code, _ in results)
    assert codes == [200] * CAP + [503] * (6 - CAP), codes
    for code, r in results:
        if code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == 503
    # The admitted ones left early: aborted, so the server is idle and admits again.
    assert wait_for(lambda: idle(server.base), 10)
    ok = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=60,
                    json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    assert wait_for(lambda: idle(server.base), 30)
    # Long enough that both are surely still running while the drain is probed below (40
    # tokens once finished first, on a fast run, and the server had closed its port).
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 160, "ignore_eos": True,
            "stream": True, "temperature": 0}
    socks = [raw_post(server.port, "/v1/completions", body, AUTH) for _ in range(2)]
    heads = [read_until(s, b"data: ") for s in socks]
    assert all(b" 200 OK" in h for h in heads)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # Draining: the port still answers, but with 503.
    assert httpx.get(server.base + "/health", timeout=10).status_code == 503
    r = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=10,
                   json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and "Retry-After" in r.headers
    # The in-flight streams run to their end (160 tokens, finish_reason "length").
    for sock, head in zip(socks, heads):
        raw = head + read_until(sock, b"data: [DONE]")
        body_text = raw.split(b"\r\n\r\n", 1)[1].decode()
        # Chunked transfer encoding: keep only the SSE lines.
        events = [line[6:] for line in body_text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)
        sock.close()
    assert server.proc.wait(60) == 0, server.tail()
