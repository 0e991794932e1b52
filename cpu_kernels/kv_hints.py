"""The memory of the KV prefetch hint channel (`kv_prefetch.h`): decode attention publishes
the pages its rows read at the next layer, and the GEMMs in between request them into cache.

One queue per process, owned here and handed to every kernel library as it loads
(`wire`). cpu_kernels.configure(kv_prefetch=False) leaves the libraries without it (it calls
set_enabled): nothing is published or requested, and every result is the same either way (a
request is only a hint). On by default.

    wire(lib)        hands the queue to a loaded kernel library (availability.register)
    set_enabled(on)  hands it to, or takes it from, every library wired so far and every one
                     wired later (cpu_kernels.configure; A/B runs)
    published()      [(key address, value address, bytes)] of the last publication (tests)
    claimed()        how many of them GEMM threads have claimed (tests; may exceed the count)
"""
from __future__ import annotations

import ctypes

from cpu_kernels.handout import Handout

QUEUE_RANGES = 1 << 15      # kv_prefetch.h, kMaxRanges


class _Range(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("bytes", ctypes.c_int64)]


class _Queue(ctypes.Structure):
    _fields_ = [("size", ctypes.c_int64), ("next", ctypes.c_int64),
                ("ranges", _Range * QUEUE_RANGES)]


_QUEUE = _Queue()
_HANDOUT = Handout("JaxbatchSetPrefetchQueue", "JaxbatchPrefetchQueueRanges", QUEUE_RANGES)
wire = _HANDOUT.wire


def set_enabled(on: bool) -> None:
    _HANDOUT.hand(ctypes.byref(_QUEUE) if on else None)


set_enabled(True)


def published() -> list[tuple[int, int, int]]:
    return [(r.k or 0, r.v or 0, r.bytes) for r in _QUEUE.ranges[:_QUEUE.size]]


def claimed() -> int:
    return _QUEUE.next
