"""Hostile clients against a `jaxbatch serve` (issue 26): a table of case -> status, time to
answer, server still serving, server RSS before/after, and /health p99 under a slowloris and
under saturation.

    python -m benchmarks.hostile --spawn [--tiny] [--cases zoo,flood,...]
    python -m benchmarks.hostile --base http://127.0.0.1:8000 --pid PID

Cases: idle (/health p99 alone, the baseline), zoo (bad inputs, one row each), flood (concurrent requests listing many prompts x n),
slowloris (sockets dripping header bytes), saturation (streams holding every slot),
disconnect (a storm of requests dropped at once; time until the engine is idle), signals
(SIGINT under load, then SIGTERM: every stream must end with [DONE]; exit code). `signals`
ends the server, so it runs last. "Still serving": a normal greedy request right after the
case returns 200 with the reference text. Nothing here imports JAX.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

ZOO = [
    ("chat_template bomb", "/v1/chat/completions", {"chat_template": "{% for i in range(100000) %}"
                                                    "{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
    ("string bomb template", "/v1/chat/completions", {"chat_template": '{{ "ab " * 7000000 }}'}),
    ("response_format yaml", "/v1/chat/completions", {"response_format": {"type": "yaml"}}),
    ("invalid JSON schema", "/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    ("tool_choice names no tool", "/v1/chat/completions", {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    ("unknown field", "/v1/completions", {"frobnicate": 1}),
    ("max_tokens '5'", "/v1/completions", {"max_tokens": "5"}),
    ("stream 'yes'", "/v1/completions", {"stream": "yes"}),
    ("role wizard", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("seed 2**70", "/v1/completions", {"seed": 2 ** 70}),
    ("10k stop strings", "/v1/completions", {"stop": [f"s{i}" for i in range(10000)]}),
    ("prompt 1M chars", "/v1/completions", {"prompt": "z" * 1_000_000}),
    ("body 20 MB", "/v1/completions", {"prompt": "z" * 20_000_000}),
    ("temperature -1", "/v1/completions", {"temperature": -1}),
]


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


class Bench:
    def __init__(self, base: str, pid: int | None, tiny: bool, slowloris=None):
        self.base, self.pid, self.tiny = base, pid, tiny
        self.slowloris_size = slowloris
        self.port = int(base.rsplit(":", 1)[1])
        self.rows: list[dict] = []
        self.reference = self._normal()[1]

    def _normal(self):
        try:
            r = httpx.post(self.base + "/v1/completions", timeout=120, json={
                "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None
        except httpx.HTTPError:
            return None, None

    def serving(self) -> bool:
        code, text = self._normal()
        return code == 200 and text == self.reference

    def row(self, case, status, seconds, before, **extra):
        after = rss_mb(self.pid)
        r = {"case": case, "status": status, "seconds": round(seconds, 3),
             "still_serving": self.serving() if extra.pop("check", True) else None,
             "rss_before_mb": before and round(before), "rss_after_mb": after and round(after),
             **extra}
        self.rows.append(r)
        print(json.dumps(r), flush=True)

    def health_probe(self) -> "HealthProbe":
        return HealthProbe(self.base)

    # ---- cases ----------------------------------------------------------------------------
    def idle(self):
        """/health p99 with nothing else going on: the baseline for the two below."""
        before, t0 = rss_mb(self.pid), time.monotonic()
        probe = self.health_probe()
        time.sleep(3.0 if self.tiny else 10.0)
        lat = probe.stop()
        self.row("idle: /health alone", "200", time.monotonic() - t0, before,
                 health_p99_ms=_p99_ms(lat))

    def zoo(self):
        for name, path, extra in ZOO:
            body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                    else {"prompt": "hi"})
            body["max_tokens"] = 2
            body.update(extra)
            before, t0 = rss_mb(self.pid), time.monotonic()
            try:
                status = httpx.post(self.base + path, json=body, timeout=120).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.row(f"zoo: {name}", status, time.monotonic() - t0, before)

    def flood(self):
        k, prompts, n = (4, 16, 2) if self.tiny else (32, 64, 2)
        before, t0 = rss_mb(self.pid), time.monotonic()

        def one():
            return httpx.post(self.base + "/v1/completions", timeout=300, json={
                "prompt": ["Tell me a story."] * prompts, "n": n, "max_tokens": 8}).status_code
        self.row(f"flood: {k} x {prompts} prompts x n={n}", _statuses(one, k),
                 time.monotonic() - t0, before)

    def slowloris(self):
        count, seconds = self.slowloris_size or ((6, 4.0) if self.tiny else (100, 30.0))
        before, t0 = rss_mb(self.pid), time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", self.port), timeout=10)
                 for _ in range(count)]
        probe = self.health_probe()
        closed = 0
        while time.monotonic() - t0 < seconds:
            for s in list(socks):
                try:
                    s.sendall(b"P")
                except OSError:
                    socks.remove(s)
                    s.close()
                    closed += 1
            time.sleep(0.5)
        lat = probe.stop()
        for s in socks:
            s.close()
        self.row(f"slowloris: {count} sockets, {seconds:g} s", f"closed {closed}/{count}",
                 time.monotonic() - t0, before, health_p99_ms=_p99_ms(lat))

    def saturation(self):
        count = 8 if self.tiny else 64
        before, t0 = rss_mb(self.pid), time.monotonic()
        probe = self.health_probe()

        def one():
            with httpx.stream("POST", self.base + "/v1/completions", timeout=600, json={
                    "prompt": "Tell me a story.", "max_tokens": 32 if self.tiny else 128,
                    "ignore_eos": True, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
                return r.status_code
        status = _statuses(one, count)
        self.row(f"saturation: {count} streams", status, time.monotonic() - t0, before,
                 health_p99_ms=_p99_ms(probe.stop()))

    def disconnect(self):
        count = 16 if self.tiny else 180
        before = rss_mb(self.pid)
        body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
                           "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        socks = []
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            s.sendall(head + body)
            socks.append(s)
        time.sleep(1.0)
        t0 = time.monotonic()
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()            # RST, as a client that vanishes
        idle = _wait_idle(self.base, 60)
        self.row(f"disconnect: {count} reset at once", "idle" if idle else "NOT idle",
                 time.monotonic() - t0, before)

    def signals(self):
        if self.pid is None:
            return
        count = 4 if self.tiny else 20
        before, results = rss_mb(self.pid), []

        def one():
            try:
                with httpx.stream("POST", self.base + "/v1/completions", timeout=120, json={
                        "prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}) as r:
                    last = None
                    for line in r.iter_lines():
                        last = line or last
                    results.append(last == "data: [DONE]")
            except httpx.HTTPError:
                results.append(False)
        threads = [threading.Thread(target=one) for _ in range(count)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        t0 = time.monotonic()
        os.kill(self.pid, signal.SIGINT)
        time.sleep(1.0)
        os.kill(self.pid, signal.SIGTERM)
        for t in threads:
            t.join()
        code = _exit_code(self.pid, 60)
        self.row(f"signals: SIGINT+SIGTERM, {count} streams",
                 f"[DONE] {sum(results)}/{count}, exit {code}", time.monotonic() - t0, before,
                 check=False)


class HealthProbe:
    """GET /health every 20 ms from a process of its own (forked: nothing here imports JAX), so
    the bench's own client threads do not add their GIL waits to the latencies it reports."""

    def __init__(self, base: str):
        ctx = multiprocessing.get_context("fork")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_probe_loop, args=(base, self._stop, self._out),
                                 daemon=True)
        self._proc.start()

    def stop(self) -> list[float]:
        self._stop.set()
        lat = self._out.get(timeout=60)
        self._proc.join(10)
        return lat


