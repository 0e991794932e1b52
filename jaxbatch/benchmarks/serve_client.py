"""The load generator's client side (`jaxbatch bench serve`): one streaming request, the
/health poller, one run of a workload against one server at one rate, and the figures of
`vllm bench serve` over its results. Times are read from `clock` relative to the run's start,
so a test can drive a run on a fake clock through an in-process httpx `transport`."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import time
import types

import numpy as np

from jaxbatch.benchmarks.report import stats_ms
from jaxbatch.benchmarks.workloads import ServeRequest, arrival_offsets


@dataclasses.dataclass
class RequestResult:
    idx: int
    max_tokens: int
    scheduled: float = 0.0      # arrival offset from the start of the run (s)
    sent: float = 0.0           # offsets from the start of the run (s)
    chunk_times: list[float] = dataclasses.field(default_factory=list)   # chunks with text
    end: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int | None = None    # from usage
    usage_missing: bool = False
    finish_reason: str | None = None
    text_chars: int = 0
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self):
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2el(self):
        return self.end - self.sent

    @property
    def tpot(self):
        ok = self.ttft is not None and (self.output_tokens or 0) >= 2
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if ok else None

    @property
    def itls(self):
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def request_body(api: str, model: str, req: ServeRequest, max_tokens_field: str | None,
                 extra: dict) -> dict:
    chat = api == "chat"
    field = max_tokens_field or ("max_completion_tokens" if chat else "max_tokens")
    body = {"model": model, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, field: req.max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": req.text}]
    else:
        body["prompt"] = req.text
    return {**body, **extra}


def _chunk_text(api: str, choice: dict) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        # A reasoning model's thought counts as output: `reasoning` (jaxbatch, vLLM), or
        # `reasoning_content` (older vLLM, SGLang).
        return "".join(delta.get(k) or "" for k in ("content", "reasoning", "reasoning_content"))
    return choice.get("text") or ""


async def _read_stream(resp, api: str, result: RequestResult, now) -> str | None:
    """Reads one response's server-sent events into `result`; returns why it failed, or None."""
    if resp.status_code != 200:
        text = (await resp.aread()).decode(errors="replace")
        return f"HTTP {resp.status_code}: {text[:300]}"
    async for line in resp.aiter_lines():
        arrived = now()
        if not line.startswith("data:"):
            continue        # blank separators, ": keep-alive" comments, event: lines
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        msg = json.loads(data)
        if "error" in msg:
            return f"stream error: {json.dumps(msg['error'])[:300]}"
        for choice in msg.get("choices") or []:
            if text := _chunk_text(api, choice):
                result.chunk_times.append(arrived)
                result.text_chars += len(text)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if usage := msg.get("usage"):
            result.prompt_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens")
    return "stream ended without data: [DONE]"


async def send_request(client, base: str, api: str, body: dict, result: RequestResult,
                       t0: float, clock=time.perf_counter) -> RequestResult:
    """One streaming request; fills `result` with times relative to t0 (on `clock`)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result.sent = clock() - t0
    try:
        async with client.stream("POST", base + path, json=body) as resp:
            result.error = await _read_stream(resp, api, result, lambda: clock() - t0)
            result.end = clock() - t0
    except Exception as e:      # connection refused/reset, timeouts, bad JSON
        result.error = f"{type(e).__name__}: {e}"[:300]
        result.end = clock() - t0
    if result.error is None and result.output_tokens is None:
        # No usage chunk: count the chunks with text instead, and say so.
        result.usage_missing = True
        result.output_tokens = len(result.chunk_times)
    if result.error is None and not (result.output_tokens > 0 and result.chunk_times):
        result.error = "no output tokens"
    result.ok = result.error is None
    return result


async def poll_health(client, base: str, interval: float, stop: asyncio.Event, t0: float,
                      samples: list, clock=time.perf_counter) -> None:
    """GET /health every `interval` s (None or 0: never) until `stop`; (offset s on `clock`,
    latency s, status or error), the latency on wall time: what an orchestrator's probe sees."""
    while interval and not stop.is_set():
        offset, start = clock() - t0, time.perf_counter()
        try:
            status = (await client.get(base + "/health", timeout=10.0)).status_code
        except Exception as e:
            status = type(e).__name__
        end = time.perf_counter()
        samples.append((offset, end - start, status))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, interval - (end - start)))


def health_summary(samples) -> dict:
    lat = 1e3 * np.asarray([s[1] for s in samples])
    bad = [s for s in samples if s[2] != 200]
    return {"samples": len(samples), "non_200": len(bad),
            "statuses_non_200": sorted({str(s[2]) for s in bad}),
            **{k: float(np.percentile(lat, q)) if len(lat) else None
               for k, q in (("p50_ms", 50), ("p99_ms", 99), ("max_ms", 100))}}


def _client(limit: int | None = None, api_key: str | None = None, transport=None):
    import httpx
    # trust_env=False: a proxy from the environment must not sit between us and 127.0.0.1.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    return httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), trust_env=False,
                             limits=limits, transport=transport,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


