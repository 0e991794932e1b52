"""The memory of the kernels' call log (`call_log.h`): each call of a CPU kernel, timed on the
thread that runs it, for `bench calls`. One log per process, owned here and handed to every
kernel library as it loads (`wire`) while recording is on; off (the default) the libraries
hold no log and record nothing.

    wire(lib)     hands the log to a loaded kernel library if recording is on
                  (availability.register)
    start()       empties the log and starts recording in every library wired so far
    stop()        stops recording; returns the records since `start` (`records`)
    records()     the records so far: a [N, 6] int64 array of (kernel, a, b, c, entry_ns,
                  end_ns), CLOCK_MONOTONIC (`time.monotonic_ns`), in the order calls were
                  entered; end_ns 0 for a call not yet done. What a, b and c are: SIZES
    dropped()     calls past the log's capacity since `start`, not recorded
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

CAPACITY = 1 << 17          # call_log.h, kMaxRecords
# call_log.h's Kernel ids, and what each one's three sizes are (call_log.h, Label).
KERNELS = {1: "gemm", 2: "decode attention", 3: "prefill attention", 4: "add + norm",
           5: "argmax"}
SIZES = {"gemm": ("rows", "in", "out"), "decode attention": ("rows", "heads", "head dim"),
         "prefill attention": ("tokens", "heads", "head dim"), "add + norm": ("rows", "d", "-"),
         "argmax": ("rows", "vocab", "-")}
FIELDS = 6


class _Log(ctypes.Structure):
    _fields_ = [("size", ctypes.c_int64), ("records", ctypes.c_int64 * (FIELDS * CAPACITY))]


_LOG: _Log | None = None     # allocated on first start, never freed: a late call may write
_LIBS: list = []
_LOCK = threading.Lock()
_recording = False


def _hand(lib) -> None:
    lib.JaxbatchSetCallLog(ctypes.byref(_LOG) if _recording else None)


def wire(lib) -> None:
    """A library built for another capacity would write past the log: it gets none."""
    if not hasattr(lib, "JaxbatchSetCallLog"):
        return
    lib.JaxbatchSetCallLog.argtypes = [ctypes.c_void_p]
    lib.JaxbatchCallLogCapacity.restype = ctypes.c_int64
    if lib.JaxbatchCallLogCapacity() != CAPACITY:
        lib.JaxbatchSetCallLog(None)
        return
    with _LOCK:
        if all(known._handle != lib._handle for known in _LIBS):
            _LIBS.append(lib)
        _hand(lib)


def _set(on: bool) -> None:
    global _LOG, _recording
    with _LOCK:
        if on and _LOG is None:
            _LOG = _Log()
        _recording = on
        for lib in _LIBS:
            _hand(lib)


def start() -> None:
    _set(False)
    if _LOG is not None:
        _LOG.size = 0
    _set(True)


def stop() -> np.ndarray:
    _set(False)
    return records()


def records() -> np.ndarray:
    if _LOG is None:
        return np.zeros((0, FIELDS), np.int64)
    n = min(_LOG.size, CAPACITY)
    flat = np.ctypeslib.as_array(_LOG.records)[:n * FIELDS]
    return flat.reshape(n, FIELDS).copy()


def dropped() -> int:
    return 0 if _LOG is None else max(0, _LOG.size - CAPACITY)
