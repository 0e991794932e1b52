"""A bf16-bits (uint16) pool's key layout (`pallas_kernels/reference.py`, KEY_GROUP): keys are
written in groups stored dim-pair-major, every reader gets them back in key order, and the CPU
decode kernel over a pool written that way attends to the keys that were written (checked
against the oracle over a float32 pool in the plain layout)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_decode
from pallas_kernels.reference import (BF16_BITS, key_group, keys_as_stored, keys_in_order,
                                      pages_as_float, paged_decode_attention_ref, write_kv_ref)
from pallas_kernels.xla_paged_attention import decode_work_items

SHAPES = [(16, 64), (32, 16), (8, 16), (4, 80)]          # (block_size, head_dim)


def _written(block_size, head_dim, seed=0, kv_heads=2, blocks=6):
    """k, v [T, KVH, D] written at shuffled slots of a zeroed uint16 pool."""
    rng = np.random.default_rng(seed)
    tokens = blocks * block_size - 3
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    k = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), jnp.float32)
    pool = jnp.zeros((kv_heads, blocks, block_size, head_dim), BF16_BITS)
    return k, v, slots, write_kv_ref(pool, pool, k, v, jnp.asarray(slots))


def _bits(x):
    return np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)


@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_keys_are_stored_in_dim_pair_major_groups(block_size, head_dim):
    """Key i of a group, dims (2p, 2p + 1), at (p * group + i) * 2 of the group: the layout the
    C++ kernels read."""
    k, _, slots, (k_pages, _) = _written(block_size, head_dim)
    group, pool = key_group(block_size), np.asarray(k_pages)
    for t in (0, 1, len(slots) // 2, len(slots) - 1):
        block, offset = divmod(int(slots[t]), block_size)
        first, i = divmod(offset, group)
        stored = pool[:, block].reshape(pool.shape[0], -1)[:, first * group * head_dim:]
        for p in (0, head_dim // 2 - 1):
            for e in (0, 1):
                np.testing.assert_array_equal(stored[:, (p * group + i) * 2 + e],
                                              _bits(k[t, :, 2 * p + e]))


@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_readers_get_keys_back_in_order_and_values_are_plain(block_size, head_dim):
    k, v, slots, (k_pages, v_pages) = _written(block_size, head_dim, seed=1)
    heads, blocks = k_pages.shape[:2]
    keys = pages_as_float(keys_in_order(k_pages, block_size)).reshape(heads, -1, head_dim)
    values = pages_as_float(v_pages).reshape(heads, -1, head_dim)
    rounded = lambda x: np.swapaxes(np.asarray(x.astype(jnp.bfloat16), np.float32), 0, 1)
    np.testing.assert_array_equal(np.asarray(keys)[:, slots], rounded(k))
    np.testing.assert_array_equal(np.asarray(values)[:, slots], rounded(v))
    np.testing.assert_array_equal(np.asarray(keys_as_stored(keys_in_order(k_pages, block_size),
                                                            block_size)), np.asarray(k_pages))


def test_pages_the_grouping_cannot_take_are_refused():
    assert key_group(48) == 16 and key_group(4) == 4
    with pytest.raises(ValueError, match="multiple of 16"):
        key_group(24)


def test_float_pools_keep_the_plain_layout():
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    pool = jnp.zeros((2, 3, 16, 16), jnp.float32)
    k_pages, _ = write_kv_ref(pool, pool, k, k, jnp.arange(5, dtype=jnp.int32) + 16)
    np.testing.assert_array_equal(np.asarray(k_pages[:, 1, :5]), np.swapaxes(np.asarray(k), 0, 1))


@pytest.mark.skipif(paged_decode.unavailable_reason() is not None,
                    reason=f"CPU kernel unavailable: {paged_decode.unavailable_reason()}")
# (4, 34): pages shorter than a group, and an odd number of dim pairs (Scores' last pair alone)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 16), (32, 80), (4, 34)])
def test_the_kernel_over_written_keys_matches_the_oracle_over_a_plain_pool(block_size,
                                                                           head_dim):
    """Writer and kernel together: attention over what was written, not over the layout."""
    rng = np.random.default_rng(3)
    heads, kv_heads, rows, blocks = 6, 2, 3, 12
    per_row = blocks // rows
    lengths = np.array([per_row * block_size, block_size + 3, 5])
    tables = np.arange(blocks, dtype=np.int32).reshape(rows, per_row)
    slots = np.concatenate([tables[r, np.arange(n) // block_size] * block_size
                            + np.arange(n) % block_size for r, n in enumerate(lengths)])
    k = jnp.asarray(rng.standard_normal((len(slots), kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(slots), kv_heads, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((rows, heads, head_dim)), jnp.bfloat16)
    slots = jnp.asarray(slots, jnp.int32)
    shape = (kv_heads, blocks, block_size, head_dim)
    bits = write_kv_ref(jnp.zeros(shape, BF16_BITS), jnp.zeros(shape, BF16_BITS), k, v, slots)
    plain = write_kv_ref(jnp.zeros(shape), jnp.zeros(shape),
                         k.astype(jnp.bfloat16).astype(jnp.float32),
                         v.astype(jnp.bfloat16).astype(jnp.float32), slots)
    items = decode_work_items([(r, tables[r].tolist(), int(lengths[r])) for r in range(rows)],
                              rows, block_size, 8)
    lens = jnp.asarray(lengths, jnp.int32)
    out = paged_decode.paged_decode_attention(q, *bits, *(jnp.asarray(a) for a in items), lens)
    ref = paged_decode_attention_ref(q.astype(jnp.float32), *plain, jnp.asarray(tables), lens)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref)
    assert np.abs(out32 - ref32).max() / np.abs(ref32).max() < 1e-2