class AiohttpStreams:
    """The streaming requests' client on real sockets: aiohttp, whose C parser reads a chunk
    for a fraction of the CPU httpx's pure-Python layers take, CPU the load generator shares
    with the server it measures (vLLM's `bench serve` reads through aiohttp alike). Each request
    has its own connection (`force_close`), so its TTFT includes the TCP connect, as a fresh
    client's would. It offers what `send_request` uses of httpx's `AsyncClient.stream`."""

    def __init__(self, api_key: str | None = None):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    async def __aenter__(self):
        import aiohttp
        self.session = aiohttp.ClientSession(headers=self.headers, read_bufsize=1 << 20,
            # sock_read bounds a broken stream (aiohttp's parser passes some bad framings)
            timeout=aiohttp.ClientTimeout(total=6 * 3600.0, connect=30.0, sock_read=600.0),
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, json=None):
        async with self.session.request(method, url, json=json) as resp:
            yield types.SimpleNamespace(status_code=resp.status, aread=resp.read,
                                        aiter_lines=lambda: _lines(resp))


async def _lines(resp):
    async for line in resp.content:
        yield line.rstrip(b"\r\n").decode("utf-8", "replace")


def _stream_client(api_key: str | None, transport):
    return AiohttpStreams(api_key) if transport is None else _client(None, api_key, transport)


@contextlib.contextmanager
def _heap_frozen():
    """The process's objects out of the collector's reach for the run: in a process holding a
    large heap (a model, a test session) a full collection holds every thread long enough to
    delay the sends and stream reads, and the figures would time the collector (vLLM's engine
    core freezes its heap alike). A heap frozen already (by the process, or by a run in
    progress) stays as it is: only the run that froze it unfreezes it."""
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


async def run_load(base: str, workload, *, rate: float = math.inf, max_concurrency=None,
                   api: str = "chat", model: str | None = None, goodput=None,
                   health_interval: float | None = 0.1, max_tokens_field=None,
                   extra_body=None, api_key=None, clock=time.perf_counter, transport=None) -> dict:
    """Sends the workload to one server at one rate; returns the summary and every request.
    `clock` and `transport` are seams for tests (module doc); /health is polled on real time."""
    base, extra_body = normalize_base(base), extra_body or {}
    with _heap_frozen():
        async with _stream_client(api_key, transport) as client, \
                _client(4, api_key, transport) as control:
            model = model or await served_model(control, base)
            offsets = arrival_offsets(workload, rate)
            sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
            samples = []        # /health: (offset s, latency s, status or error)
            stop = asyncio.Event()
            in_flight = peak_in_flight = 0

            async def one(req, offset):
                nonlocal in_flight, peak_in_flight
                delay = offset - (clock() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                result = RequestResult(req.idx, req.max_tokens, scheduled=offset)
                body = request_body(api, model, req, max_tokens_field, extra_body)
                async with sem or contextlib.nullcontext():
                    in_flight += 1
                    peak_in_flight = max(peak_in_flight, in_flight)
                    try:
                        return await send_request(client, base, api, body, result, t0, clock)
                    finally:
                        in_flight -= 1

            t0 = clock()
            poller = asyncio.create_task(poll_health(control, base, health_interval, stop, t0,
                                                     samples, clock))
            results = await asyncio.gather(*(one(r, o) for r, o in zip(workload, offsets)))
            duration = clock() - t0
            stop.set()
            await poller
    summary = summarize_results(results, duration, goodput)
    summary.update(model=model, api=api, request_rate=rate, max_concurrency=max_concurrency,
                   peak_concurrent_requests=peak_in_flight, health=health_summary(samples))
    return {"summary": summary,
            "requests": [{**dataclasses.asdict(r), "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
                         for r in results],
            "health_samples": samples}


def summarize_results(results, duration: float, goodput=None) -> dict:
    """vllm bench serve's figures over the completed requests."""
    done, failed = [r for r in results if r.ok], [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    end = max((r.end for r in done), default=duration)
    per_s = lambda n: n / end if end > 0 else None      # noqa: E731
    summary = {"num_requests": len(results), "completed": len(done), "failed": len(failed),
               "errors": sorted({r.error for r in failed})[:5], "duration_s": end,
               "input_tokens": in_tokens, "output_tokens": out_tokens,
               "expected_output_tokens": sum(r.max_tokens for r in done),
               "requests_with_other_output_length": sum(r.output_tokens != r.max_tokens
                                                        for r in done),
               "requests_without_usage": sum(r.usage_missing for r in done),
               "request_throughput": per_s(len(done)), "output_tokens_per_s": per_s(out_tokens),
               "total_tokens_per_s": per_s(in_tokens + out_tokens),
               "ttft": stats_ms([r.ttft for r in done]),
               "tpot": stats_ms([r.tpot for r in done if r.tpot is not None]),
               "itl": stats_ms([x for r in done for x in r.itls]),
               "e2el": stats_ms([r.e2el for r in done]),
               "max_send_lag_ms": 1e3 * max((r.sent - r.scheduled for r in results), default=0.0)}
    if goodput:
        good = sum(_meets(r, goodput) for r in done)
        summary.update(goodput_slo_ms=dict(goodput), good_requests=good, goodput=per_s(good))
    return summary


def _meets(r: RequestResult, slo: dict) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(values[k] * 1e3 <= v for k, v in slo.items())


def normalize_base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


async def served_model(client, base: str) -> str:
    resp = await client.get(base + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def warm_up(base, workload, how: str, num: int, **request_options):
    """Untimed: `requests` sends the first `num` requests at once; `workload` the whole
    workload at once (compiles what the timed runs will need, on servers that compile lazily)."""
    if how == "none":
        return None
    reqs = workload if how == "workload" else workload[:num]
    return (await run_load(base, reqs, health_interval=None, **request_options))["summary"]
