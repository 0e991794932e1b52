"""Every attention backend on an int8 KV pool equals the reference attention over the
dequantized (float) pool: xla (the CPU path), the reference itself, and the Pallas decode and
ragged kernels in interpret mode. GQA, randomly permuted block tables, lengths off the page
boundary, empty slots; every page slot a test does not fill holds random int8 values and a NaN
scale, so a masked key or value that reaches arithmetic shows up as NaN.

Lowering of the int8 kernels for the cuda platform: tests/worker/test_lowering.py.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.worker import attention
from pallas_kernels.int8 import dequantize_int8, quantize_int8
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import paged_decode_attention_ref, ragged_paged_attention_ref
from pallas_kernels.xla_paged_attention import (PREFILL_TILE, decode_work_items,
                                                tiled_prefill_attention_xla)
from paged_inputs import fill_pages, nan_pool, random_tables
from paged_inputs import SeededRng

# f32: scales applied to scores/probabilities instead of values reorders roundings only.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@pytest.fixture
def rng():
    return SeededRng(int(os.environ.get("KERNEL_TEST_SEED",
                                         int.from_bytes(os.urandom(4), "little"))))


def int8_pool(rng, k, v):
    """Float pages with NaN where unfilled -> (int8 k, int8 v, k_scales, v_scales) with random
    int8 values and NaN scales there, and the dequantized float pool the oracle reads."""
    out = []
    for pages in (k, v):
        filled = np.isfinite(pages).all(axis=-1)
        q, s = quantize_int8(np.where(np.isfinite(pages), pages, 0.0))
        q = np.where(filled[..., None], q, rng.integers(-127, 128, q.shape)).astype(np.int8)
        s = np.where(filled, s, np.nan).astype(np.float32)
        out.append((q, s))
    (kq, ks), (vq, vs) = out
    deq = tuple(np.asarray(dequantize_int8(q, s)) for q, s in ((kq, ks), (vq, vs)))
    return tuple(jnp.asarray(a) for a in (kq, vq, ks, vs)), deq


def _check(out, ref, dtype, seed, empty_rows=()):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.isfinite(out).all(), f"seed={seed}: NaN leaked into the output"
    assert np.isfinite(ref).all(), f"seed={seed}: the oracle is not finite"
    for rows in empty_rows:
        assert (out[rows] == 0).all(), f"seed={seed}: rows {rows} must be zero"
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < TOLERANCE[dtype], f"seed={seed}: relative error {err:.3g}"


def _decode_inputs(rng, num_heads, num_kv_heads, head_dim, block_size, dtype):
    batch, pages_per_seq = 5, 5
    context = pages_per_seq * block_size
    lengths = rng.integers(1, context + 1, batch)
    lengths[0] = 0                                                            # empty slot
    lengths[1] = rng.integers(1, pages_per_seq) * block_size + rng.integers(1, block_size)
    lengths[2] = context
    tables, num_blocks = random_tables(rng, lengths, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i in range(batch):
        fill_pages(rng, k, v, tables[i], lengths[i])
    pool, (k_deq, v_deq) = int8_pool(rng, k, v)
    q = jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), dtype)
    ref = paged_decode_attention_ref(q, jnp.asarray(k_deq), jnp.asarray(v_deq),
                                     jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
    return q, pool, tables, lengths, ref


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (4, 4, 64, 16, jnp.float32),        # MHA
    (6, 2, 64, 16, jnp.float32),        # GQA 3
    (8, 1, 64, 32, jnp.bfloat16),       # GQA 8
    (9, 3, 64, 16, jnp.bfloat16),       # SmolLM2's heads
]


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas_interpret"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", DECODE_CASES)
def test_decode_on_int8_pool_equals_reference_over_dequantized_pool(
        rng, backend, num_heads, num_kv_heads, head_dim, block_size, dtype):
    q, pool, tables, lengths, ref = _decode_inputs(rng, num_heads, num_kv_heads, head_dim,
                                                   block_size, dtype)
    lengths_j = jnp.asarray(lengths, jnp.int32)
    if backend == "xla":
        items = decode_work_items([(i, list(tables[i]), int(n)) for i, n in enumerate(lengths)],
                                  len(lengths), block_size, bucket=16, pages_per_item=2)
        meta = tuple(jnp.asarray(a) for a in items) + (lengths_j,)
    else:
        meta = (jnp.asarray(tables), lengths_j)
    attend = attention.get_backend(backend).decode_attend(meta, head_dim ** -0.5)
    out = attend(q, pool[0], pool[1], jnp.int32(0), scales=pool[2:])
    _check(out, ref, dtype, rng.seed, empty_rows=[0])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_splits_on_int8_pool(rng, num_splits):
    q, pool, tables, lengths, ref = _decode_inputs(rng, 8, 2, 64, 16, jnp.float32)
    out = paged_decode_attention(q, pool[0], pool[1], jnp.asarray(tables),
                                 jnp.asarray(lengths, jnp.int32), k_scales=pool[2],
                                 v_scales=pool[3], num_splits=num_splits,
                                 pages_per_compute_block=1, interpret=True)
    _check(out, ref, jnp.float32, rng.seed, empty_rows=[0])


RAGGED_CASES = [
    (6, 2, 64, 16, jnp.float32, None),
    (8, 2, 64, 32, jnp.bfloat16, 4),
    (9, 3, 64, 16, jnp.float32, 8),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,block_q", RAGGED_CASES)
def test_ragged_kernel_and_oracle_on_int8_pool(rng, num_heads, num_kv_heads, head_dim,
                                               block_size, dtype, block_q):
    max_seqs, pages_per_seq, num_tokens = 5, 4, 48
    context = pages_per_seq * block_size
    q_lens = np.array([1, rng.integers(17, 26), 0, rng.integers(2, 9), 7])
    num_seqs = 4                                    # the last sequence is padding
    kv_lens = np.array([rng.integers(q, context + 1) for q in q_lens])
    kv_lens[2] = rng.integers(1, context)
    kv_lens[3] = q_lens[3]
    cu = np.concatenate([[0], np.cumsum(q_lens[:num_seqs])])
    cu = np.concatenate([cu, [cu[-1] + 3]]).astype(np.int32)
    tables, num_blocks = random_tables(rng, kv_lens[:num_seqs], pages_per_seq, block_size)
    tables = np.concatenate([tables, rng.integers(0, num_blocks, (1, pages_per_seq))]).astype(np.int32)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i in range(num_seqs):
        fill_pages(rng, k, v, tables[i], kv_lens[i])
    pool, (k_deq, v_deq) = int8_pool(rng, k, v)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype)
    meta = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
            jnp.int32(num_seqs))
    ref = ragged_paged_attention_ref(q, jnp.asarray(k_deq), jnp.asarray(v_deq), *meta)
    padding = [slice(int(cu[num_seqs]), None)]
    scales = dict(k_scales=pool[2], v_scales=pool[3])
    _check(ragged_paged_attention(q, pool[0], pool[1], *meta, block_q=block_q, interpret=True,
                                  **scales), ref, dtype, rng.seed, padding)
    _check(ragged_paged_attention_ref(q, pool[0], pool[1], *meta, **scales), ref, dtype,
           rng.seed, padding)


@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(6, 2, jnp.float32),
                                                          (8, 1, jnp.bfloat16)])
def test_xla_prefill_tiles_on_int8_pool(rng, num_heads, num_kv_heads, dtype):
    """Two chunks in query tiles (the CPU prefill path), one continuing a cached context."""
    head_dim, block_size, pages_per_seq = 64, 16, 4
    chunks = [(0, 21), (30, 11)]                    # (first position, length) per sequence
    lengths = [start + n for start, n in chunks]
    tables, num_blocks = random_tables(rng, lengths, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i, n in enumerate(lengths):
        fill_pages(rng, k, v, tables[i], n)
    pool, (k_deq, v_deq) = int8_pool(rng, k, v)
    query_pos, tile_pages = [], []
    for i, (start, n) in enumerate(chunks):
        tiles = -(-n // PREFILL_TILE)
        pos = np.full(tiles * PREFILL_TILE, -1)
        pos[:n] = np.arange(start, start + n)
        query_pos.append(pos)
        tile_pages += [tables[i]] * tiles
    query_pos = jnp.asarray(np.concatenate(query_pos), jnp.int32)
    tile_pages = jnp.asarray(np.stack(tile_pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((query_pos.shape[0], num_heads, head_dim)), dtype)
    out = tiled_prefill_attention_xla(q, pool[0], pool[1], query_pos, tile_pages,
                                      k_scales=pool[2], v_scales=pool[3])
    ref = tiled_prefill_attention_xla(q, jnp.asarray(k_deq), jnp.asarray(v_deq), query_pos,
                                      tile_pages)
    # The float path is itself checked against the oracle in tests/worker/test_xla_attention.py.
    _check(out, ref, dtype, rng.seed, empty_rows=[np.asarray(query_pos) < 0])


def test_kernels_reject_inconsistent_int8_inputs():
    q = jnp.zeros((2, 4, 64), jnp.float32)
    pages = jnp.zeros((2, 4, 16, 64), jnp.int8)
    scales = jnp.zeros((2, 4, 16), jnp.float32)
    tables, lengths = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32)
    call = lambda **kw: paged_decode_attention(q, kw.pop("k", pages), kw.pop("v", pages), tables,
                                               lengths, interpret=True, **kw)
    with pytest.raises(ValueError, match="float32 or bfloat16 \\(or int8 with scales\\)"):
        call()
    with pytest.raises(ValueError, match="needs both k_scales and v_scales"):
        call(k_scales=scales)
    with pytest.raises(ValueError, match="k_scales must be"):
        call(k_scales=scales[..., :8], v_scales=scales)
    with pytest.raises(ValueError, match="v_scales must be float32"):
        call(k_scales=scales, v_scales=scales.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="k_pages must be int8"):
        call(k=pages.astype(jnp.float32), v=pages.astype(jnp.float32), k_scales=scales,
             v_scales=scales)
