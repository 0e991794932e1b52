"""Memory of ours that every kernel library writes or reads (kv_hints.py's queue, the lab's
benchmarks/call_log.py's log): handed to each library as it loads, and taken back or given again
to all of them at once. A library asks for it through two C functions its source defines (the
macros of kv_prefetch.h and of an instrument's call_log.h): `setter(void*)`, and `capacity()`
(int64), the size it was built for; one built for another size would write past the memory, so
it gets none."""
from __future__ import annotations

import ctypes
import threading


class Handout:
    def __init__(self, setter: str, capacity: str, size: int):
        self.setter, self.capacity, self.size = setter, capacity, size
        self._libs: list = []
        self._pointer = None      # what every wired library holds now: a ctypes pointer or None
        self._lock = threading.Lock()

    def wire(self, lib) -> None:
        """Hands the current memory (or none) to a loaded library that asks for it."""
        if not hasattr(lib, self.setter):
            return
        getattr(lib, self.setter).argtypes = [ctypes.c_void_p]
        getattr(lib, self.capacity).restype = ctypes.c_int64
        if getattr(lib, self.capacity)() != self.size:
            getattr(lib, self.setter)(None)
            return
        with self._lock:
            if all(known._handle != lib._handle for known in self._libs):   # one per library
                self._libs.append(lib)
            getattr(lib, self.setter)(self._pointer)

    def hand(self, pointer) -> None:
        """Every library wired so far, and every one wired later, holds `pointer` (None: no
        memory)."""
        with self._lock:
            self._pointer = pointer
            for lib in self._libs:
                getattr(lib, self.setter)(pointer)
