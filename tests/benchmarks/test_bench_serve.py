"""`jaxbatch bench serve` (jaxbatch/benchmarks/serve*.py) against fake OpenAI-compatible
streaming servers with known timings: the fake answers after TTFT_S, then sends two tokens per
chunk every ITL_S, then a usage chunk. So TTFT, ITL and TPOT are known per request, and a
client that counted chunks instead of the usage's tokens would get both the token count and
TPOT (twice too large) wrong.

The figures are checked exactly on a fake clock (an in-process transport that advances it
instead of sleeping); the real socket server checks what the client sends and counts, with
no wall-clock window a loaded machine could miss (only lower bounds: sleeps never end early)."""
from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import math
import threading
import types

import numpy as np
import pytest

pytest.importorskip("httpx")

from benchmarks import serve_launch  # noqa: E402  (the lab's driver: launched servers, offline)
from jaxbatch.benchmarks import serve, serve_client, workloads  # noqa: E402

TTFT_S, ITL_S, TOKENS_PER_CHUNK = 0.15, 0.04, 2
# The names these tests use, wherever they now live.
bench_serve = types.SimpleNamespace(
    make_workload=workloads.make_workload, arrival_offsets=workloads.arrival_offsets,
    run_load=serve_client.run_load, parse_flag_kwargs=serve_launch.parse_flag_kwargs,
    main=serve.main)


