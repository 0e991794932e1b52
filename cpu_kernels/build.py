"""Compiling a kernel's C++ source into a shared library once per machine, and loading it.

The library lands in `<JAXBATCH_CACHE or ~/.cache/jaxbatch>/cpu_kernels/`, named by a hash of
the source with the headers beside it, the compiler flags, the compiler and jaxlib's version
(its FFI headers), so a changed source or toolchain builds anew and concurrent processes never
see a partial file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_SECONDS = 300


class BuildError(RuntimeError):
    pass


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else g++ or c++ on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> str:
    # jaxbatch.model.loader.cache_root's directory; this package imports nothing of jaxbatch
    base = os.environ.get("JAXBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxbatch")
    return os.path.join(base, "cpu_kernels")


@functools.lru_cache(maxsize=None)
def shared_library(source_name: str, flags: tuple[str, ...]) -> str:
    """The path of `source_name` (a file next to this one) compiled with `flags`; built now
    when not yet in the cache. Raises BuildError with the compiler's message."""
    import jax.ffi
    import jaxlib
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    with open(os.path.join(HERE, source_name), "rb") as f:
        source = f.read()
    # the headers next to it too: a kernel that includes a changed one must build anew
    for header in sorted(n for n in os.listdir(HERE) if n.endswith(".h")):
        with open(os.path.join(HERE, header), "rb") as f:
            source += f.read()
    key = hashlib.sha256(repr((source, flags, cxx, jaxlib.__version__)).encode()).hexdigest()[:16]
    stem = os.path.splitext(source_name)[0]
    path = os.path.join(_cache_dir(), f"{stem}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(_cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", *flags,
           "-I", jax.ffi.include_dir(), os.path.join(HERE, source_name), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)
    return path


def load(path: str) -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(path)
