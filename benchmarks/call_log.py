"""The memory of the CPU kernels' call log (`call_log.h` beside this file): each call of a kernel,
timed on the thread that runs it, for `python -m benchmarks calls`. The log is compiled only
into an instrumented build: a process that wants it calls `instrument()` before any kernel
registers, which asks `cpu_kernels.availability.instrument` for libraries built with `FLAGS`
(-DJAXBATCH_CALL_LOG, this folder on the include path; a library of their own in the cache) and
wired to this log as they load; production builds carry no log code. One log per process, owned
here and handed to every kernel library as it loads (`wire`) while recording is on; off (the
default) the libraries hold no log and record nothing.

    instrument()  this process's kernels are built with the call log; raises RuntimeError
                  once a kernel has registered (its library is built without it)
    instrumented() whether instrument() was called
    wire(lib)     hands the log to a loaded kernel library if recording is on
    start()       empties the log and starts recording in every library wired so far;
                  RuntimeError in a process not instrumented
    stop()        stops recording; returns the records since `start` (`records`)
    records()     the records so far: a [N, 8] int64 array of (kernel, a, b, c, entry_ns,
                  end_ns, tasks, threads), CLOCK_MONOTONIC (`time.monotonic_ns`), in the
                  order calls were entered; end_ns 0 for a call not yet done; tasks: the
                  pool tasks the call scheduled, threads: the pool's threads. What a, b and
                  c are: SIZES
    dropped()     calls past the log's capacity since `start`, not recorded
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from cpu_kernels import availability
from cpu_kernels.handout import Handout

# An instrumented build's flags: the log compiled in, from call_log.h beside this file.
FLAGS = ("-DJAXBATCH_CALL_LOG", "-I", os.path.dirname(os.path.abspath(__file__)))
CAPACITY = 1 << 17          # call_log.h, kMaxRecords
# The Kernel ids, and what each one's three sizes are (cpu_kernels/call_observer.h, Label).
KERNELS = {1: "gemm", 2: "decode attention", 3: "prefill attention", 4: "add + norm",
           5: "argmax"}
SIZES = {"gemm": ("rows", "in", "out"), "decode attention": ("rows", "heads", "head dim"),
         "prefill attention": ("tokens", "heads", "head dim"), "add + norm": ("rows", "d", "-"),
         "argmax": ("rows", "vocab", "-")}
FIELDS = 8


class _Log(ctypes.Structure):
    _fields_ = [("size", ctypes.c_int64), ("records", ctypes.c_int64 * (FIELDS * CAPACITY))]


_LOG: _Log | None = None     # allocated on first start, never freed: a late call may write
_HANDOUT = Handout("JaxbatchSetCallLog", "JaxbatchCallLogCapacity", CAPACITY)
wire = _HANDOUT.wire
_INSTRUMENTED = False


def instrument() -> None:
    global _INSTRUMENTED
    if not _INSTRUMENTED:
        try:
            availability.instrument(FLAGS, wire)
        except RuntimeError as e:
            raise RuntimeError(f"call_log.instrument(): {e}") from None
    _INSTRUMENTED = True


def instrumented() -> bool:
    return _INSTRUMENTED


def start() -> None:
    global _LOG
    if not _INSTRUMENTED:
        raise RuntimeError("call_log.start(): the kernels are built without the call log; "
                           "call benchmarks.call_log.instrument() before any kernel registers "
                           "(first thing in the process, as `python -m benchmarks calls` does)")
    _HANDOUT.hand(None)
    if _LOG is None:
        _LOG = _Log()
    _LOG.size = 0
    _HANDOUT.hand(ctypes.byref(_LOG))


def stop() -> np.ndarray:
    _HANDOUT.hand(None)
    return records()


def records() -> np.ndarray:
    if _LOG is None:
        return np.zeros((0, FIELDS), np.int64)
    n = min(_LOG.size, CAPACITY)
    flat = np.ctypeslib.as_array(_LOG.records)[:n * FIELDS]
    return flat.reshape(n, FIELDS).copy()


def dropped() -> int:
    return 0 if _LOG is None else max(0, _LOG.size - CAPACITY)
