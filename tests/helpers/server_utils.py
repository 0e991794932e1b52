"""Helpers for the server tests: a `jaxbatch serve` subprocess, raw HTTP, /metrics parsing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT = 600   # first start on a busy 2-core machine: load + compile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m jaxbatch serve` on 127.0.0.1; output goes to a file (a full pipe would block
    the server), shown when something fails."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jaxbatch-serve-", suffix=".log",
                                               delete=False)
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxbatch", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "warning", *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.health_seen: list[int] = []   # /health statuses while starting, in order

    def tail(self, n: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT, on_first_answer=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                status = httpx.get(self.base + "/health", timeout=5).status_code
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if not self.health_seen and on_first_answer is not None:
                on_first_answer(self)
            self.health_seen.append(status)
            if status == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def metric(base: str, name: str, **labels) -> float:
    """One sample's value from /metrics (parsed by prometheus_client's own parser)."""
    return metrics(base).get((name, tuple(sorted(labels.items()))), 0.0)


def metrics(base: str) -> dict:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Polls until `predicate()` is truthy; returns its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def idle(base: str) -> bool:
    m = metrics(base)
    return (m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0
            and m[("vllm:kv_cache_usage_perc", ())] == 0)


def raw_post(port: int, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """Sends a request on a plain socket, so a test can drop the connection whenever it likes."""
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(data)}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    buf = b""
    while marker not in buf and len(buf) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("\n\n"), repr(body[-50:])
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, repr(block[:200])
        events.append(block[len("data: "):])
    return events
