"""AsyncLLM: an asyncio front end over one LLMEngine, usable with or without HTTP.

    llm = AsyncLLM(lambda: LLMEngine(...)); llm.start()        # inside a running event loop
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)                              # cumulative, as engine.step() gives it

Threads. LLMEngine is not thread-safe, so exactly one thread (the engine thread) touches it: it
builds the engine (weights load, warm-up), then loops

    wait until there is a command or unfinished work  (a Condition: an idle server burns no CPU)
    drain the command list: add_request / abort_request, in arrival order
    engine.step()                                      (one schedule -> execute -> update)
    publish: ONE loop.call_soon_threadsafe per step carries every RequestOutput to the loop

The event loop never calls the engine: callers append commands under a lock and notify.

Mailboxes. Each request has a mailbox on the event loop holding only the newest output. The
engine's outputs are cumulative (whole text and token ids so far), so a reader that falls
behind loses nothing by skipping intermediate ones: its next delta simply spans several steps
(a slow client's deltas merge instead of piling up in memory), and the final output
(`finished=True`) is always the newest, never dropped.

Failures. A request the engine rejects (add_request raises) is answered to its caller with that
exception (ValueError for invalid input) and the thread carries on. Only an exception out of
`step()` (engine state unknown) or from building the engine stops the thread; then every
pending caller gets EngineDeadError and `state` is "dead" (the server's /health turns 503).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
import time
import traceback
from typing import AsyncIterator, Callable

from jaxbatch.engine.commands import AbortRequest, AddRequest, ResetPrefixCache
from jaxbatch.outputs import RequestOutput
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.entrypoints.admission import EngineDeadError, EngineUnavailableError, Ticket

STARTING, READY, DRAINING, DEAD, STOPPED = "starting", "ready", "draining", "dead", "stopped"


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(result) if error is None else future.set_exception(error)


class _Mailbox:
    """Lives on the event loop; written only by `AsyncLLM._dispatch` (on the loop)."""
    __slots__ = ("latest", "error", "event", "accepted")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.accepted = loop.create_future()   # result None, or the add_request exception

    def put(self, out: RequestOutput) -> None:
        self.latest = out                      # cumulative: the newest replaces the older
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc)
        self.error = exc
        self.event.set()


class RequestStream:
    """Async iterator over one request's cumulative outputs; ends after `finished=True`."""

    def __init__(self, llm: "AsyncLLM", request_id: str, mailbox: _Mailbox):
        self.llm, self.request_id, self._mailbox = llm, request_id, mailbox
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        box = self._mailbox
        await box.event.wait()
        out, box.latest = box.latest, None
        if box.error is None:                  # after a failure, every later call raises
            box.event.clear()
        if out is None:                        # woken by fail() with nothing newer to give
            self.finished = True
            raise box.error or EngineDeadError("engine stopped")
        self.finished = out.finished
        return out

    def abort(self) -> None:
        if not self.finished:
            self.llm.abort(self.request_id)


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """`fn(engine)` on the engine thread between steps; its result or error settles `future`
    (on the event loop)."""
    fn: Callable
    future: asyncio.Future


