"""Load generator for any OpenAI-compatible server (jaxbatch, vLLM, llama.cpp, ...): streaming
chat or completions requests with Poisson arrivals, reporting what `vllm bench serve` reports,
plus /health latency measured while the server is under that load.

    # servers already running: one line per target in the table and the plot
    python scripts/bench_serve.py --target continuous=http://127.0.0.1:8000 \\
        --target static=http://127.0.0.1:8001 --target vllm=http://127.0.0.1:8100 \\
        --request-rate 1 2 4 inf --goodput ttft:2000 tpot:500
    # or let it start `python -m jaxbatch serve` itself, one server at a time
    python scripts/bench_serve.py --launch jaxbatch-continuous jaxbatch-static --request-rate 1 inf
    # a vLLM peer (bash scripts/setup_vllm_cpu.sh; scripts/export_safetensors.py --out DIR)
    python scripts/bench_serve.py --launch vllm --vllm-model hf_export/SmolLM2-135M-Instruct
    # served throughput at saturation vs offline LLM.generate on the same workload
    python scripts/bench_serve.py --launch jaxbatch-continuous --request-rate inf --offline-baseline
    # a bounded-concurrency sweep instead of Poisson arrivals
    python scripts/bench_serve.py --target x=http://127.0.0.1:8000 --request-rate inf \\
        --max-concurrency 1 4 16

Workload (fixed seed, the same for every target and every rate): --num-prompts requests, each
a prompt drawn uniformly from scripts/bench_prompts.json (chat: one user message, the server
applies its chat template; completions: the raw text) and a max_tokens drawn as
round(lognormal(median, sigma)) clipped to [min, max]; greedy (temperature 0) with
ignore_eos, so every request generates exactly max_tokens tokens. Arrival gaps are one draw of
standard exponentials scaled by 1 / rate (rate inf: all at t=0); --max-concurrency caps the
requests in flight (a request waiting for a slot is not timed, as in vLLM).

Metrics, as `vllm bench serve` computes them: TTFT = first chunk carrying text - request sent;
E2EL = last byte - request sent; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = every gap
between chunks carrying text, pooled; token counts from the server's `usage`
(`stream_options.include_usage`), never from chunk counts (a chunk may carry several tokens);
throughputs over the wall time from the first request sent to the last finished; goodput =
requests meeting every SLO given with --goodput, per second. A side task GETs /health every
--health-interval seconds during the timed run (its p99 is a serving target: the event loop
must stay responsive under load). Output: <out>/bench_serve.json (every request's timings),
bench_serve.md (the table, also printed) and bench_serve.png (TTFT and TPOT against rate).

Warm-up (untimed, per target, before its runs): by default the whole workload at once, so a
server that compiles shapes lazily does it there. Servers with prefix caching (vLLM by default)
then hold every prompt for the timed runs; pass their flag to turn it off to measure cold
prompts (vLLM: --vllm-args '--max-model-len 2048 --no-enable-prefix-caching').

--offline-baseline runs jaxbatch `LLM.generate` in a subprocess after the servers, with the
engine settings a launched `jaxbatch serve` gets (--max-num-seqs, --serve-args as keyword
arguments), the same prompts with the chat template applied, the same max_tokens, greedy,
ignore_eos; one untimed pass, then --offline-passes timed ones. Every run at rate inf is then
reported as served / offline output tokens per second (the serving target: >= 0.9).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import numpy as np

from bench import _fmt, load_prompts, lognormal_lengths, stats_ms, DEFAULT_PROMPTS  # noqa: E402

LAUNCHABLE = ("jaxbatch-continuous", "jaxbatch-static", "vllm")
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


# ==== workload ====================================================================================

@dataclasses.dataclass
class ServeRequest:
    idx: int
    prompt_id: str
    kind: str
    text: str
    max_tokens: int
    gap: float          # standard exponential; the arrival gap is gap / rate


def make_workload(num_prompts: int, lengths=(32, 1.0, 8, 256), seed: int = 0,
                  prompts_path=DEFAULT_PROMPTS) -> list[ServeRequest]:
    """The same requests whatever the rate: prompts uniform over the bundled set, output lengths
    round(median * exp(sigma * N(0, 1))) clipped to [lo, hi], one draw of arrival gaps."""
    entries = load_prompts(prompts_path)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(entries), num_prompts)
    outs = lognormal_lengths(rng, num_prompts, *lengths)
    gaps = rng.standard_exponential(num_prompts)
    gaps[0] = 0.0       # the first request goes at t=0, as in vllm bench serve
    return [ServeRequest(i, entries[p]["id"], entries[p]["kind"], entries[p]["text"], outs[i],
                         float(gaps[i])) for i, p in enumerate(picks)]


def arrival_offsets(workload, rate: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * len(workload)
    return list(np.cumsum([r.gap / rate for r in workload]))


# ==== one HTTP request ============================================================================

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
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self):
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def request_body(api: str, model: str, req: ServeRequest, max_tokens_field: str | None,
                 extra: dict) -> dict:
    body = {"model": model, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.text}]
        body[max_tokens_field or "max_completion_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.text
        body[max_tokens_field or "max_tokens"] = req.max_tokens
    body.update(extra)
    return body


def _chunk_text(api: str, choice: dict) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client, base: str, api: str, body: dict, result: RequestResult,
                       t0: float) -> RequestResult:
    """One streaming request; fills `result` with times relative to t0 (perf_counter)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    chunks_seen = 0
    result.sent = time.perf_counter() - t0
    try:
        async with client.stream("POST", base + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                result.end = time.perf_counter() - t0
                return result
            done = False
            async for line in resp.aiter_lines():
                now = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue        # blank separators, ": keep-alive" comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    result.error = f"stream error: {json.dumps(msg['error'])[:300]}"
                    break
                for choice in msg.get("choices") or []:
                    text = _chunk_text(api, choice)
                    if text:
                        result.chunk_times.append(now)
                        result.text_chars += len(text)
                        chunks_seen += 1
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                usage = msg.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens")
            result.end = time.perf_counter() - t0
            if result.error is None and not done:
                result.error = "stream ended without data: [DONE]"
    except Exception as e:      # connection refused/reset, timeouts, bad JSON
        result.end = time.perf_counter() - t0
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    if result.error is None:
        if result.output_tokens is None:
            # No usage chunk (server ignores include_usage): count chunks, and say so.
            result.usage_missing = True
            result.output_tokens = chunks_seen
        result.ok = result.output_tokens > 0 and bool(result.chunk_times)
        if not result.ok:
            result.error = "no output tokens"
    return result


# ==== /health poller ==============================================================================

async def poll_health(client, base: str, interval: float, stop: asyncio.Event, t0: float,
                      samples: list) -> None:
    """GET /health every `interval` s until `stop`; (offset s, latency s, status or error)."""
    while not stop.is_set():
        start = time.perf_counter()
        try:
            resp = await client.get(base + "/health", timeout=10.0)
            status = resp.status_code
        except Exception as e:
            status = type(e).__name__
        end = time.perf_counter()
        samples.append((start - t0, end - start, status))
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, interval - (end - start)))
        except asyncio.TimeoutError:
            pass


