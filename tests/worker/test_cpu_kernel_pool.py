"""How a kernel's calling thread waits for its helpers (`cpu_kernels/pool_dispatch.h`): it
spins briefly, then yields, then sleeps on a futex that the thread finishing the last unit
wakes, so a helper held up for long costs the waiting core nothing; and no call schedules more
helpers than the pool has threads besides the caller. Compiled here as a small C++ program
against the header (the kernels' own scheduling is checked through the call log in
tests/benchmarks/instrumented_call_log.py). Skipped without a C++ compiler."""
from __future__ import annotations

import os
import subprocess

import pytest

from cpu_kernels import build

HERE = os.path.dirname(os.path.abspath(build.__file__))

PROGRAM = r"""
#include "pool_dispatch.h"
#include <chrono>
#include <cstdio>
#include <thread>
int main() {
  jaxbatch_pool::JobCounters job;
  job.units = 2;
  job.UnitDone();                        // the caller's own unit
  std::thread helper([&] {               // a helper's unit, 300 ms late
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    job.UnitDone();
  });
  timespec a, b;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  const auto w0 = std::chrono::steady_clock::now();
  jaxbatch_pool::AwaitUnits(job);
  const auto w1 = std::chrono::steady_clock::now();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  helper.join();
  const long cpu_us = (b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000;
  const long wall_us = std::chrono::duration_cast<std::chrono::microseconds>(w1 - w0).count();
  std::printf("%ld %ld %ld\n", cpu_us, wall_us, (long)job.done.load());
  for (long threads : {1, 2, 3, 8})
    for (long units : {0, 1, 2, 5, 100})
      std::printf("%ld %ld %ld\n", threads, units, (long)jaxbatch_pool::Helpers(threads, units));
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    import jax.ffi
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("pool")
    (d / "t.cc").write_text(PROGRAM)
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", "-I", HERE, "-I",
                    jax.ffi.include_dir(), str(d / "t.cc"), "-o", str(d / "t")],
                   check=True, capture_output=True, text=True)
    lines = subprocess.run([str(d / "t")], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    return [tuple(map(int, line.split())) for line in lines]


def test_a_waiting_caller_sleeps_instead_of_spinning(program):
    cpu_us, wall_us, done = program[0]
    assert done == 2 and wall_us >= 250_000
    # spinning the whole wait would take about all of it on the CPU
    assert cpu_us < 60_000, f"{cpu_us} us of CPU while waiting {wall_us} us"


def test_helpers_never_outnumber_the_pool(program):
    for threads, units, helpers in program[1:]:
        assert helpers == max(0, min(threads - 1, units - 1)), (threads, units, helpers)
        # on a pool thread: caller + helpers; elsewhere helpers + 1 tasks
        assert helpers + 1 <= threads