class AsyncLLM:
    def __init__(self, engine_factory: Callable[[], object], *, max_queued_requests: int | None = None,
                 metrics=None, on_dead: Callable[[BaseException], None] | None = None):
        """`engine_factory` builds the LLMEngine; it runs on the engine thread, so `start()`
        returns at once (the server binds its port before the weights load). `metrics`: a
        ServerMetrics fed after every step. `on_dead(exc)`: called on the loop if the engine
        thread dies (the CLI exits when the model fails to load)."""
        self._factory = engine_factory
        self._on_dead = on_dead
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.state = STARTING
        self.engine = None                     # set by the engine thread once built
        self.tokenizer = None
        self.error: BaseException | None = None
        self.stats: dict = {}                  # engine.stats() after the latest iteration
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._commands: list = []              # guarded by _cv; engine/commands.py records
        self._stop = False                     # guarded by _cv
        self._mailboxes: dict[str, _Mailbox] = {}   # loop only
        self._admitted = 0                     # loop only
        self._closing = False                  # loop only: no new add_request at all
        self._idle = asyncio.Event()
        self._hurry = asyncio.Event()          # set by a second signal: abort the rest now
        self._ids = itertools.count()
        # Chat templating and tokenization: off the loop, one worker (HF fast tokenizers raise
        # "Already borrowed" when one instance is used from several threads at once).
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxbatch-tok")

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxbatch-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.state == READY

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state == STARTING:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine not ready")
            await asyncio.sleep(0.05)
        if self.state == DEAD:
            raise EngineDeadError(f"engine failed: {self.error!r}")

    async def drain(self, timeout: float) -> None:
        """Stop admitting; let admitted requests finish for up to `timeout` s; abort the rest."""
        with self._cv:
            if self.state in (READY, STARTING):
                self.state = DRAINING
        idle = asyncio.ensure_future(self._wait_idle())
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait({idle, hurry}, timeout=max(0.0, timeout),
                           return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not idle.done():
            idle.cancel()
            # Aborted, not dropped: each request's final output still reaches its handler, so
            # every stream ends with its last chunk and [DONE], every other request with a 503.
            self._closing = True               # admitted requests still templating: refused
            for rid in list(self._mailboxes):
                self.abort(rid)
            try:   # the aborted requests' final outputs reach their handlers within a step
                await asyncio.wait_for(self._wait_idle(), timeout=10.0)
            except asyncio.TimeoutError:
                pass

    def hurry(self) -> None:
        """Cut a drain short (a second SIGTERM / SIGINT): abort what is still running now."""
        self._hurry.set()

    async def _wait_idle(self) -> None:
        while self._admitted or self._mailboxes:
            self._idle.clear()
            await self._idle.wait()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the engine thread."""
        if self.state != DEAD:
            self.state = STOPPED
        self._closing = True
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission (HTTP layer) -----------------------------------------------------------
    def admit(self, cost: int = 1) -> Ticket:
        """Counts a request at the moment it arrives, before any templating or await, so a
        burst cannot slip past the cap while earlier requests are still being rendered. `cost`:
        the sequences it will run (prompts x n), each counted against the cap."""
        self.check_admitting()
        cap = self.max_queued_requests
        if cap is not None and self._admitted + cost > cap:
            raise EngineUnavailableError(
                f"too many requests: {self._admitted} sequences waiting or running, this one "
                f"adds {cost} (cap {cap})", 1)
        self._admitted += cost
        return Ticket(self, cost)

    def check_admitting(self) -> None:
        """Raises what admit() raises when the state (not the cap) says no: lets the HTTP layer
        answer 503 before checks that need the engine (its max_model_len)."""
        if self.state == DEAD:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if self.state == STARTING:
            raise EngineUnavailableError("the server is starting: the model is loading", 5)
        if self.state != READY:
            raise EngineUnavailableError("the server is shutting down", 5)

    def _release(self, cost: int = 1) -> None:
        self._admitted -= cost
        if not self._admitted:
            self._idle.set()

    async def run_in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          lora_request=None) -> RequestStream:
        """Hands the request to the engine thread and waits for its verdict: returns the
        stream, or raises what `LLMEngine.add_request` raised (ValueError: invalid input)."""
        if self.state == DEAD:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if self.state in (STARTING, STOPPED) or self._closing:
            raise EngineUnavailableError(f"the engine is {self.state}", 5)
        if request_id in self._mailboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        box = _Mailbox(self._loop)
        self._mailboxes[request_id] = box
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._submit(AddRequest(request_id, prompt, params, priority, arrival, lora_request))
        try:
            await box.accepted
        except BaseException:
            # Rejected (nothing to undo), or our caller was cancelled meanwhile (abort it).
            if self._mailboxes.get(request_id) is box:
                del self._mailboxes[request_id]
                self._maybe_idle()
            self._submit(AbortRequest(request_id))
            raise
        return RequestStream(self, request_id, box)

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative outputs, the last with `finished=True`. Leaving the
        loop early (break, cancellation, a disconnected client) aborts the request."""
        params = params or SamplingParams()
        if self.state == STARTING:
            raise EngineUnavailableError("the engine is starting", 5)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as token ids")
            prompt = await self.run_in_pool(lambda: list(self.tokenizer(prompt)["input_ids"]))
        request_id = request_id or f"gen-{next(self._ids)}"
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Non-blocking; the final output (finish_reason "abort") arrives after the next step."""
        self._submit(AbortRequest(request_id))

    def reset_prefix_cache(self) -> None:
        """Non-blocking; done by the engine thread before its next step."""
        self._submit(ResetPrefixCache())

    async def call(self, fn):
        """`fn(engine)` run on the engine thread between steps (LoRA loads): its result, or
        what it raised."""
        future = self._loop.create_future()
        self._submit(EngineCall(fn, future))
        return await future

    def _submit(self, command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    # ---- loop side of publishing ---------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass   # the loop has closed (process exiting): nobody is left to tell

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            box = self._mailboxes.get(out.request_id)
            if box is None:
                continue
            box.put(out)
            if out.finished:
                del self._mailboxes[out.request_id]
        self._maybe_idle()

    def _accept(self, request_id: str, error: BaseException | None) -> None:
        box = self._mailboxes.get(request_id)
        if box is None or box.accepted.done():
            return
        if error is None:
            box.accepted.set_result(None)
        else:
            del self._mailboxes[request_id]
            box.accepted.set_exception(error)
            self._maybe_idle()

    def _fail_all(self, exc: BaseException) -> None:
        boxes, self._mailboxes = list(self._mailboxes.values()), {}
        for box in boxes:
            box.fail(exc)
        self._maybe_idle()
        if self._on_dead is not None:
            self._on_dead(self.error)

    def _maybe_idle(self) -> None:
        if not self._admitted and not self._mailboxes:
            self._idle.set()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
            self.engine, self.tokenizer = engine, engine.tokenizer
            self.stats = engine.stats()
            if self.metrics is not None:     # the pool's gauges from the start, as vLLM's
                self.metrics.record([], self.stats, time.monotonic())
            with self._cv:       # drain() may be setting DRAINING on the event loop
                if self.state == STARTING:
                    self.state = READY
            self._serve(engine)
        except BaseException as e:   # noqa: BLE001 - whatever killed it, report it
            self.error = e
            self.state = DEAD
            traceback.print_exc()
            self._post(self._fail_all, EngineDeadError(f"the engine thread died: {e!r}"))

    def _serve(self, engine) -> None:
        live: set[str] = set()          # requests added and not yet finished
        while True:
            with self._cv:
                while not self._commands and not live and not self._stop:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            for command in commands:
                if isinstance(command, AddRequest):
                    try:
                        command.apply(engine)
                    except Exception as e:   # noqa: BLE001 - a bad request must not kill the thread
                        self._post(self._accept, command.request_id, e)
                        continue
                    live.add(command.request_id)
                    self._post(self._accept, command.request_id, None)
                elif isinstance(command, ResetPrefixCache):
                    command.apply(engine)
                elif isinstance(command, EngineCall):
                    try:
                        self._post(_settle, command.future, command.fn(engine), None)
                    except Exception as e:   # noqa: BLE001 - answered to the caller
                        self._post(_settle, command.future, None, e)
                elif command.request_id in live:
                    command.apply(engine)
            if stop:
                engine.abort_request(list(live))
            outputs = engine.step()      # also returns the final outputs of aborted requests
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            self.stats = engine.stats()
            if self.metrics is not None:
                self.metrics.record(outputs, self.stats, time.monotonic())
            if outputs:
                self._post(self._dispatch, outputs)
            if stop:
                return