def health_summary(samples) -> dict:
    lat = [s[1] for s in samples]
    bad = [s for s in samples if s[2] != 200]
    return {"samples": len(samples), "non_200": len(bad),
            "statuses_non_200": sorted({str(s[2]) for s in bad}),
            "p50_ms": 1e3 * float(np.percentile(lat, 50)) if lat else None,
            "p99_ms": 1e3 * float(np.percentile(lat, 99)) if lat else None,
            "max_ms": 1e3 * max(lat) if lat else None}


# ==== one run: a target at one rate ===============================================================

def _client(limit: int | None = None, api_key: str | None = None):
    import httpx
    # trust_env=False: a proxy from the environment must not sit between us and 127.0.0.1.
    return httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), trust_env=False,
                             limits=httpx.Limits(max_connections=limit,
                                                 max_keepalive_connections=limit),
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


async def run_load(base: str, workload, *, rate: float = math.inf, max_concurrency=None,
                   api: str = "chat", model: str | None = None, goodput=None,
                   health_interval: float | None = 0.1, max_tokens_field=None,
                   extra_body=None, api_key=None) -> dict:
    """Sends the workload to one server at one rate; returns the summary and every request."""
    base = normalize_base(base)
    extra_body = extra_body or {}
    async with _client(None, api_key) as client, _client(4) as health_client:
        model = model or await served_model(client, base)
        offsets = arrival_offsets(workload, rate)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        samples, stop = [], asyncio.Event()
        inflight = [0, 0]      # now, peak

        async def one(req, offset):
            delay = offset - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            result = RequestResult(req.idx, req.max_tokens, scheduled=offset)
            body = request_body(api, model, req, max_tokens_field, extra_body)
            if sem is None:
                return await _counted(send_request(client, base, api, body, result, t0))
            async with sem:
                return await _counted(send_request(client, base, api, body, result, t0))

        async def _counted(coro):
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
            try:
                return await coro
            finally:
                inflight[0] -= 1

        t0 = time.perf_counter()
        poller = (asyncio.create_task(poll_health(health_client, base, health_interval, stop, t0,
                                                  samples))
                  if health_interval else None)
        results = await asyncio.gather(*(one(r, o) for r, o in zip(workload, offsets)))
        duration = time.perf_counter() - t0
        stop.set()
        if poller:
            await poller
    summary = summarize_results(results, duration, goodput)
    summary.update(model=model, api=api, request_rate=rate, max_concurrency=max_concurrency,
                   peak_concurrent_requests=inflight[1], health=health_summary(samples))
    return {"summary": summary,
            "requests": [{**dataclasses.asdict(r), "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
                         for r in results],
            "health_samples": samples}


def summarize_results(results, duration: float, goodput=None) -> dict:
    """vllm bench serve's figures over the completed requests."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    end = max((r.end for r in done), default=duration)
    tpots = [r.tpot for r in done if r.tpot is not None]
    summary = {
        "num_requests": len(results), "completed": len(done), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": end,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "expected_output_tokens": sum(r.max_tokens for r in done),
        "requests_with_other_output_length": sum(r.output_tokens != r.max_tokens for r in done),
        "requests_without_usage": sum(r.usage_missing for r in done),
        "request_throughput": len(done) / end if end > 0 else None,
        "output_tokens_per_s": out_tokens / end if end > 0 else None,
        "total_tokens_per_s": (in_tokens + out_tokens) / end if end > 0 else None,
        "ttft": stats_ms([r.ttft for r in done]),
        "tpot": stats_ms(tpots),
        "itl": stats_ms([x for r in done for x in r.itls]),
        "e2el": stats_ms([r.e2el for r in done]),
        "max_send_lag_ms": 1e3 * max((r.sent - r.scheduled for r in results), default=0.0),
    }
    if goodput:
        good = [r for r in done if _meets(r, goodput)]
        summary["goodput_slo_ms"] = dict(goodput)
        summary["good_requests"] = len(good)
        summary["goodput"] = len(good) / end if end > 0 else None
    return summary


def _meets(r: RequestResult, slo: dict) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(values[k] * 1e3 <= v for k, v in slo.items())


def normalize_base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def served_model(client, base: str) -> str:
    resp = await client.get(base + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def warm_up(base, workload, api, model, how: str, num: int, max_tokens_field, extra,
                  api_key=None):
    """Untimed: `requests` sends the first `num` requests at once; `workload` the whole
    workload at once (compiles what the timed runs will need, on servers that compile lazily)."""
    if how == "none":
        return None
    reqs = workload if how == "workload" else workload[:num]
    out = await run_load(base, reqs, api=api, model=model, health_interval=None,
                         max_tokens_field=max_tokens_field, extra_body=extra, api_key=api_key)
    return out["summary"]


# ==== server launch ===============================================================================

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(kind: str, port: int, args) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if kind.startswith("jaxbatch-"):
        cmd = [args.jaxbatch_python, "-m", "jaxbatch", "serve"]
        if args.jaxbatch_model:
            cmd.append(args.jaxbatch_model)
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                str(args.max_num_seqs), "--batching", kind.split("-", 1)[1]]
        cmd += shlex.split(args.serve_args)
    elif kind == "vllm":
        if not args.vllm_model:
            raise SystemExit("--launch vllm needs --vllm-model DIR (scripts/export_safetensors.py)")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", args.vllm_model, "--served-model-name", "SmolLM2-135M-Instruct",
               "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
               str(args.max_num_seqs), "--dtype", "float32"]
        cmd += shlex.split(args.vllm_args)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        raise SystemExit(f"--launch {kind}: one of {', '.join(LAUNCHABLE)}")
    return cmd, env


class LaunchedServer:
    """A server subprocess in its own process group, log to a file; waits for /health 200."""

    def __init__(self, kind, args, out_dir: Path):
        self.port = free_port()
        self.cmd, env = launch_command(kind, self.port, args)
        self.log_path = out_dir / f"{kind}.server.log"
        self.log = open(self.log_path, "w")
        print(f"[{kind}] starting: {shlex.join(self.cmd)}  (log {self.log_path})", flush=True)
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        import httpx
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return time.perf_counter() - self.start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = 30.0):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ==== offline baseline ============================================================================

def offline_worker(spec_path: str) -> None:
    """Runs in a subprocess: jaxbatch LLM.generate on the workload, chat template applied,
    greedy, ignore_eos; an untimed pass first (compiles), then the timed pass. The prefix cache
    is reset before every pass: a pass must not find the previous pass's prompts cached."""
    spec = json.loads(Path(spec_path).read_text())
    from jaxbatch import LLM, SamplingParams
    from bench import encode_prompts
    llm = LLM(**spec["llm_kwargs"])
    tok = llm.get_tokenizer()
    prompts = encode_prompts([{"text": t} for t in spec["texts"]], tok)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in spec["max_tokens"]]
    result = {"llm_kwargs": spec["llm_kwargs"], "passes": []}
    for _ in range(1 + spec["timed_passes"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        result["passes"].append({"seconds": seconds, "output_tokens": n_out,
                                 "prompt_tokens": sum(len(p) for p in prompts),
                                 "output_tokens_per_s": n_out / seconds})
    timed = result["passes"][1:]
    best = max(timed, key=lambda p: p["output_tokens_per_s"])
    result.update(warmup_pass=result["passes"][0], output_tokens_per_s=best["output_tokens_per_s"],
                  output_tokens=best["output_tokens"], seconds=best["seconds"])
    Path(spec["out"]).write_text(json.dumps(result, indent=1))


def parse_flag_kwargs(argstr: str) -> dict:
    """'--max-model-len 1024 --enable-x' -> {'max_model_len': 1024, 'enable_x': True}."""
    out, toks = {}, shlex.split(argstr)
    i = 0
    while i < len(toks):
        key = toks[i].lstrip("-").replace("-", "_")
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            val = toks[i + 1]
            for conv in (int, float):
                try:
                    val = conv(val)
                    break
                except ValueError:
                    pass
            out[key], i = val, i + 2
        else:
            out[key], i = True, i + 1
    return out


def run_offline_baseline(args, workload, out_dir: Path) -> dict:
    # The engine settings `jaxbatch serve` would use: its defaults (warm-up on), the same slots
    # and --serve-args; server-only flags dropped.
    kwargs = {"max_num_seqs": args.max_num_seqs, "warmup": True}
    if args.jaxbatch_model:
        kwargs["model"] = args.jaxbatch_model
    kwargs.update(parse_flag_kwargs(args.serve_args))
    if kwargs.pop("no_warmup", False):
        kwargs["warmup"] = False
    for k in ("host", "port", "served_model_name", "api_key", "shutdown_timeout",
              "max_num_queued_reqs", "log_level"):
        kwargs.pop(k, None)
    spec = {"llm_kwargs": kwargs, "texts": [r.text for r in workload],
            "max_tokens": [r.max_tokens for r in workload], "timed_passes": args.offline_passes,
            "out": str(out_dir / "offline_baseline.json")}
    spec_path = out_dir / "offline_spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [args.jaxbatch_python, str(Path(__file__).resolve()), "--offline-worker", str(spec_path)]
    print(f"[offline] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out_dir / "offline_baseline.json").read_text())


# ==== report ======================================================================================

def rate_label(rate: float, conc) -> str:
    label = "inf" if math.isinf(rate) else f"{rate:g}"
    return label + (f" (c={conc})" if conc else "")


def markdown(report: dict) -> str:
    trio = lambda s: "/".join(_fmt(s[k], 0) for k in ("mean_ms", "median_ms", "p99_ms"))
    goodput = any("goodput" in r["summary"] for r in report["runs"])
    head = ("| target | rate req/s | done/failed | req/s | out tok/s | total tok/s | "
            "TTFT mean/med/p99 ms | TPOT mean/med/p99 ms | ITL mean/med/p99 ms | "
            "E2EL mean/med/p99 ms | " + ("goodput req/s | " if goodput else "") +
            "/health p50/p99/max ms |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for run in report["runs"]:
        s, h = run["summary"], run["summary"]["health"]
        health = "/".join(_fmt(h[k], 1) for k in ("p50_ms", "p99_ms", "max_ms"))
        if h["non_200"]:
            health += f" ({h['non_200']} non-200)"
        lines.append(
            f"| {run['target']} | {rate_label(s['request_rate'], s['max_concurrency'])} | "
            f"{s['completed']}/{s['failed']} | {_fmt(s['request_throughput'], 2)} | "
            f"{_fmt(s['output_tokens_per_s'])} | {_fmt(s['total_tokens_per_s'])} | "
            f"{trio(s['ttft'])} | {trio(s['tpot'])} | {trio(s['itl'])} | {trio(s['e2el'])} | "
            + (f"{_fmt(s.get('goodput'), 2)} | " if goodput else "") + f"{health} |")
    parts = ["\n".join(lines)]
    if report.get("offline_baseline"):
        ob = report["offline_baseline"]
        parts.append(f"\nOffline jaxbatch LLM.generate on the same workload: "
                     f"{ob['output_tokens_per_s']:.1f} out tok/s "
                     f"({ob['output_tokens']} tokens in {ob['seconds']:.1f} s)")
        for row in ob.get("served_vs_offline", []):
            parts.append(f"- {row['target']} served at rate {row['rate']}: "
                         f"{row['served_output_tokens_per_s']:.1f} out tok/s = "
                         f"**{row['ratio']:.2f} x** jaxbatch offline")
    for name, info in report.get("servers", {}).items():
        if info.get("error"):
            parts.append(f"\n{name}: {info['error']}")
    return "\n".join(parts)


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rates = sorted({r["summary"]["request_rate"] for r in report["runs"]})
    finite = [r for r in rates if not math.isinf(r)]
    inf_x = (max(finite) * 1.5 if finite else 1.0)
    xpos = lambda r: inf_x if math.isinf(r) else r
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = {}
    for run in report["runs"]:
        s = run["summary"]
        key = run["target"] + (f" c={s['max_concurrency']}" if s["max_concurrency"] else "")
        lines.setdefault(key, []).append(s)
    for i, (key, rows) in enumerate(sorted(lines.items())):
        rows.sort(key=lambda s: xpos(s["request_rate"]))
        xs = [xpos(s["request_rate"]) for s in rows]
        color = f"C{i}"
        for ax, metric in zip(axes, ("ttft", "tpot")):
            med = [s[metric]["median_ms"] for s in rows]
            p99 = [s[metric]["p99_ms"] for s in rows]
            ax.plot(xs, med, "o-", color=color, label=f"{key} median")
            ax.plot(xs, p99, "x--", color=color, alpha=0.6, label=f"{key} p99")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.set_xticks([xpos(r) for r in rates])
        ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{report['args']['num_prompts']} requests, {report['args']['api']} streaming")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def machine_info() -> dict:
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


# ==== main ========================================================================================

def parse_goodput(items) -> dict | None:
    if not items:
        return None
    slo = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise SystemExit(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slo[key] = float(val)
    return slo


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--target", action="append", default=[], metavar="NAME=BASE_URL",
                    help="a running server, e.g. vllm=http://127.0.0.1:8100 (repeatable)")
    ap.add_argument("--launch", nargs="+", default=[], choices=LAUNCHABLE,
                    help="start these servers here, one at a time, on free 127.0.0.1 ports")
    ap.add_argument("--request-rate", nargs="+", type=float, default=[math.inf],
                    help="Poisson arrival rates (req/s); inf sends everything at t=0")
    ap.add_argument("--max-concurrency", nargs="+", type=int, default=[None],
                    help="cap on requests in flight (one run per value)")
    ap.add_argument("--api", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="model name in requests (default: /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-median", type=float, default=32)
    ap.add_argument("--output-sigma", type=float, default=1.0)
    ap.add_argument("--output-min", type=int, default=8)
    ap.add_argument("--output-max", type=int, default=256)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:2000 tpot:500 (also e2el:MS)")
    ap.add_argument("--health-interval", type=float, default=0.1,
                    help="seconds between /health polls during a timed run (0: off)")
    ap.add_argument("--warmup", choices=("none", "requests", "workload"), default="workload",
                    help="untimed, per target, before its runs: nothing, --num-warmups "
                         "requests, or the whole workload at once (default)")
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--max-tokens-field", default=None,
                    help="request field for the output length (default: chat "
                         "max_completion_tokens, completions max_tokens)")
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="launched servers and offline")
    ap.add_argument("--serve-args", default="",
                    help="extra flags for launched jaxbatch servers (and, as LLM kwargs, for "
                         "--offline-baseline), e.g. '--max-model-len 1024'")
    ap.add_argument("--jaxbatch-python", default=sys.executable)
    ap.add_argument("--jaxbatch-model", default=None, help="MODEL for jaxbatch (default embedded)")
    ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    ap.add_argument("--vllm-model", default=None, help="HF directory for --launch vllm")
    ap.add_argument("--vllm-args", default="--max-model-len 2048",
                    help="extra flags for a launched vLLM server")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--offline-baseline", action="store_true",
                    help="also run jaxbatch LLM.generate on the same workload (a subprocess, "
                         "after the servers) and report served / offline output tok/s")
    ap.add_argument("--offline-passes", type=int, default=1,
                    help="timed offline passes after the untimed one (best is reported)")
    ap.add_argument("--out", default="bench_out/serve")
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.goodput = parse_goodput(args.goodput)
    args.extra_body = json.loads(args.extra_body)
    args.lengths = (args.output_median, args.output_sigma, args.output_min, args.output_max)
    if not (args.offline_worker or args.target or args.launch or args.offline_baseline):
        ap.error("give at least one --target NAME=URL, --launch KIND or --offline-baseline")
    targets = []
    for t in args.target:
        name, sep, url = t.partition("=")
        if not sep or not url:
            ap.error(f"--target {t!r}: use NAME=BASE_URL")
        targets.append((name, url))
    args.targets = targets
    return args


def bench_target(name, base, args, workload, report):
    """Warm-up, then every (rate, concurrency) run against one server."""
    print(f"[{name}] warm-up: {args.warmup}", flush=True)
    warm = asyncio.run(warm_up(base, workload, args.api, args.model, args.warmup,
                               args.num_warmups, args.max_tokens_field, args.extra_body,
                               args.api_key))
    report["servers"].setdefault(name, {})["warmup"] = warm
    for conc in args.max_concurrency:
        for rate in args.request_rate:
            print(f"[{name}] rate {rate_label(rate, conc)} ...", flush=True)
            out = asyncio.run(run_load(
                base, workload, rate=rate, max_concurrency=conc, api=args.api, model=args.model,
                goodput=args.goodput, health_interval=args.health_interval or None,
                max_tokens_field=args.max_tokens_field, extra_body=args.extra_body,
                api_key=args.api_key))
            s = out["summary"]
            print(f"[{name}] rate {rate_label(rate, conc)}: {s['completed']}/{s['num_requests']} "
                  f"done, {_fmt(s['output_tokens_per_s'])} out tok/s, TTFT median "
                  f"{_fmt(s['ttft']['median_ms'], 0)} ms, TPOT median "
                  f"{_fmt(s['tpot']['median_ms'], 0)} ms, /health p99 "
                  f"{_fmt(s['health']['p99_ms'])} ms", flush=True)
            if s["failed"]:
                print(f"[{name}]   errors: {s['errors']}", flush=True)
            report["runs"].append({"target": name, "base_url": base, **out})


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.offline_worker:
        offline_worker(args.offline_worker)
        return {}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.num_prompts, args.lengths, args.seed, args.prompts)
    report = {"machine": machine_info(),
              "args": {k: v for k, v in vars(args).items() if k != "targets"},
              "workload": [dataclasses.asdict(r) for r in workload],
              "servers": {}, "runs": []}
    start = time.perf_counter()
    for name, url in args.targets:
        bench_target(name, normalize_base(url), args, workload, report)
    for kind in args.launch:
        server = LaunchedServer(kind, args, out_dir)
        info = report["servers"].setdefault(kind, {"command": shlex.join(server.cmd)})
        try:
            info["startup_s"] = server.wait_ready(args.startup_timeout)
            bench_target(kind, server.base, args, workload, report)
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
            print(f"[{kind}] failed: {info['error']}", flush=True)
        finally:
            server.stop()
    if args.offline_baseline:
        ob = run_offline_baseline(args, workload, out_dir)
        ob["served_vs_offline"] = [
            {"target": r["target"], "rate": rate_label(r["summary"]["request_rate"],
                                                        r["summary"]["max_concurrency"]),
             "served_output_tokens_per_s": r["summary"]["output_tokens_per_s"],
             "ratio": r["summary"]["output_tokens_per_s"] / ob["output_tokens_per_s"]}
            for r in report["runs"] if r["summary"]["request_rate"] == math.inf]
        report["offline_baseline"] = ob
    report["bench_seconds"] = time.perf_counter() - start
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    report["plot"] = plot(report, out_dir / "bench_serve.png") if report["runs"] else None
    md = markdown(report)
    (out_dir / "bench_serve.md").write_text(md + "\n")
    (out_dir / "bench_serve.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out_dir}/bench_serve.json, bench_serve.md"
          f"{', ' + report['plot'] if report['plot'] else ''} "
          f"in {report['bench_seconds']:.0f} s\n")
    print(md)
    return report


if __name__ == "__main__":
    main()
