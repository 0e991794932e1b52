"""scripts/bench_serve.py against a fake OpenAI-compatible streaming server with known timings:
the fake answers after TTFT_S, then sends two tokens per chunk every ITL_S, then a usage chunk.
So TTFT, ITL and TPOT are known per request, and a client that counted chunks instead of the
usage's tokens would get both the token count and TPOT (twice too large) wrong."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
TTFT_S, ITL_S, TOKENS_PER_CHUNK = 0.15, 0.04, 2


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(REPO / "scripts"))
bench_serve = _load("bench_serve")


class FakeServer:
    """A few lines of asyncio HTTP/1.1: /health, /v1/models, streaming /v1/chat/completions
    and /v1/completions. Model "bad" gets a 400. Every response closes its connection."""

    def __init__(self):
        self.bodies = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = dict(l.split(": ", 1) for l in lines[1:] if ": " in l)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            body = json.loads(await reader.readexactly(length)) if length else None
            if path == "/health":
                self._json(writer, 200, {})
            elif path == "/v1/models":
                self._json(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
            elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                self.bodies.append(body)
                if body["model"] != "fake-model":
                    self._json(writer, 400, {"error": {"message": "unknown model", "code": 400}})
                else:
                    await self._stream(writer, body, chat=path.endswith("chat/completions"))
            else:
                self._json(writer, 404, {})
            await writer.drain()
        finally:
            writer.close()

    @staticmethod
    def _json(writer, status, obj):
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)

    async def _stream(self, writer, body, chat):
        n = body.get("max_completion_tokens") or body["max_tokens"]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        send = lambda obj: writer.write(f"data: {json.dumps(obj)}\n\n".encode())
        if chat:   # the role-only first chunk carries no text: not the first token
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await writer.drain()
        await asyncio.sleep(TTFT_S)
        chunks = math.ceil(n / TOKENS_PER_CHUNK)
        for i in range(chunks):
            if i:
                await asyncio.sleep(ITL_S)
            text = "ab " * min(TOKENS_PER_CHUNK, n - i * TOKENS_PER_CHUNK)
            last = i == chunks - 1
            choice = ({"index": 0, "delta": {"content": text}} if chat
                      else {"index": 0, "text": text})
            choice["finish_reason"] = "length" if last else None
            send({"choices": [choice]})
            await writer.drain()
        send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                       "total_tokens": 7 + n}})
        writer.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


def _workload(n=6):
    return bench_serve.make_workload(n, lengths=(12, 0.5, 6, 24), seed=1)


def test_metrics_match_the_fake_timings(fake):
    workload = _workload()
    out = asyncio.run(bench_serve.run_load(fake.url, workload, rate=math.inf, api="chat",
                                           goodput={"ttft": 5000, "tpot": 5000},
                                           health_interval=0.05))
    s, reqs = out["summary"], out["requests"]
    assert s["completed"] == len(workload) and s["failed"] == 0
    assert s["model"] == "fake-model"
    # Token counts come from usage, not from chunks (the fake packs two tokens per chunk).
    assert s["output_tokens"] == sum(r.max_tokens for r in workload)
    assert s["requests_with_other_output_length"] == 0 and s["requests_without_usage"] == 0
    assert s["input_tokens"] == 7 * len(workload)
    assert all(r["output_tokens"] == r["max_tokens"] for r in reqs)
    assert [len(r["chunk_times"]) for r in reqs] == [math.ceil(w.max_tokens / 2) for w in workload]
    # TTFT: the fake waits TTFT_S before the first text (the role chunk before it is no token).
    assert TTFT_S <= s["ttft"]["median_ms"] / 1e3 < TTFT_S + 0.1
    # ITL: gaps between chunks; TPOT per request = (chunks - 1) * ITL / (tokens - 1).
    assert ITL_S * 0.95 <= s["itl"]["median_ms"] / 1e3 < ITL_S * 1.6 + 0.005
    wants = []
    for r, w in zip(reqs, workload):
        chunks = math.ceil(w.max_tokens / 2)
        wants.append((chunks - 1) * ITL_S / (w.max_tokens - 1))
        assert wants[-1] * 0.95 <= r["tpot"] < wants[-1] * 1.25 + 0.003, (w.max_tokens, r, wants)
        assert TTFT_S <= r["ttft"] < TTFT_S + 0.1
    mean_want = sum(wants) / len(wants)
    assert mean_want * 0.95 <= s["tpot"]["mean_ms"] / 1e3 < mean_want * 1.25 + 0.003
    longest = max(w.max_tokens for w in workload)
    e2el_want = TTFT_S + (math.ceil(longest / 2) - 1) * ITL_S
    assert e2el_want <= s["e2el"]["p99_ms"] / 1e3 * 1.001 < e2el_want + 0.2
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(len(workload) / s["duration_s"])
    # All at once: every request in flight together.
    assert s["peak_concurrent_requests"] == len(workload)
    assert s["good_requests"] == len(workload)
    h = s["health"]
    assert h["samples"] >= 3 and h["non_200"] == 0 and h["p99_ms"] < 1000
    # What was asked of the server.
    body = fake.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user"


def test_rate_concurrency_goodput_and_failures(fake):
    workload = _workload()
    # Poisson arrivals at 20 req/s: each request is sent at its scheduled offset.
    out = asyncio.run(bench_serve.run_load(fake.url, workload, rate=20.0, api="completions",
                                           goodput={"ttft": 50}, health_interval=None))
    reqs = out["requests"]
    want = bench_serve.arrival_offsets(workload, 20.0)
    assert want[0] == 0 and all(b > a for a, b in zip(want, want[1:]))
    assert [r["scheduled"] for r in reqs] == pytest.approx(want)
    # Sent on schedule: never early; typically within a few ms, but a busy 2-core CI machine
    # can delay one event-loop wake-up by a few hundred ms (a 50 ms bound failed once there).
    lags = sorted(r["sent"] - r["scheduled"] for r in reqs)
    assert lags[0] >= 0 and lags[len(lags) // 2] < 0.05 and lags[-1] < 1.0
    assert out["summary"]["completed"] == len(workload)
    assert out["summary"]["good_requests"] == 0           # TTFT 150 ms > the 50 ms SLO
    assert "max_tokens" in fake.bodies[-1] and "prompt" in fake.bodies[-1]
    # At most two in flight.
    out = asyncio.run(bench_serve.run_load(fake.url, workload, max_concurrency=2,
                                           health_interval=None))
    assert out["summary"]["peak_concurrent_requests"] == 2
    assert out["summary"]["completed"] == len(workload)
    # Errors are counted, not timed.
    out = asyncio.run(bench_serve.run_load(fake.url, workload, model="bad",
                                           health_interval=None))
    assert out["summary"]["completed"] == 0 and out["summary"]["failed"] == len(workload)
    assert "HTTP 400" in out["summary"]["errors"][0]


def test_main_writes_report(fake, tmp_path):
    report = bench_serve.main(["--target", f"fake={fake.url}/v1", "--num-prompts", "4",
                               "--output-median", "6", "--output-max", "10",
                               "--request-rate", "10", "inf", "--warmup", "requests",
                               "--num-warmups", "1", "--goodput", "ttft:1000",
                               "--out", str(tmp_path)])
    assert [r["summary"]["request_rate"] for r in report["runs"]] == [10.0, math.inf]
    assert all(r["summary"]["completed"] == 4 for r in report["runs"])
    saved = json.loads((tmp_path / "bench_serve.json").read_text())
    assert len(saved["runs"]) == 2 and len(saved["workload"]) == 4
    md = (tmp_path / "bench_serve.md").read_text()
    assert md.count("| fake |") == 2 and "goodput" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_serve.png").stat().st_size > 0


def test_workload_is_fixed_across_rates():
    a, b = _workload(), _workload()
    assert [(r.text, r.max_tokens, r.gap) for r in a] == [(r.text, r.max_tokens, r.gap) for r in b]
    assert bench_serve.arrival_offsets(a, math.inf) == [0.0] * len(a)
    slow, fast = bench_serve.arrival_offsets(a, 1.0), bench_serve.arrival_offsets(a, 4.0)
    assert fast == pytest.approx([x / 4 for x in slow])
    assert bench_serve.parse_flag_kwargs("--max-model-len 1024 --x-y 0.5 --flag") == \
        {"max_model_len": 1024, "x_y": 0.5, "flag": True}