def _frames(body, chat):
    """The fake's stream for one request: (seconds to wait before it, SSE bytes)."""
    n = body.get("max_completion_tokens") or body["max_tokens"]
    frame = lambda obj: f"data: {json.dumps(obj)}\n\n".encode()  # noqa: E731
    if chat:   # the role-only first chunk carries no text: not the first token
        yield 0.0, frame({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    chunks = math.ceil(n / TOKENS_PER_CHUNK)
    for i in range(chunks):
        text = "ab " * min(TOKENS_PER_CHUNK, n - i * TOKENS_PER_CHUNK)
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        choice["finish_reason"] = "length" if i == chunks - 1 else None
        yield (ITL_S if i else TTFT_S), frame({"choices": [choice]})
    yield 0.0, frame({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                               "total_tokens": 7 + n}})
    yield 0.0, b"data: [DONE]\n\n"


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
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        for wait, data in _frames(body, chat):
            if wait:
                await writer.drain()
                await asyncio.sleep(wait)
            writer.write(data)
        await writer.drain()


class FakeClock:
    """Seconds that pass only when the fake transport says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def fake_transport(clock, bodies):
    """An httpx transport answering like FakeServer, advancing `clock` where it would sleep."""
    import httpx

    async def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        bodies.append(body)

        async def stream():
            for wait, data in _frames(body, chat=request.url.path.endswith("chat/completions")):
                clock.now += wait
                yield data
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=stream())
    return httpx.MockTransport(handler)


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


def _workload(n=6):
    return bench_serve.make_workload(n, lengths=(12, 0.5, 6, 24), seed=1)


def test_metrics_match_the_fake_timings():
    """One request at a time on the fake clock: every figure is exact arithmetic."""
    workload, clock, bodies = _workload(), FakeClock(), []
    out = asyncio.run(bench_serve.run_load(
        "http://fake", workload, rate=math.inf, max_concurrency=1, api="chat",
        goodput={"ttft": 1e3 * TTFT_S, "tpot": 5000}, health_interval=None, clock=clock,
        transport=fake_transport(clock, bodies)))
    s, reqs = out["summary"], out["requests"]
    assert s["completed"] == len(workload) and s["failed"] == 0
    assert s["model"] == "fake-model"
    # Token counts come from usage, not from chunks (the fake packs two tokens per chunk).
    assert s["output_tokens"] == sum(r.max_tokens for r in workload)
    assert s["requests_with_other_output_length"] == 0 and s["requests_without_usage"] == 0
    assert s["input_tokens"] == 7 * len(workload)
    assert all(r["output_tokens"] == r["max_tokens"] for r in reqs)
    chunks = [math.ceil(w.max_tokens / 2) for w in workload]
    assert [len(r["chunk_times"]) for r in reqs] == chunks
    # TTFT: the fake waits TTFT_S before the first text (the role chunk before it is no token).
    e2el = [TTFT_S + (c - 1) * ITL_S for c in chunks]
    tpot = [(c - 1) * ITL_S / (w.max_tokens - 1) for c, w in zip(chunks, workload)]
    sent = np.cumsum([0.0] + e2el[:-1])          # each request starts when the last one ends
    for r, want_sent, want_e2el, want_tpot in zip(reqs, sent, e2el, tpot):
        assert r["sent"] == pytest.approx(want_sent)
        assert r["ttft"] == pytest.approx(TTFT_S)
        assert r["e2el"] == pytest.approx(want_e2el)
        assert r["tpot"] == pytest.approx(want_tpot)
        assert np.diff(r["chunk_times"]) == pytest.approx([ITL_S] * (len(r["chunk_times"]) - 1))
    ms = lambda xs: {"mean_ms": pytest.approx(1e3 * np.mean(xs)),  # noqa: E731
                     "median_ms": pytest.approx(1e3 * np.median(xs)),
                     "p99_ms": pytest.approx(1e3 * np.percentile(xs, 99))}
    assert s["ttft"] == ms([TTFT_S] * len(workload))
    assert s["itl"] == ms([ITL_S] * (sum(chunks) - len(chunks)))
    assert s["tpot"] == ms(tpot)
    assert s["e2el"] == ms(e2el)
    assert s["duration_s"] == pytest.approx(sum(e2el))
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / sum(e2el))
    assert s["request_throughput"] == pytest.approx(len(workload) / sum(e2el))
    assert s["total_tokens_per_s"] == pytest.approx(
        (s["output_tokens"] + s["input_tokens"]) / sum(e2el))
    assert s["peak_concurrent_requests"] == 1
    # Goodput: TTFT exactly at its SLO counts as good.
    assert s["good_requests"] == len(workload)
    assert s["goodput"] == pytest.approx(len(workload) / sum(e2el))
    body = bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user"


def test_the_heap_is_out_of_the_collectors_reach_while_requests_are_sent():
    """A full collection holds every thread while it walks the heap (hundreds of ms in a test
    session's or a model's process): the load generator freezes what is there before its
    first send and unfreezes it after the last response."""
    workload, clock, bodies = _workload(), FakeClock(), []
    heap = [[i] for i in range(50_000)]      # objects the run must not leave to the collector
    frozen_at_send = []

    transport = fake_transport(clock, bodies)
    answer = transport.handle_async_request

    async def recording(request):
        frozen_at_send.append(gc.get_freeze_count())
        return await answer(request)
    transport.handle_async_request = recording
    asyncio.run(bench_serve.run_load("http://fake", workload, rate=math.inf, api="chat",
                                     health_interval=None, clock=clock, transport=transport))
    assert len(frozen_at_send) == 1 + len(workload)        # /v1/models, then each request
    assert min(frozen_at_send) >= len(heap)
    assert gc.get_freeze_count() == 0
    # A process that froze its heap itself keeps it frozen after a run: an object frozen with
    # it stays out of the collector's generations (the freeze count itself is no witness:
    # frozen objects that lose their last reference meanwhile leave it).
    sentinel = [object()]
    gc.freeze()
    try:
        asyncio.run(bench_serve.run_load("http://fake", workload, rate=math.inf, api="chat",
                                         health_interval=None, clock=clock,
                                         transport=fake_transport(clock, bodies)))
        assert not any(o is sentinel for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_all_at_once_against_a_socket_server(fake):
    """The real client over real sockets: counts, concurrency, /health, what is sent."""
    workload = _workload()
    out = asyncio.run(bench_serve.run_load(fake.url, workload, rate=math.inf, api="chat",
                                           goodput={"ttft": 5000, "tpot": 5000},
                                           health_interval=0.05))
    s, reqs = out["summary"], out["requests"]
    assert s["completed"] == len(workload) and s["failed"] == 0
    assert s["model"] == "fake-model"
    assert s["output_tokens"] == sum(r.max_tokens for r in workload)
    assert s["requests_with_other_output_length"] == 0 and s["requests_without_usage"] == 0
    assert [len(r["chunk_times"]) for r in reqs] == [math.ceil(w.max_tokens / 2) for w in workload]
    # The fake sleeps TTFT_S after the request arrives: a bound a loaded machine cannot break
    # (the exact figures are checked on the fake clock above).
    assert all(r["ttft"] >= TTFT_S for r in reqs)
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    # All at once: every request in flight together.
    assert s["peak_concurrent_requests"] == len(workload)
    assert s["good_requests"] == len(workload)
    h = s["health"]
    assert h["samples"] >= 3 and h["non_200"] == 0 and h["p99_ms"] < 1000
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
    assert lags[0] >= 0 and lags[len(lags) // 2] < 0.05 and lags[-1] < 1.0, lags
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
    price = saved["price"]
    assert price["usd_per_hour"] > 0 and price["source"] in md
    assert "| $ / M out tok |" in md
    for run in report["runs"]:      # each row's cost cell, from its own throughput
        tok_s = run["summary"]["output_tokens_per_s"]
        assert f"| ${price['usd_per_hour'] / (tok_s * 3600) * 1e6:.3f} |" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_serve.png").stat().st_size > 0


def test_workload_is_fixed_across_rates():
    a, b = _workload(), _workload()
    assert [(r.text, r.max_tokens, r.gap) for r in a] == [(r.text, r.max_tokens, r.gap) for r in b]
    assert bench_serve.arrival_offsets(a, math.inf) == [0.0] * len(a)
    slow, fast = bench_serve.arrival_offsets(a, 1.0), bench_serve.arrival_offsets(a, 4.0)
    assert fast == pytest.approx([x / 4 for x in slow])
    assert bench_serve.parse_flag_kwargs(
        "--max-model-len 1024 --x-y 0.5 --flag --no-enable-prefix-caching --no-warmup") == \
        {"max_model_len": 1024, "x_y": 0.5, "flag": True, "enable_prefix_caching": False,
         "warmup": False}


def test_offline_baseline_gets_the_servers_engine_options_and_none_of_its_server_flags(
        tmp_path, monkeypatch):
    """--serve-args hold both engine options (which the offline LLM() must share with the
    server, `--no-X` included) and server-only flags (which LLM() would refuse)."""
    specs = []

    def fake_run(cmd, check, cwd):
        spec = json.loads(open(cmd[-1]).read())
        specs.append(spec)
        with open(spec["out"], "w") as f:
            json.dump({"output_tokens_per_s": 1.0}, f)

    monkeypatch.setattr(serve_launch.subprocess, "run", fake_run)
    args = types.SimpleNamespace(
        max_num_seqs=8, jaxbatch_model=None, offline_passes=1, jaxbatch_python="python",
        serve_args="--max-model-len 1024 --dtype bfloat16 --no-enable-prefix-caching "
                   "--api-key k --port 9 --tool-call-parser hermes --log-level warning")
    assert serve_launch.run_offline_baseline(args, [], tmp_path) == {"output_tokens_per_s": 1.0}
    assert specs[0]["llm_kwargs"] == {"max_num_seqs": 8, "warmup": True, "max_model_len": 1024,
                                      "dtype": "bfloat16", "enable_prefix_caching": False}


def test_rounds_interleave_served_and_offline_and_the_ratio_is_of_medians(tmp_path, monkeypatch):
    """--rounds 3 --offline-baseline: served run, offline run, served, offline, ... against the
    same idle server; the reported ratio is median served / median offline, and a rate other
    than inf is no saturation run."""
    order, served, offline = [], iter([100.0, 300.0, 200.0, 50.0, 60.0, 70.0]), iter([400.0, 250.0, 200.0])

    async def fake_warm_up(*a, **k):
        order.append("warm-up")
        return {}

    async def fake_run_load(base, workload, *, rate, max_concurrency, **kw):
        order.append(f"served {rate}")
        return {"summary": {"request_rate": rate, "max_concurrency": max_concurrency,
                            "output_tokens_per_s": next(served), "completed": 4,
                            "num_requests": 4, "failed": 0, "ttft": {"median_ms": 1.0},
                            "tpot": {"median_ms": 1.0}, "health": {"p99_ms": None}},
                "requests": []}

    def fake_offline(args, workload, out_dir):
        order.append("offline")
        return {"output_tokens_per_s": next(offline), "output_tokens": 1, "seconds": 1.0}

    monkeypatch.setattr(serve, "warm_up", fake_warm_up)
    monkeypatch.setattr(serve, "run_load", fake_run_load)
    monkeypatch.setattr(serve_launch, "run_offline_baseline", fake_offline)
    monkeypatch.setattr(serve, "plot", lambda report, path: None)
    monkeypatch.setattr(serve, "markdown", lambda report, notes: "")
    report = serve_launch.main(["--target", "x=http://127.0.0.1:9", "--request-rate", "inf", "2",
                         "--rounds", "3", "--offline-baseline", "--num-prompts", "4",
                         "--price-per-hour", "1", "--out", str(tmp_path)])
    assert order == ["warm-up"] + ["served inf", "served 2.0", "offline"] * 3
    ob = report["offline_baseline"]
    assert ob["rounds"] == [400.0, 250.0, 200.0] and ob["output_tokens_per_s"] == 250.0
    [row] = ob["served_vs_offline"]            # the runs at rate 2 are not saturation runs
    assert row["served_rounds"] == [100.0, 200.0, 60.0]
    assert row["ratio"] == pytest.approx(100.0 / 250.0)
    assert [r["round"] for r in report["runs"]] == [0, 0, 1, 1, 2, 2]


def test_serve_needs_a_target_and_its_driver_does_not(tmp_path, monkeypatch, capsys):
    """`jaxbatch bench serve` measures servers it is given; the lab's driver starts its own."""
    with pytest.raises(SystemExit):
        serve.main(["--out", str(tmp_path)])
    assert "--target" in capsys.readouterr().err
    offline = iter([300.0, 100.0])
    monkeypatch.setattr(serve_launch, "run_offline_baseline", lambda *a: {
        "output_tokens_per_s": next(offline), "output_tokens": 1, "seconds": 1.0})
    report = serve_launch.main(["--offline-baseline", "--rounds", "2", "--num-prompts", "2",
                                "--price-per-hour", "1", "--out", str(tmp_path)])
    assert report["runs"] == [] and report["offline_baseline"]["rounds"] == [300.0, 100.0]
    assert "Offline jaxbatch LLM.generate" in (tmp_path / "bench_serve.md").read_text()


@pytest.mark.parametrize("tail, error", [(b"", "stream ended without data: [DONE]"),
                                         (b'data: {"error": {"message": "boom"}}\n\n',
                                          'stream error: {"message": "boom"}')])
def test_a_stream_that_breaks_off_fails_its_request(tail, error):
    """Every token and the usage arrived, but no `data: [DONE]`, or an error event in its
    place: the request failed, and says why."""
    import httpx

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        frames = b"".join(data for _, data in _frames(json.loads(request.content), chat=True))
        return httpx.Response(200, content=frames.replace(b"data: [DONE]\n\n", tail))
    out = asyncio.run(bench_serve.run_load("http://fake", _workload(2), health_interval=None,
                                           clock=FakeClock(),
                                           transport=httpx.MockTransport(handler)))
    s = out["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (0, 2, [error])


@pytest.mark.parametrize("flags", [["--goodput", "ttft"], ["--goodput", "p50:100"],
                                   ["--extra-body", "{"]])
def test_a_bad_goodput_or_extra_body_is_refused_before_anything_is_sent(flags, tmp_path, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--target", "x=http://127.0.0.1:9", "--out", str(tmp_path), *flags])
    assert "error: argument" in capsys.readouterr().err and not list(tmp_path.iterdir())
