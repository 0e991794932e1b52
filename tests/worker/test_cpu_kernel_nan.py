"""A NaN score propagates through the CPU attention kernels' softmax as through their jnp
references (`pallas_kernels/xla_paged_attention.py`): every output a NaN key, value or query
reaches is NaN, and no other one, whatever lane the NaN falls in (the kernels' max and exp used
to drop it or turn it into inf depending on the lane order). Skipped where the kernels cannot
run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_decode, paged_prefill
from pallas_kernels.reference import BF16_BITS, keys_as_stored
from pallas_kernels.xla_paged_attention import (decode_work_items, paged_decode_attention_xla,
                                                tiled_prefill_attention_xla)

REASON = paged_decode.unavailable_reason() or paged_prefill.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

BS, KVH, HEADS, D = 16, 2, 8, 32


def _bits(a):
    return jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), BF16_BITS)


def _same_nans_and_close(out, ref, tol, seen=None):
    """NaN in `out` exactly where in `ref` (within `seen`, [T] bool: the tokens that see the
    NaN; the prefill reference also carries a NaN value into tokens that do not see its key,
    0 * NaN in its p.V, where the kernel never reads it), close elsewhere."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    expected = np.isnan(ref)
    if seen is not None:
        expected &= seen[:, None, None]
        ref = np.where(expected | ~np.isnan(ref), ref, out)
    np.testing.assert_array_equal(np.isnan(out), expected)
    assert expected.any() and not np.isinf(out).any()
    ok = ~expected
    assert np.abs(out - ref)[ok].max() <= tol * np.abs(ref[ok]).max()


def _decode_case(dtype):
    rng = np.random.default_rng(5)
    lengths = np.array([70, 33, 50], np.int32)
    tables = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8], 2: [9, 10, 11, 12]}
    items = decode_work_items([(r, t, int(lengths[r])) for r, t in tables.items()], 3, BS, 8, 2)
    k = rng.standard_normal((KVH, 13, BS, D)).astype(np.float32)
    v = rng.standard_normal((KVH, 13, BS, D)).astype(np.float32)
    q = rng.standard_normal((3, HEADS, D)).astype(np.float32)
    return q, k, v, [jnp.asarray(a) for a in items], jnp.asarray(lengths)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("where", ["key", "value", "query"])
@pytest.mark.parametrize("lane", [0, 5, 15])
def test_decode_propagates_nan_as_its_reference(dtype, where, lane):
    q, k, v, items, lengths = _decode_case(dtype)
    if where == "key":       # row 0, kv head 1: block 3 (keys 32..47), key 32 + lane
        k[1, 3, lane, 7] = np.nan
    elif where == "value":
        v[1, 3, lane, 7] = np.nan
    else:                    # row 1's head 2 (kv head 0)
        q[1, 2, 7] = np.nan
    if dtype == jnp.bfloat16:
        qa = jnp.asarray(q, jnp.bfloat16)
        ka, va = keys_as_stored(_bits(k), BS), _bits(v)
        tol = 2e-2
    else:
        qa, ka, va, tol = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 2e-5
    out = paged_decode.paged_decode_attention(qa, ka, va, *items, lengths, scale=0.3)
    ref = paged_decode_attention_xla(qa, ka, va, *items, lengths, scale=0.3)
    _same_nans_and_close(out, ref, tol)


@pytest.mark.parametrize("where", ["key", "value", "query"])
@pytest.mark.parametrize("lane", [0, 9])
def test_prefill_propagates_nan_as_its_reference(where, lane):
    rng = np.random.default_rng(6)
    pos = np.arange(20, 52, dtype=np.int32)                   # two tiles of one sequence
    table = np.tile(np.arange(1, 5, dtype=np.int32), (2, 1))
    q = rng.standard_normal((len(pos), HEADS, D)).astype(np.float32)
    k = rng.standard_normal((KVH, 6, BS, D)).astype(np.float32)
    v = rng.standard_normal((KVH, 6, BS, D)).astype(np.float32)
    if where == "key":       # kv head 0, position 32 + lane (table page 2 = block 3)
        k[0, 3, lane, 3] = np.nan
    elif where == "value":   # position `lane` (block 1), seen by every token (a NaN value
        v[0, 1, lane, 3] = np.nan    # of a key unseen by some tokens of a 16-row block
    else:                            # reaches them as 0 * NaN, as in the reference's tiles)
        q[20 + lane % 12, 1, 3] = np.nan
    qa, ka, va = jnp.asarray(q, jnp.bfloat16), keys_as_stored(_bits(k), BS), _bits(v)
    args = (qa, ka, va, jnp.asarray(pos), jnp.asarray(table))
    out = paged_prefill.paged_prefill_attention(*args, scale=0.3)
    ref = tiled_prefill_attention_xla(*args, scale=0.3)
    seen = pos >= 32 + lane if where == "key" else None
    _same_nans_and_close(out, ref, 2e-2, seen)
