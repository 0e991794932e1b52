"""Request-supplied chat templates (only with --trust-request-chat-template), rendered where a
hostile one can be stopped: a child process (_template_child.py) with a time limit, an output
size limit and a memory cap. A render past its time limit kills the child; the next render
starts a fresh one (~0.1 s: the child imports only Jinja). A thread cannot be stopped, so one
`{% for i in range(10**5) %}{% for j in range(10**5) %}` rendered in-process held its worker
(and the process, at exit) for good.

Called from a tokenizer-pool worker (blocking). One child renders one template at a time; a
caller waits for it at most `timeout` seconds, so queued renders are bounded too.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_template_child.py")


class TemplateError(Exception):
    """The template failed, ran out of time, memory or output room (a 400 for the caller)."""


class TemplateRenderer:
    def __init__(self, timeout: float = 5.0, max_memory_bytes: int = 512 << 20):
        self.timeout, self.max_memory_bytes = timeout, max_memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.num_killed = 0

    def render(self, template: str, context: dict, max_chars: int) -> str:
        deadline = time.monotonic() + self.timeout
        if not self._lock.acquire(timeout=self.timeout):
            raise TemplateError(f"the chat template renderer stayed busy for {self.timeout:g} s")
        try:
            proc = self._child()
            data = json.dumps({"template": template, "context": context,
                               "max_chars": max_chars}).encode()
            try:
                proc.stdin.write(struct.pack(">I", len(data)) + data)
                proc.stdin.flush()
                reply = self._reply(proc, deadline)
            except TimeoutError:
                self._kill()
                raise TemplateError(f"rendering the chat template took longer than "
                                    f"{self.timeout:g} s") from None
            except (OSError, EOFError, ValueError) as e:
                self._kill()     # the child died (e.g. killed for memory): a fresh one next time
                raise TemplateError(f"the chat template renderer failed: {e}") from None
        finally:
            self._lock.release()
        if "error" in reply:
            raise TemplateError(reply["error"])
        return reply["text"]

    def _reply(self, proc, deadline) -> dict:
        (n,) = struct.unpack(">I", self._read(proc, 4, deadline))
        return json.loads(self._read(proc, n, deadline))

    @staticmethod
    def _read(proc, n: int, deadline: float) -> bytes:
        fd, buf = proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("the renderer exited")
            buf += chunk
        return buf

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", _CHILD, str(self.max_memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                bufsize=0)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            self.num_killed += 1

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None
