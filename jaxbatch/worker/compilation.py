"""The compiled executables of one runner: lowering, compiling, warm-up, and the count of
compilations that happened when they should not have.

The runner feeds it — the functions by kind (`functions`: kind -> (function, index of the
donated argument or None, number of outputs)), the keys to warm (`keys()`), arguments of the
right shapes per key (`example_args(key)`) — and runs every call through `run(key, args)`.
Nothing here knows what a step is. Where lowered functions come from: plain `jax.jit`, or
`lowered_store.py`'s stored `jax.export`s (a second start traces nothing); JAX's persistent
compilation cache (`compile_cache.py`) makes a compile a disk read.
"""
from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import time
from typing import Callable

import jax

from jaxbatch.worker.executable_keys import ModelCallKey, SampleKey, as_key

logger = logging.getLogger(__name__)


class Executables:
    def __init__(self, functions: dict, store=None, tensor_parallel=None):
        self.functions = functions
        self.store = store
        self.tp = tensor_parallel
        self.compiled: dict[ModelCallKey | SampleKey, object] = {}
        self.compile_seconds = 0.0
        # Set by `warmup`: from then on a compilation means a shape the buckets missed.
        self.warmed_up = False
        self.warmup_report: dict = {}
        self.compilations_after_warmup: list[ModelCallKey | SampleKey] = []

    def __len__(self) -> int:
        return len(self.compiled)

    def lower(self, key, args):
        """`key`: a key record (or its tuple form); its kind picks the function (a LoRA
        variant is the same function, given the adapter pool among `args`)."""
        key = as_key(key)
        fn, donate, num_outputs = self.functions[key.kind]
        donate_argnums = () if donate is None else (donate,)
        if self.store is not None:
            # The function variant is part of the stored key: a sampled draft's "sample" is
            # sample_with_probs, with other outputs under the same kind.
            variant = tuple(getattr(a, "__name__", "") for a in getattr(fn, "args", ()))
            try:
                return self.store.lower(key.as_tuple() + variant, fn, donate_argnums, args)
            except Exception:               # noqa: BLE001 - what export refuses, jit may not
                logger.warning("lowering %s from jax.export failed; storing no lowered steps",
                               key, exc_info=True)
                self.store = None
        shardings = {} if self.tp is None else self.tp.jit_shardings(args, donate, num_outputs)
        return jax.jit(fn, donate_argnums=donate_argnums, **shardings).lower(*args)

    def run(self, key: ModelCallKey | SampleKey, args):
        exe = self.compiled.get(key)
        if exe is None:
            if self.warmed_up:
                self.compilations_after_warmup.append(key)
                logger.warning("compiling %s after warm-up: a shape the buckets missed (a bug)", key)
            start = time.perf_counter()
            exe = self.lower(key, args).compile()
            self.compile_seconds += time.perf_counter() - start
            self.compiled[key] = exe
        if self.tp is not None:
            args = self.tp.to_mesh(args)
        return exe(*args)

    def warmup(self, keys: list, example_args: Callable[[object], tuple],
               max_workers: int | None = None,
               run_once: Callable[[object], None] | None = None) -> float:
        """Makes every key executable: lowered one by one on this thread
        (tracing holds the GIL; a stored lowering is read instead), each compiled on a thread
        per core as soon as it is lowered (XLA compiles with the GIL released; with the
        persistent cache on, a compile is a cache read).

        `run_once(key)`: runs a key's executable once, on inputs that touch no request; called
        on this thread for each key as its compile finishes, while later keys still compile.
        XLA:CPU sets up each executable's kernels (its library dots above all) on the first
        run, not when compiling: without it the first requests wait for that, once per shape.

        `warmup_report`: lower_s is this thread's time lowering, run_s its time in
        `run_once`, compile_s the rest of the wall time (compiles hidden behind neither),
        cpu_s the process CPU seconds of the whole warm-up, from_store the keys whose
        lowering was read back, not traced.

        Python's cyclic garbage collector is paused meanwhile: tracing allocates hundreds of
        thousands of objects, which made it run (and walk every live object) about 260 times
        for 30 keys, 0.9 s of a cold warm-up's 35 CPU seconds; what it would have freed waits
        until after."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._warmup(keys, example_args, max_workers, run_once)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _warmup(self, keys, example_args, max_workers, run_once) -> float:
        start, cpu_start = time.perf_counter(), time.process_time()
        store = self.store
        hits_before = store.hits if store is not None else 0
        missing = [key for key in keys if key not in self.compiled]
        workers = max_workers or compile_threads()
        lower_s = 0.0
        with concurrent.futures.ThreadPoolExecutor(workers) as threads:
            pending = []
            for key in missing:
                t = time.perf_counter()
                lowered = self.lower(key, example_args(key))
                lower_s += time.perf_counter() - t
                pending.append(threads.submit(lowered.compile))
            run_s = 0.0
            for key, future in zip(missing, pending):
                self.compiled[key] = future.result()
                if run_once is not None:
                    t = time.perf_counter()
                    run_once(key)
                    run_s += time.perf_counter() - t
        elapsed = time.perf_counter() - start
        self.compile_seconds += elapsed - run_s
        self.warmup_report = {
            "executables": len(keys), "compiled": len(missing),
            "from_store": store.hits - hits_before if store is not None else 0,
            "lower_s": lower_s, "compile_s": max(0.0, elapsed - lower_s - run_s), "run_s": run_s,
            "cpu_s": time.process_time() - cpu_start, "threads": workers}
        self.warmed_up = True
        return elapsed


def compile_threads() -> int:
    """A thread per core we may use (affinity, not the host's count), at most 8 (each compile
    holds its own memory). One on a GPU: XLA times candidate kernels while compiling, and
    concurrent compiles would skew what it picks."""
    if jax.default_backend() != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))
