"""The kernels' call log (`benchmarks/call_log.h` and `call_log.py`) in an instrumented process:
while it records, every kernel call leaves one record of its kernel, its sizes and when it ran,
in call order; when stopped, nothing more. Results never depend on it.

Not collected by itself (no test_ prefix): test_call_log.py runs it in a
fresh process, as `call_log.instrument()` must come before any kernel registers."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import call_log

call_log.instrument()           # before any kernel registers

from cpu_kernels import add_rms_norm, first_argmax, packed_gemm, paged_decode  # noqa: E402

REASON = (packed_gemm.unavailable_reason() or add_rms_norm.unavailable_reason()
          or first_argmax.unavailable_reason())
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


@jax.jit
def _chain(x, w, norm_w):
    """gemm [5, 64] -> [5, 96], add + norm over its first 64, gemm again, argmax."""
    y = packed_gemm.matmul(x, w, out_dtype=jnp.bfloat16)
    _, normed = add_rms_norm.add_rms_norm(y[:, :64], x, norm_w, 1e-5)
    return first_argmax.first_argmax(packed_gemm.matmul(normed, w))


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    w = jnp.asarray(packed_gemm.pack(rng.standard_normal((64, 96)).astype(jnp.bfloat16)))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    return x, w, jnp.ones((64,), jnp.float32)


def test_each_call_recorded_in_order_with_its_sizes(operands):
    expected = jax.block_until_ready(_chain(*operands))      # compiled, and the answer
    before = time.monotonic_ns()
    call_log.start()
    got = jax.block_until_ready(_chain(*operands))
    records = call_log.stop()
    after = time.monotonic_ns()
    np.testing.assert_array_equal(got, expected)
    kinds = [call_log.KERNELS[k] for k in records[:, 0]]
    assert kinds == ["gemm", "add + norm", "gemm", "argmax"]
    np.testing.assert_array_equal(records[:, 1:4], [[5, 64, 96], [5, 64, 0], [5, 64, 96],
                                                    [5, 96, 0]])
    entry, end = records[:, 4], records[:, 5]
    assert before <= entry[0] and end[-1] <= after
    assert np.all(entry <= end)
    # each call ends before the next one (which reads its output) is entered
    assert np.all(end[:-1] <= entry[1:])
    assert call_log.dropped() == 0


def test_nothing_recorded_once_stopped_and_start_empties(operands):
    call_log.start()
    jax.block_until_ready(_chain(*operands))
    assert len(call_log.stop()) == 4
    jax.block_until_ready(_chain(*operands))
    assert len(call_log.records()) == 4
    call_log.start()
    assert len(call_log.records()) == 0
    assert len(call_log.stop()) == 0


def test_a_call_handed_to_the_pool_is_stamped_by_its_last_task():
    """A GEMM large enough for helpers, entered on this (non-pool) thread, returns a future
    that its pool tasks complete (pool_dispatch.h): the last of them stamps the end, before the
    argmax that reads the product is entered."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(packed_gemm.pack(rng.standard_normal((576, 960)).astype(jnp.bfloat16)))
    x = jnp.asarray(rng.standard_normal((64, 576)), jnp.bfloat16)
    fn = jax.jit(lambda x, w: first_argmax.first_argmax(packed_gemm.matmul(x, w)))
    jax.block_until_ready(fn(x, w))
    call_log.start()
    jax.block_until_ready(fn(x, w))
    records = call_log.stop()
    assert [call_log.KERNELS[k] for k in records[:, 0]] == ["gemm", "argmax"]
    np.testing.assert_array_equal(records[0, 1:4], [64, 576, 960])
    assert 0 < records[0, 4] <= records[0, 5] <= records[1, 4] <= records[1, 5]
    tasks, threads = records[0, 6], records[0, 7]
    assert 1 <= tasks <= threads, (tasks, threads)


def test_decode_and_prefill_never_schedule_more_tasks_than_the_pool_has():
    """A decode call of many units, entered off the pool, schedules one task per pool thread
    at most (it used to schedule one more than the pool had)."""
    rng = np.random.default_rng(2)
    rows, heads, kv_heads, dim, block = 16, 8, 4, 64, 16
    q = jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((kv_heads, rows + 1, block, dim)), jnp.float32)
    slot = jnp.asarray(np.arange(rows + 1), jnp.int32)          # one item a row, one padding
    pages = jnp.asarray(np.arange(1, rows + 2)[:, None] % (rows + 1), jnp.int32)
    first = jnp.zeros((rows + 1,), jnp.int32)
    lengths = jnp.full((rows,), block, jnp.int32)
    fn = jax.jit(paged_decode.paged_decode_attention)
    jax.block_until_ready(fn(q, k, k, slot, pages, first, lengths))
    call_log.start()
    jax.block_until_ready(fn(q, k, k, slot, pages, first, lengths))
    records = call_log.stop()
    assert [call_log.KERNELS[k] for k in records[:, 0]] == ["decode attention"]
    tasks, threads = records[0, 6], records[0, 7]
    assert threads >= 1 and tasks <= threads, (tasks, threads)
