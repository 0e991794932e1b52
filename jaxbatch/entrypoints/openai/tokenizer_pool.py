"""Chat templating and tokenization off the event loop, on workers no single request can hold.

One worker thread was a single point of failure: a request whose work never ended (a template
that loops for hours) left every later request, even token-id completions, waiting forever,
and kept the process alive after SIGTERM. So:

- `size` worker threads, each with its OWN deep copy of the tokenizer (HF fast tokenizers
  raise "Already borrowed" when one instance is used from several threads at once);
- every job has a deadline (`timeout`, queueing included). A job that is still running at its
  deadline is abandoned: its caller gets an error, the worker is written off and a fresh one
  (with a fresh tokenizer copy) takes its place, so the pool keeps `size` usable workers;
- threads are daemons: a written-off worker still spinning never keeps the process alive;
- `stuck()` counts written-off workers still running plus live workers over their deadline;
  /health answers 503 while it is not 0, so an orchestrator restarts a process that is
  burning a core on work nobody waits for.

The work a request can put here is bounded before it gets here (body and character caps in
serving.py); request-supplied chat templates never run here at all (template_render.py).
"""
from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time


class PoolTimeout(Exception):
    """A job missed its deadline. `started`: it was running (its worker was written off), not
    still waiting for a free worker."""

    def __init__(self, message: str, started: bool):
        super().__init__(message)
        self.started = started


class _Job:
    __slots__ = ("fn", "args", "loop", "future", "abandoned", "worker")

    def __init__(self, fn, args, loop, future):
        self.fn, self.args, self.loop, self.future = fn, args, loop, future
        self.abandoned = False
        self.worker: _Worker | None = None


class _Worker:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.written_off = False
        self.busy_since: float | None = None
        self.thread: threading.Thread | None = None


def _settle(job: _Job, ok: bool, value) -> None:
    if job.future.done():
        return
    if ok:
        job.future.set_result(value)
    else:
        job.future.set_exception(value)


class TokenizerPool:
    def __init__(self, size: int = 4, timeout: float = 30.0):
        if size < 2:
            raise ValueError("the tokenizer pool needs at least 2 workers")
        self.size, self.timeout = size, timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []        # usable
        self._written_off: list[_Worker] = []
        self._tokenizer = None
        self.num_replaced = 0

    @property
    def started(self) -> bool:
        return self._tokenizer is not None

    def start(self, tokenizer) -> None:
        """`tokenizer` may be None (a model without one): jobs then get None."""
        with self._lock:
            if self._tokenizer is not None:
                return
            self._tokenizer = tokenizer if tokenizer is not None else False
            for _ in range(self.size):
                self._spawn()

    def _spawn(self) -> None:   # holds _lock
        tok = self._tokenizer
        w = _Worker(copy.deepcopy(tok) if tok is not False else None)
        w.thread = threading.Thread(target=self._loop, args=(w,), daemon=True,
                                    name=f"jaxbatch-tok-{len(self._workers) + self.num_replaced}")
        self._workers.append(w)
        w.thread.start()

    def _loop(self, w: _Worker) -> None:
        while not w.written_off:
            job = self._jobs.get()
            if job is None:          # shutdown
                return
            if job.abandoned:
                continue
            job.worker, w.busy_since = w, time.monotonic()
            try:
                ok, value = True, job.fn(w.tokenizer, *job.args)
            except BaseException as e:   # noqa: BLE001 - handed to the caller
                ok, value = False, e
            w.busy_since = None
            if not job.abandoned:
                try:
                    job.loop.call_soon_threadsafe(_settle, job, ok, value)
                except RuntimeError:
                    return               # the loop is gone: the process is exiting

    async def run(self, fn, *args, timeout: float | None = None):
        """`fn(tokenizer, *args)` on a worker; raises PoolTimeout past the deadline."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        self._jobs.put(job)
        limit = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), limit)
        except asyncio.TimeoutError:
            job.abandoned = True
            w = job.worker
            if w is not None and not job.future.done():
                self._write_off(w)
                raise PoolTimeout(f"tokenization took longer than {limit:g} s; its worker was "
                                  f"replaced", started=True) from None
            raise PoolTimeout(f"no tokenizer worker was free for {limit:g} s", started=False) \
                from None
        except asyncio.CancelledError:
            job.abandoned = True         # a disconnected client: skip it if not started yet
            raise

    def _write_off(self, w: _Worker) -> None:
        with self._lock:
            if w.written_off:
                return
            w.written_off = True
            self._workers.remove(w)
            self._written_off.append(w)
            self.num_replaced += 1
            self._spawn()

    def stuck(self) -> int:
        """Workers running a job nobody waits for any more, or running one past its deadline."""
        now = time.monotonic()
        with self._lock:
            self._written_off = [w for w in self._written_off if w.thread.is_alive()]
            late = sum(1 for w in self._workers
                       if w.busy_since is not None and now - w.busy_since > self.timeout)
            return len(self._written_off) + late

    def shutdown(self) -> None:
        for _ in range(len(self._workers)):
            self._jobs.put(None)
