"""Whether this machine can run the CPU kernels, built and registered once per process."""
from __future__ import annotations

import functools
import os
import platform

import jax
import jax.numpy as jnp

from cpu_kernels import build, call_log, kv_hints

# The instruction sets every kernel here is compiled for.
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=None)
def register(source: str, symbol: str, target: str) -> str | None:
    """Builds `source`, registers its handler `symbol` as the FFI target `target` on CPU;
    returns why it cannot, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = _CPU_FLAGS - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    try:
        lib = build.load(build.shared_library(source, FLAGS))
    except (build.BuildError, OSError) as e:
        return f"could not build {source}: {e}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    kv_hints.wire(lib)
    call_log.wire(lib)
    return None


def unavailable_reason(source: str, symbol: str, target: str) -> str | None:
    """None where the kernel runs; else why not. JAXBATCH_CPU_KERNELS=0 turns every kernel off,
    =1 turns a kernel that cannot run into an error."""
    setting = os.environ.get("JAXBATCH_CPU_KERNELS", "")
    if setting == "0":
        return "turned off (JAXBATCH_CPU_KERNELS=0)"
    reason = register(source, symbol, target)
    if reason and setting == "1":
        raise RuntimeError(f"JAXBATCH_CPU_KERNELS=1, but {source} cannot run: {reason}")
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
