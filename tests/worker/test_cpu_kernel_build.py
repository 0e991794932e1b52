"""Building and loading the CPU kernels' libraries (`cpu_kernels/build.py`), the switch the
engine sets (`cpu_kernels.configure`), and what two libraries in one process share.

Every build failure says why, once, as a warning of the "cpu_kernels" logger, and the kernel
reports it as its reason: no compiler, a compile error, a cache directory that cannot be
written or run from (a fallback directory is used), a missing CPU flag. A corrupt library is
rebuilt; temporaries of dead processes are removed; threads building one library build it
once. Each test builds into a cache of its own (JAXBATCH_CACHE) the smallest kernel,
first_argmax."""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels import (availability, build, first_argmax, kv_hints, packed_gemm, paged_decode,
                         paged_prefill)

SOURCE = first_argmax.SOURCE
REASON = build.compiler() is None and "no C++ compiler"


@pytest.fixture
def fresh(tmp_path, monkeypatch, caplog):
    """A cache of this test's own, nothing built or warned yet in this process's memory."""
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_BUILT", {})
    monkeypatch.setattr(build, "_WARNED", set())
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    caplog.set_level(logging.WARNING, logger="cpu_kernels")
    return tmp_path


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cpu_kernels"]


def _build():
    return build.load_library(SOURCE, availability.FLAGS)


def test_no_compiler_is_said_once(fresh, monkeypatch, caplog):
    empty = fresh / "bin"
    empty.mkdir()
    monkeypatch.setenv("CXX", str(fresh / "nothing-here"))
    monkeypatch.setenv("PATH", str(empty))
    for _ in range(2):
        with pytest.raises(build.BuildError, match="no C.. compiler"):
            _build()
    assert len(_warnings(caplog)) == 1 and "no C++ compiler" in _warnings(caplog)[0]