def _probe_loop(base, stop, out) -> None:
    lat = []
    with httpx.Client(base_url=base, timeout=10) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(time.monotonic() - t0 if ok else float("inf"))
            time.sleep(0.02)
    out.put(lat)


def _statuses(request, count: int) -> str:
    """`request()` (a status code) on `count` threads at once: "200x30,503x2" (an HTTP error
    counts by its type's name)."""
    codes = []

    def one():
        try:
            codes.append(request())
        except httpx.HTTPError as e:
            codes.append(type(e).__name__)
    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ",".join(f"{c}x{codes.count(c)}" for c in sorted(set(codes), key=str))


def _p99_ms(lat: list[float]) -> float | None:
    if not lat:
        return None
    lat = sorted(lat)
    return round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1)


def _wait_idle(base: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(base + "/metrics", timeout=10).text
        vals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))}
        if vals and not any(vals.values()):
            return True
        time.sleep(0.05)
    return False


_SPAWNED: dict[int, subprocess.Popen] = {}


def _exit_code(pid: int, timeout: float):
    proc = _SPAWNED.get(pid)
    if proc is not None:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return "running"
    deadline = time.monotonic() + timeout      # not our child: its code is its parent's
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    return "running" if _alive(pid) else "exited"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False


def spawn(extra: list[str]) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxbatch", "serve", "--port", str(port),
                             "--log-level", "warning", *extra])
    _SPAWNED[proc.pid] = proc
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not get ready")


CASES = ("idle", "zoo", "flood", "slowloris", "saturation", "disconnect", "signals")


def run(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostile")
    ap.add_argument("--base", help="a running server (else --spawn)")
    ap.add_argument("--pid", type=int, help="its process id (RSS, signals)")
    ap.add_argument("--spawn", action="store_true", help="start `jaxbatch serve` for the run")
    ap.add_argument("--serve-args", default="--max-num-seqs 8 --max-model-len 512 "
                                            "--max-num-queued-reqs 64",
                    help="flags for the spawned server")
    ap.add_argument("--tiny", action="store_true", help="a smoke-sized run")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--slowloris", nargs=2, type=float, metavar=("SOCKETS", "SECONDS"),
                    help="the slowloris case's size (default 6 4 with --tiny, else 100 30)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    proc = None
    if args.spawn:
        base, proc = spawn(args.serve_args.split())
        pid = proc.pid
    elif args.base:
        base, pid = args.base.rstrip("/"), args.pid
    else:
        ap.error("give --base URL or --spawn")
    try:
        size = (int(args.slowloris[0]), args.slowloris[1]) if args.slowloris else None
        bench = Bench(base, pid, args.tiny, size)
        for case in args.cases.split(","):
            if case not in CASES:
                ap.error(f"unknown case {case!r} (choose from {', '.join(CASES)})")
            getattr(bench, case)()
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    _print_table(bench.rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench.rows, f, indent=1)
    return bench.rows


def _print_table(rows) -> None:
    print(f"\n{'case':44} {'status':26} {'time s':>8} {'serving':>8} {'RSS MB':>12} "
          f"{'/health p99 ms':>14}")
    for r in rows:
        rss = f"{r['rss_before_mb']}->{r['rss_after_mb']}"
        p99 = r.get("health_p99_ms")
        print(f"{r['case'][:44]:44} {str(r['status'])[:26]:26} {r['seconds']:8.2f} "
              f"{str(r['still_serving']):>8} {rss:>12} {'' if p99 is None else p99:>14}")


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
