"""Whether this machine can run the CPU kernels, built and registered once per process, and
the switch the engine sets from its configuration (`configure`).

    configure(mode="auto", kv_prefetch=True)
        mode "auto" (the default): a kernel runs where it can, else the jnp path runs and the
        reason is logged once; "off": every kernel reports "turned off" and none is built;
        "required": a kernel that cannot run raises RuntimeError instead. kv_prefetch: the
        decode → GEMM prefetch hints (kv_hints.py; results are the same either way).
    instrument(flags, on_load)
        before any kernel registers: an instrumented build for this process (the lab's
        benchmarks/call_log.py asks for one); production builds carry no instrument.
"""
from __future__ import annotations

import functools
import platform
import threading

import jax
import jax.numpy as jnp

from cpu_kernels import build, kv_hints

# The instruction sets every kernel here is compiled for.
# (Every CPU with AVX512-BF16 has AVX512-VNNI too: the W8A8 GEMM's `vpdpbusd`.)
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
MODES = ("auto", "off", "required")
_MODE = "auto"


def configure(mode: str = "auto", kv_prefetch: bool = True) -> None:
    """How the kernels are used in this process (the engine calls it from its config; see
    the module's docstring). Takes effect for every later `unavailable_reason`; a step traced
    before keeps what it was traced with."""
    global _MODE
    if mode not in MODES:
        raise ValueError(f"cpu_kernels.configure: mode {mode!r}, one of {MODES} expected")
    _MODE = mode
    kv_hints.set_enabled(bool(kv_prefetch))


def mode() -> str:
    return _MODE


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_INSTRUMENTS: list[tuple[tuple[str, ...], object]] = []     # (flags, on_load), in order asked
_SEALED = False              # a kernel has registered: this process's build flags are chosen


def instrument(flags, on_load) -> None:
    """Every kernel library of this process is built with `flags` as well (a library of its
    own in the cache, since the flags are part of its name) and handed to `on_load(lib)` once
    loaded: how an instrument outside the package compiles its probes in. Raises RuntimeError
    once a kernel has registered (its library is built without them)."""
    if _SEALED:
        raise RuntimeError("cpu_kernels.availability.instrument(): a kernel has registered in "
                           "this process already, built without the instrument; instrument "
                           "first (before any engine or kernel), or in a process of its own")
    _INSTRUMENTS.append((tuple(flags), on_load))


def cpu_has(flag: str) -> bool:
    """Whether this CPU reports `flag` (/proc/cpuinfo's name, e.g. "amx_bf16")."""
    return flag in _cpu_flags()


AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=None)
def amx_unavailable_reason() -> str | None:
    """None where this process may run AMX tiles (the kernels' `amx` variants), else why not:
    the CPU lacks them, or Linux does not grant the process their state (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, which is asked here once for the whole process)."""
    missing = [flag for flag in AMX_FLAGS if not cpu_has(flag)]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    if libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) != 0:
        return f"Linux grants no AMX tile state (arch_prctl: errno {ctypes.get_errno()})"
    return None


def built_with_amx(source: str) -> bool:
    """Whether `source`'s library (loaded: after a register) was compiled with AMX intrinsics
    (its JaxbatchAmxBuilt: an older compiler builds it without them)."""
    _, lib = build.load_library(source, build_flags())
    return bool(lib.JaxbatchAmxBuilt())


NO_AMX_COMPILER = "the compiler has no AMX intrinsics (GCC 11 and Clang 12 have them)"


def amx_variants_why_not(source: str, handlers) -> str | None:
    """None where the AMX variants of `handlers` ((symbol, target) pairs of `source`'s AVX512
    handlers) run here, registered; else why not: no tiles for this process, a variant that
    does not register, or a library built without AMX intrinsics."""
    reason = amx_unavailable_reason()
    if reason:
        return reason
    for symbol, target in handlers:
        reason = unavailable_reason(source, *amx_variant(symbol, target))
        if reason:
            return reason
    return None if built_with_amx(source) else NO_AMX_COMPILER


def amx_variant(symbol: str, target: str) -> tuple[str, str]:
    """The (symbol, target) of a GEMM handler's AMX variant (packed_gemm.cc)."""
    return symbol + "Amx", target + "_amx"


def build_flags() -> tuple[str, ...]:
    """The compiler flags of this process's libraries: FLAGS, and an instrumented process's
    own (`instrument`)."""
    return FLAGS + tuple(flag for flags, _ in _INSTRUMENTS for flag in flags)


_REGISTER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _register(source: str, symbol: str, target: str) -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        reason = f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
        build.warn_once(f"cpu_kernels: {reason}; the jnp path runs instead")
        return reason
    missing = _CPU_FLAGS - _cpu_flags()
    if missing:
        reason = f"this CPU lacks {', '.join(sorted(missing))}"
        build.warn_once(f"cpu_kernels: {reason}; the jnp path runs instead")
        return reason
    global _SEALED
    _SEALED = True                      # the build's flags are chosen now, for the process
    try:
        _, lib = build.load_library(source, build_flags())
    except build.BuildError as e:       # logged once by build
        return f"could not build {source}: {e}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    kv_hints.wire(lib)
    for _, on_load in _INSTRUMENTS:
        on_load(lib)
    return None


def register(source: str, symbol: str, target: str) -> str | None:
    """Builds `source`, registers its handler `symbol` as the FFI target `target` on CPU;
    returns why it cannot, or None. Once per target and process, whatever the threads."""
    with _REGISTER_LOCK:
        return _register(source, symbol, target)


register.cache_clear = _register.cache_clear


def unavailable_reason(source: str, symbol: str, target: str) -> str | None:
    """None where the kernel runs; else why not. configure(mode="off") turns every kernel off;
    mode="required" turns a kernel that cannot run into a RuntimeError."""
    if _MODE == "off":
        return "turned off (cpu_kernels.configure(mode='off'))"
    reason = register(source, symbol, target)
    if reason and _MODE == "required":
        raise RuntimeError(f"cpu_kernels.configure(mode='required'), but {source} cannot run: "
                           f"{reason}")
    return reason


def attention_heads_uncovered(num_heads, num_kv_heads, head_dim, soft_cap, max_group,
                              max_head_dim) -> str | None:
    """What an attention kernel here does not cover in a model's heads, or None: a soft cap,
    more than `max_group` query heads per kv head, an odd head_dim (bf16 pairs; a bf16 pool's
    keys are grouped by dim pairs) or one past `max_head_dim`."""
    if soft_cap is not None:
        return "attention soft cap"
    if (num_heads % num_kv_heads or num_heads // num_kv_heads > max_group or head_dim % 2
            or head_dim > max_head_dim):
        return f"{num_heads} heads over {num_kv_heads} kv heads, head_dim {head_dim}"
    return None


def require(source: str, symbol: str, target: str, kernel: str) -> None:
    """Registers the handler, or raises RuntimeError saying why `kernel` cannot run here."""
    reason = register(source, symbol, target)
    if reason:
        raise RuntimeError(f"{kernel} cannot run here: {reason}")


def attention_operands(head_dim: int, scale, window, no_window: int) -> tuple:
    """(window [1] int32, scale [1] float32): operands, not attributes, as either may be traced
    (a layer's window comes from the layer scan)."""
    scale = head_dim ** -0.5 if scale is None else scale
    return (jnp.full((1,), no_window if window is None else window, jnp.int32),
            jnp.full((1,), scale, jnp.float32))