def test_a_compile_error_is_said_with_the_compilers_message(fresh, monkeypatch, caplog):
    cxx = fresh / "broken-cxx"
    cxx.write_text("#!/bin/sh\necho 'kernel.cc:1: error: this compiler is broken' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(build.BuildError, match="this compiler is broken"):
        _build()
    (message,) = _warnings(caplog)
    assert SOURCE in message and "this compiler is broken" in message
    assert not list((fresh / "cache").rglob("*.tmp"))


def test_a_cache_that_cannot_be_written_falls_back(fresh, monkeypatch, caplog):
    (fresh / "a-file").write_text("")
    monkeypatch.setenv("JAXBATCH_CACHE", str(fresh / "a-file"))    # cpu_kernels/ under a file
    path, lib = _build()
    assert path.startswith(str(fresh / "tmp")) and hasattr(lib, "JaxbatchFirstArgmax")
    assert any("cannot create" in m and "another directory" in m for m in _warnings(caplog))


def test_a_noexec_cache_falls_back(fresh, monkeypatch, caplog):
    cache = str(fresh / "cache")
    real = os.statvfs

    class NoExec:
        def __init__(self, st):
            self.st = st
            self.f_flag = st.f_flag | os.ST_NOEXEC

    monkeypatch.setattr(build.os, "statvfs",
                        lambda p: NoExec(real(p)) if str(p).startswith(cache) else real(p))
    path, _ = _build()
    assert path.startswith(str(fresh / "tmp"))
    assert any("noexec" in m for m in _warnings(caplog))


def test_a_library_that_never_maps_moves_to_another_directory(fresh, monkeypatch, caplog):
    """A noexec mount statvfs does not report: loading fails even rebuilt, so the next
    directory is used."""
    cache = str(fresh / "cache")
    real = ctypes.cdll.LoadLibrary

    def load(path):
        if path.startswith(cache):
            raise OSError(f"{path}: failed to map segment from shared object")
        return real(path)

    monkeypatch.setattr(build.ctypes.cdll, "LoadLibrary", load)
    path, _ = _build()
    assert path.startswith(str(fresh / "tmp"))
    assert any("even rebuilt" in m for m in _warnings(caplog))


def test_a_corrupt_library_is_deleted_and_rebuilt(fresh, caplog):
    """A truncated file where the library should be (a crash mid-copy, a full disk): it does
    not load, so it is deleted and built again. (Its path is one this process never loaded:
    dlopen would hand back a loaded library by its name without reading the file.)"""
    directory = fresh / "cache" / "cpu_kernels"
    directory.mkdir(parents=True)
    key = build._source_key(SOURCE, availability.FLAGS, build.compiler())
    path = directory / f"first_argmax-{key}.so"
    path.write_bytes(b"\x7fELF truncated")
    path2, lib = _build()
    assert path2 == str(path) and path.stat().st_size > 1000
    assert hasattr(lib, "JaxbatchFirstArgmax")
    assert any("does not load" in m and "building it again" in m for m in _warnings(caplog))


def test_temporaries_of_dead_processes_are_removed(fresh):
    path, _ = _build()
    build._BUILT.clear()
    os.remove(path)
    directory, name = os.path.split(path)
    dead = os.path.join(directory, f"{name}.999999999.tmp")          # no such process
    alive = os.path.join(directory, f"{name}.{os.getppid()}.tmp")    # still compiling
    for tmp in (dead, alive):
        with open(tmp, "w") as f:
            f.write("partial")
    _build()
    assert not os.path.exists(dead) and os.path.exists(alive)


def test_threads_building_one_library_build_it_once(fresh, monkeypatch):
    compiles = []
    real = build._compile

    def counting(*args):
        compiles.append(args)
        return real(*args)

    monkeypatch.setattr(build, "_compile", counting)
    results, barrier = [], threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append(_build())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1 and len({path for path, _ in results}) == 1


def test_a_missing_cpu_flag_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(build, "_WARNED", set())
    monkeypatch.setattr(availability, "_cpu_flags", lambda: {"avx512f", "avx512bw"})
    caplog.set_level(logging.WARNING, logger="cpu_kernels")
    # a target name of this test's own: nothing registered, nothing cached for the real one
    for target in ("test_missing_flag_a", "test_missing_flag_b"):
        reason = availability.register(SOURCE, "JaxbatchFirstArgmax", target)
        assert reason == "this CPU lacks avx512_bf16, avx512_vnni, avx512vl"
    assert len(_warnings(caplog)) == 1 and "avx512_bf16" in _warnings(caplog)[0]


# ---- one process, several registrations ----------------------------------------------------

needs_kernels = pytest.mark.skipif(
    bool(REASON or paged_decode.unavailable_reason() or packed_gemm.unavailable_reason()),
    reason="CPU kernels unavailable")


@needs_kernels
def test_two_engines_register_at_once():
    """Two engines starting in two threads register every kernel; both see them run."""
    results, barrier = [], threading.Barrier(2)

    def start():
        barrier.wait()
        results.append(cpu_kernels.register_all())

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [(None,) * len(cpu_kernels.KERNELS)] * 2
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(first_argmax.first_argmax(x), [3, 3, 3])


@needs_kernels
def test_each_library_holds_its_own_queue_pointer():
    """The decode library's prefetch queue is its own: taking the queue from the GEMM
    library (a GNU_UNIQUE static would be one pointer for both) leaves decode publishing."""
    _, decode_lib = build.load_library(paged_decode.SOURCE, availability.build_flags())
    _, gemm_lib = build.load_library(packed_gemm.SOURCE, availability.build_flags())
    queue = kv_hints._Queue()
    try:
        decode_lib.JaxbatchSetPrefetchQueue(ctypes.byref(queue))
        gemm_lib.JaxbatchSetPrefetchQueue(None)
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 4, 16, 16)), jnp.float32)
        items = (jnp.asarray([0, 1], jnp.int32), jnp.asarray([[1], [0]], jnp.int32),
                 jnp.zeros((2,), jnp.int32))
        jax.block_until_ready(paged_decode.paged_decode_attention(
            q, k, k, *items, jnp.asarray([10], jnp.int32), next_layer_blocks=2))
        assert queue.size == 1 and queue.ranges[0].bytes == 16 * 16 * 4
    finally:
        kv_hints.set_enabled(True)          # every library holds the process's queue again


# ---- the engine's switch -------------------------------------------------------------------

@pytest.fixture
def restore_configure(request):
    request.addfinalizer(cpu_kernels.configure)


