"""Interrupts (issue 26): SIGINT drains like SIGTERM; a second signal aborts the rest at once,
yet every open stream gets its final chunk (an OpenAI finish_reason) and [DONE], a
non-streaming request cut by it is a 503 with an error body (never a 200 with partial text),
and the process exits 0."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from server_utils import ServerProcess, raw_post, read_until

pytestmark = pytest.mark.slow
OPENAI_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "8", "--max-model-len", "512", "--no-warmup",
                        "--shutdown-timeout", "120")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _events(raw: bytes) -> list[str]:
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


def test_sigint_drains_then_a_second_signal_ends_every_stream_properly(server):
    long = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    streams = [raw_post(server.port, p, dict(long, stream=True)) for p in
               ("/v1/completions", "/v1/completions")]
    chat = raw_post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400,
        "ignore_eos": True, "stream": True, "n": 2})
    plain = raw_post(server.port, "/v1/completions", long)
    heads = [read_until(s, b"data: ") for s in streams + [chat]]
    assert all(b" 200 OK" in h for h in heads)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    # Draining, as after SIGTERM: the port answers 503, admitted requests keep going.
    assert httpx.get(server.base + "/health", timeout=10).status_code == 503
    assert server.proc.poll() is None
    more = [h + read_until(s, b"data: {", 1 << 20) for h, s in zip(heads, streams + [chat])]
    server.proc.send_signal(signal.SIGTERM)    # the second signal: abort the rest now
    t0 = time.monotonic()
    for sock, head in zip(streams + [chat], more):
        events = _events(head + read_until(sock, b"data: [DONE]"))
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        reasons = {}
        for c in chunks:
            for ch in c.get("choices", []):
                if ch.get("finish_reason") is not None:
                    reasons[ch["index"]] = ch["finish_reason"]
        assert len(reasons) == (2 if sock is chat else 1), reasons   # every choice ended
        assert set(reasons.values()) <= OPENAI_REASONS, reasons
        assert chunks[-1]["error"]["code"] == 503      # and the cut is said, not hidden
        sock.close()
    raw = read_until(plain, b"}}")
    assert raw.startswith(b"HTTP/1.1 503"), raw[:200]
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 503 and "choices" not in body
    assert time.monotonic() - t0 < 30
    assert server.proc.wait(60) == 0, server.tail()
