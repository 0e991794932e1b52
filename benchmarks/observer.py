"""Step observers: what an instrument attaches to an engine to watch its steps, instead of
replacing the engine's or the runner's methods (the engine's public observation points).

Two hooks, each a list the core calls (and nothing else, so an engine without observers runs
exactly as before):
  engine.step_observers       `on_step(plan, dispatch_s, wait_s)` once per step, when the
                              step's results have been read back: `plan` is the StepPlan the
                              scheduler made (plain host data; read it, do not change it),
                              `dispatch_s` the host time to lay out and dispatch it, `wait_s`
                              the time the host waited for its results
  runner.executable_observers `on_executable(key, seconds)` after every executable the runner
                              runs; with one attached the runner waits for each executable,
                              so `seconds` is its device time (and overlap is lost: profiling)

`observe(engine, observer)` attaches one for a `with` block.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class StepObserver(Protocol):
    def on_step(self, plan, dispatch_s: float, wait_s: float) -> None: ...


@runtime_checkable
class ExecutableObserver(Protocol):
    def on_executable(self, key: tuple, seconds: float) -> None: ...


@contextlib.contextmanager
def observe(engine, observer):
    """Attaches `observer` to the engine (on_step) and/or its runner (on_executable)."""
    lists = []
    if isinstance(observer, StepObserver):
        lists.append(engine.step_observers)
    if isinstance(observer, ExecutableObserver):
        lists.append(engine.runner.executable_observers)
    if not lists:
        raise TypeError(f"{type(observer).__name__} has neither on_step nor on_executable")
    for observers in lists:
        observers.append(observer)
    try:
        yield observer
    finally:
        for observers in lists:
            observers.remove(observer)


class KvReadMeter:
    """Per step: the KV tokens its decodes read (sum of context lengths) and whether it was
    decode-only -- what the model-bandwidth utilisation of a decode step counts."""

    def __init__(self):
        self.per_step: list[tuple[int, bool]] = []

    def on_step(self, plan, dispatch_s, wait_s):
        self.per_step.append((sum(d.position + 1 for d in plan.decodes), not plan.prefills))


class HostDelay:
    """Adds `ms` of host time to every step, where the engine reads a step's results (a sleep:
    the GIL is released, as a C tokenizer or a busier scheduler would leave the device
    running). With host/device overlap the next step is already on the device there, so the
    delay is hidden behind it; without, it adds to the step."""

    def __init__(self, ms: float):
        self.ms = ms

    def on_step(self, plan, dispatch_s, wait_s):
        time.sleep(self.ms / 1e3)


class ExecutableTimer:
    """Calls and device seconds per executable key, and the prefill tokens the prefill
    executables computed (their padded token bucket: a prefill key's key[1], a mixed key's
    key[3]) against the plans' prompt tokens."""

    def __init__(self):
        self.per_key = collections.defaultdict(lambda: [0, 0.0])
        self.prefill_tokens = {"prompt": 0, "computed": 0}

    def on_executable(self, key, seconds):
        self.per_key[key][0] += 1
        self.per_key[key][1] += seconds
        if key[0] in ("prefill", "mixed"):         # ("mixed", rows, items, tokens, pages)
            self.prefill_tokens["computed"] += key[1] if key[0] == "prefill" else key[3]

    def on_step(self, plan, dispatch_s, wait_s):
        self.prefill_tokens["prompt"] += sum(len(c.token_ids) for c in plan.prefills)

    def by_kind(self) -> dict:
        kinds = collections.defaultdict(lambda: [0, 0.0])
        for key, (n, seconds) in self.per_key.items():
            kinds[key[0]][0] += n
            kinds[key[0]][1] += seconds
        return kinds