def test_off_turns_every_kernel_off(restore_configure):
    cpu_kernels.configure(mode="off")
    for kernel in cpu_kernels.KERNELS:
        assert "turned off" in kernel.unavailable_reason()
    assert "turned off" in paged_decode.why_not(jnp.uint16, 4, 2, 16)
    assert "turned off" in paged_prefill.why_not(jnp.uint16, 4, 2, 16)
    cpu_kernels.configure()
    assert all(r is None or "turned off" not in r for r in cpu_kernels.register_all())


def test_required_turns_an_unavailable_kernel_into_an_error(restore_configure, monkeypatch):
    monkeypatch.setattr(availability, "register", lambda *a: "this CPU lacks avx512_bf16")
    assert first_argmax.unavailable_reason() == "this CPU lacks avx512_bf16"
    cpu_kernels.configure(mode="required")
    with pytest.raises(RuntimeError, match="required.*first_argmax.cc cannot run: this CPU"):
        first_argmax.unavailable_reason()


def test_configure_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="'sometimes'"):
        cpu_kernels.configure(mode="sometimes")


@needs_kernels
def test_kv_prefetch_false_publishes_nothing(restore_configure):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 4, 16, 16)), jnp.float32)
    items = (jnp.asarray([0], jnp.int32), jnp.asarray([[1]], jnp.int32), jnp.zeros((1,), jnp.int32))
    call = lambda: jax.block_until_ready(paged_decode.paged_decode_attention(
        q, k, k, *items, jnp.asarray([10], jnp.int32), next_layer_blocks=2))
    call()
    assert len(kv_hints.published()) == 1
    cpu_kernels.configure(kv_prefetch=False)
    call()
    assert len(kv_hints.published()) == 1          # the queue untouched: no library holds it
    cpu_kernels.configure(kv_prefetch=True)
    call()
    assert len(kv_hints.published()) == 1


def test_the_environment_switches_are_gone(monkeypatch, restore_configure):
    monkeypatch.setenv("JAXBATCH_CPU_KERNELS", "0")
    monkeypatch.setenv("JAXBATCH_KV_PREFETCH", "0")
    reason = first_argmax.unavailable_reason()
    assert reason is None or "turned off" not in reason
    here = os.path.dirname(os.path.abspath(cpu_kernels.__file__))
    for name in os.listdir(here):
        if name.endswith(".py"):
            with open(os.path.join(here, name)) as f:
                source = f.read()
            assert "JAXBATCH_CPU_KERNELS" not in source and "JAXBATCH_KV_PREFETCH" not in source, name


def test_a_compiler_without_amx_still_builds_every_other_kernel(monkeypatch):
    """An older compiler (no AMX intrinsics) loses the AMX variants only: they refuse, the
    AVX512 handlers are all there, and the seam is told why (built here with -DJAXBATCH_NO_AMX,
    which takes the same path)."""
    from cpu_kernels import availability, build, packed_gemm, paged_decode, w8a8_gemm
    if packed_gemm.unavailable_reason() is not None:
        pytest.skip(packed_gemm.unavailable_reason())
    _, lib = build.load_library(packed_gemm.SOURCE,
                                availability.build_flags() + ("-DJAXBATCH_NO_AMX",))
    assert lib.JaxbatchAmxBuilt() == 0
    for symbol in ("JaxbatchPackedGemm", "JaxbatchPackedGemmSiluMul", "JaxbatchW8A8Gemm",
                   "JaxbatchPackedGemmAmx", "JaxbatchW8A8GemmAmx"):
        assert hasattr(lib, symbol)
    _, lib = build.load_library(paged_decode.SOURCE,
                                availability.build_flags() + ("-DJAXBATCH_NO_AMX",))
    assert lib.JaxbatchAmxBuilt() == 0
    for symbol in ("JaxbatchPagedDecode", "JaxbatchPagedDecodeBf16Out", "JaxbatchPagedDecodeAmx"):
        assert hasattr(lib, symbol)
    monkeypatch.setattr(availability, "amx_unavailable_reason", lambda: None)
    monkeypatch.setattr(availability, "built_with_amx", lambda source: False)
    assert packed_gemm.amx_why_not() == w8a8_gemm.amx_why_not() == availability.NO_AMX_COMPILER
    assert paged_decode.amx_why_not() == availability.NO_AMX_COMPILER
