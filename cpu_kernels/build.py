"""Compiling a kernel's C++ source into a shared library once per machine, and loading it.

The library lands in `<JAXBATCH_CACHE or ~/.cache/jaxbatch>/cpu_kernels/`, named by a hash of
the source with the headers beside it, the compiler flags, the compiler and jaxlib's version
(its FFI headers), so a changed source or toolchain builds anew and concurrent processes never
see a partial file (each compiles to a temporary of its own, renamed into place).

What can go wrong is said once, as a warning of the "cpu_kernels" logger, and raised as
BuildError (the kernel then reports it as why it does not run):

- no compiler, or a compile error: the compiler's message;
- a cache directory that cannot be written, or one on a noexec mount (a library there cannot
  be mapped): the next directory is tried, a private one under the system's temporary
  directory, and the warning says why;
- a library in the cache that does not load (a truncated or corrupt file): deleted, built
  again, and loaded once more.

Temporaries left by processes that died while compiling are removed. Within a process one
lock per library keeps two threads (two engines registering at once) from building the same
library twice; across processes the temporary + rename already does.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_SECONDS = 300
LOG = logging.getLogger("cpu_kernels")


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


def _fallback_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"jaxbatch-{os.getuid()}", "cpu_kernels")


_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


def warn_once(message: str) -> None:
    """Logs `message` as a warning of the "cpu_kernels" logger, the first time only."""
    with _WARN_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    LOG.warning(message)


def _usable_dir(directory: str) -> str | None:
    """None where libraries can be written to and run from `directory`; else why not."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return f"cannot create {directory}: {e}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    try:
        if os.statvfs(directory).f_flag & os.ST_NOEXEC:
            return f"{directory} is on a noexec mount: a library there cannot be loaded"
    except OSError:
        pass
    return None


def _remove_stale_temporaries(directory: str, stem: str) -> None:
    """Deletes `stem`'s temporaries whose process is gone (died while it compiled)."""
    for tmp in glob.glob(os.path.join(directory, f"{stem}-*.so.*.tmp")):
        try:
            pid = int(tmp.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue                # alive: still compiling
            except ProcessLookupError:
                pass
            except PermissionError:
                continue                # another user's live process
        try:
            os.remove(tmp)
        except OSError:
            pass


def _source_key(source_name: str, flags: tuple[str, ...], cxx: str) -> str:
    import jaxlib
    with open(os.path.join(HERE, source_name), "rb") as f:
        source = f.read()
    # the headers next to it and on the flags' include paths (an instrument's) too: a kernel
    # that includes a changed one must build anew
    folders = [HERE] + [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "-I"]
    for folder in folders:
        for header in sorted(n for n in os.listdir(folder) if n.endswith(".h")):
            with open(os.path.join(folder, header), "rb") as f:
                source += f.read()
    return hashlib.sha256(repr((source, flags, cxx, jaxlib.__version__)).encode()).hexdigest()[:16]


def _compile(cxx: str, source_name: str, flags: tuple[str, ...], path: str) -> None:
    import jax.ffi
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", *flags,
           "-I", jax.ffi.include_dir(), os.path.join(HERE, source_name), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)


_LOCKS: dict[tuple, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()
_BUILT: dict[tuple, tuple[str, ctypes.CDLL]] = {}


def _lock(key: tuple) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(key, threading.Lock())


def load_library(source_name: str, flags: tuple[str, ...]) -> tuple[str, ctypes.CDLL]:
    """(path, loaded library) of `source_name` (a file next to this one) compiled with
    `flags`: built now when not yet in the cache, once per process. Raises BuildError saying
    why not (logged once as a warning too)."""
    key = (source_name, tuple(flags))
    with _lock(key):
        if key not in _BUILT:
            try:
                _BUILT[key] = _build_and_load(source_name, tuple(flags))
            except BuildError as e:
                warn_once(f"cpu_kernels: {source_name} cannot be built or loaded; the jnp "
                          f"path runs instead: {e}")
                raise
        return _BUILT[key]


def _build_and_load(source_name: str, flags: tuple[str, ...]) -> tuple[str, ctypes.CDLL]:
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    name = f"{os.path.splitext(source_name)[0]}-{_source_key(source_name, flags, cxx)}.so"
    stem = os.path.splitext(source_name)[0]
    problems = []
    for directory in dict.fromkeys([_cache_dir(), _fallback_dir()]):
        why = _usable_dir(directory)
        if why:
            problems.append(why)
            warn_once(f"cpu_kernels: {why}; trying another directory")
            continue
        path = os.path.join(directory, name)
        _remove_stale_temporaries(directory, stem)
        for attempt in range(2):
            if not os.path.exists(path):
                _compile(cxx, source_name, flags, path)
            try:
                return path, ctypes.cdll.LoadLibrary(path)
            except OSError as e:
                if attempt == 0:        # a corrupt or truncated library: once more, afresh
                    warn_once(f"cpu_kernels: {path} does not load ({e}); building it again")
                    try:
                        os.remove(path)
                    except OSError:
                        pass
                    continue
                problems.append(f"{path} does not load: {e}")
                warn_once(f"cpu_kernels: {path} does not load even rebuilt ({e}); trying "
                          f"another directory")
    raise BuildError("; ".join(problems))


def shared_library(source_name: str, flags: tuple[str, ...]) -> str:
    """The path of `source_name` compiled with `flags`, built and loaded (load_library)."""
    return load_library(source_name, flags)[0]


def load(path: str) -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(path)
