"""The XLA-CPU paged attention (`pallas_kernels/xla_paged_attention.py`) against the plain-jnp
oracles in `pallas_kernels/reference.py`.

Inputs are random with a fixed seed per case (the seed is in every failure message). Every pool
slot a test does not fill holds NaN: the null block 0, unused pages, spare pages that unused
block-table entries point at, and the tail of each sequence's last page, so any masked key or
value that reaches arithmetic shows up as a non-finite output.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import paged_decode_attention_ref, ragged_paged_attention_ref
from pallas_kernels.xla_paged_attention import (PAGES_PER_ITEM, PREFILL_TILE, decode_work_items,
                                                num_decode_items, paged_decode_attention_xla,
                                                tiled_prefill_attention_xla)
from paged_inputs import fill_pages, nan_pool, random_tables

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# Eager jnp pays a compile per op and shape (seconds per call here); under jit a case costs a
# fraction of that, so the comparisons run jitted and eager is checked against jit below. A
# custom scale is traced, so all its values share one compile.
_decode = jax.jit(paged_decode_attention_xla)
_prefill = jax.jit(tiled_prefill_attention_xla)
_decode_ref = jax.jit(paged_decode_attention_ref)
_ragged_ref = jax.jit(ragged_paged_attention_ref)


# --- helpers ---------------------------------------------------------------------------------

def _cdiv(a, b):
    return -(-int(a) // b)


def _np32(x):
    return np.asarray(x).astype(np.float32)


def _rel_err(out, ref):
    out, ref = _np32(out), _np32(ref)
    return np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)


def _check(out, ref, dtype, seed, what=""):
    out, ref = _np32(out), _np32(ref)
    assert out.shape == ref.shape, f"seed={seed}{what}: shape {out.shape} vs {ref.shape}"
    assert np.isfinite(out).all(), f"seed={seed}{what}: NaN/inf leaked into the output"
    assert np.isfinite(ref).all(), f"seed={seed}{what}: the reference itself is not finite"
    err = _rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"seed={seed}{what}: relative error {err:.3g}"


# --- decode ----------------------------------------------------------------------------------

def _decode_case(seed, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_items,
                 pages_per_item=PAGES_PER_ITEM):
    """Eight slots: empty ones, length 1, a long one, exact page multiples and ragged tails.
    Returns (args for the XLA function, args for the oracle, lengths)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = 5
    lengths = np.array([
        rng.integers(2, block_size),                                            # < one page
        0,                                                                      # empty
        1,                                                                      # one token
        (pages_per_seq - 1) * block_size + rng.integers(1, block_size),         # long, ragged
        rng.integers(1, pages_per_seq) * block_size,                            # page multiple
        0,                                                                      # empty
        rng.integers(1, 3) * block_size + rng.integers(1, block_size),          # ragged
        rng.integers(1, pages_per_seq * block_size + 1),                        # anything
    ])
    num_slots = len(lengths)
    tables, num_blocks = random_tables(rng, lengths, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i in range(num_slots):
        fill_pages(rng, k, v, tables[i], lengths[i])
    q = rng.standard_normal((num_slots, num_heads, head_dim))

    # Work list: non-empty slots only, handed over in shuffled order; the table rows are passed
    # whole (their unused tail points at block 0 or at NaN spare pages).
    live = [(int(s), tables[s].tolist(), int(lengths[s])) for s in rng.permutation(num_slots)
            if lengths[s] > 0]
    needed = num_decode_items(lengths, block_size, pages_per_item)
    bucket = max(1, needed + extra_items)
    items = decode_work_items(live, num_slots, block_size, bucket, pages_per_item)
    assert [a.shape for a in items] == [(bucket,), (bucket, pages_per_item), (bucket,)]
    assert all(a.dtype == np.int32 for a in items)

    # The oracle's tables: block tables padded with 0 (the null block, NaN here).
    ref_tables = np.zeros_like(tables)
    for i, n in enumerate(lengths):
        ref_tables[i, :_cdiv(n, block_size)] = tables[i, :_cdiv(n, block_size)]

    q, k, v = (jnp.asarray(a, dtype) for a in (q, k, v))
    len_j = jnp.asarray(lengths, jnp.int32)
    xla_args = (q, k, v, *(jnp.asarray(a) for a in items), len_j)
    ref_args = (q, k, v, jnp.asarray(ref_tables), len_j)
    return xla_args, ref_args, lengths


DECODE_CASES = [
    # (seed, num_heads, num_kv_heads, head_dim, block_size, dtype, padding items, pages/item)
    (11, 4, 4, 64, 16, jnp.float32, 5, 1),       # GQA 1, one page per item
    (12, 9, 3, 64, 32, jnp.float32, 17, 2),      # GQA 3, long slots span several items
    (13, 8, 2, 128, 16, jnp.float32, 0, 8),      # GQA 4, bucket exactly full
    (14, 4, 4, 128, 32, jnp.bfloat16, 9, 2),     # GQA 1
    (15, 9, 3, 128, 16, jnp.bfloat16, 3, 1),     # GQA 3
    (16, 8, 2, 64, 32, jnp.bfloat16, 12, 8),     # GQA 4
]


@pytest.mark.parametrize("seed,num_heads,num_kv_heads,head_dim,block_size,dtype,extra,ppi",
                         DECODE_CASES)
def test_decode_matches_reference(seed, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                  extra, ppi):
    xla_args, ref_args, lengths = _decode_case(seed, num_heads, num_kv_heads, head_dim,
                                               block_size, dtype, extra, ppi)
    out = _decode(*xla_args)
    assert out.dtype == dtype
    _check(out, _decode_ref(*ref_args), dtype, seed)
    empty = np.flatnonzero(lengths == 0)
    assert (_np32(out)[empty] == 0).all(), \
        f"seed={seed}: empty slots {empty} must give exactly zero"


def test_decode_custom_scale():
    seed, dtype = 21, jnp.float32
    xla_args, ref_args, _ = _decode_case(seed, 9, 3, 64, 16, dtype, 4)
    outs = {}
    for scale in (0.3, 1.7):
        outs[scale] = _decode(*xla_args, scale=jnp.float32(scale))
        _check(outs[scale], _decode_ref(*ref_args, scale=jnp.float32(scale)), dtype, seed,
               f" scale={scale}")
    assert _rel_err(outs[0.3], outs[1.7]) > 0.1, "the scale is ignored"


def test_decode_all_slots_empty():
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    pool = jnp.full((2, 4, 16, 64), jnp.nan, jnp.float32)
    items = decode_work_items([], 3, 16, 4)
    out = _decode(q, pool, pool, *(jnp.asarray(a) for a in items), jnp.zeros(3, jnp.int32))
    assert (np.asarray(out) == 0).all()


def test_decode_work_items_layout():
    block_size, num_slots = 16, 5
    live = [(3, [7, 2, 9, 0], 33), (0, [4, 0, 0, 0], 16), (2, [5, 6, 0, 0], 17)]
    item_slot, item_pages, item_first = decode_work_items(live, num_slots, block_size, 16, 1)
    n = num_decode_items([33, 16, 17], block_size, 1)
    assert n == 6
    np.testing.assert_array_equal(item_slot[:n], [0, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(item_pages[:n, 0], [4, 5, 6, 7, 2, 9])
    np.testing.assert_array_equal(item_first[:n], [0, 0, 16, 0, 16, 32])
    assert (item_slot[n:] == num_slots).all()
    # Two pages per item: slot 3's three pages make two items, the second half empty.
    item_slot, item_pages, item_first = decode_work_items(live, num_slots, block_size, 8, 2)
    n = num_decode_items([33, 16, 17], block_size, 2)
    assert n == 4
    np.testing.assert_array_equal(item_slot[:n], [0, 2, 3, 3])
    np.testing.assert_array_equal(item_pages[:n], [[4, 0], [5, 6], [7, 2], [9, 0]])
    np.testing.assert_array_equal(item_first[:n], [0, 0, 0, 32])
    assert (item_slot[n:] == num_slots).all()


@pytest.mark.parametrize("seed,block_size", [(41, 16), (42, 32), (43, 1)])
def test_num_decode_items(seed, block_size):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 200, 20)
    lengths[:4] = [0, 1, block_size, block_size + 1]
    for ppi in (1, 3, PAGES_PER_ITEM):
        want = sum(int(np.ceil(n / (block_size * ppi))) for n in lengths)
        assert num_decode_items(lengths, block_size, ppi) == want
        assert num_decode_items(lengths.tolist(), block_size, ppi) == want
        assert num_decode_items([], block_size, ppi) == 0


def _decode_rows(seed, rows, dtype):
    """Decode attention of the given rows of one fixed population (20 sequences of 1 to 12
    pages, 2 pages per item, so rows straddle the loop's item blocks), computed in one call
    holding only those rows (at least 4, as the runner pads), with a bucket of its own size."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads, head_dim, block_size, ppi, pages_per_seq = 8, 2, 64, 16, 2, 12
    lengths = rng.integers(1, pages_per_seq * block_size + 1, 20)
    tables, num_blocks = random_tables(rng, lengths, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i, n in enumerate(lengths):
        fill_pages(rng, k, v, tables[i], n)
    q_all = rng.standard_normal((len(lengths), num_heads, head_dim))
    num_rows = max(4, len(rows))
    q = np.zeros((num_rows, num_heads, head_dim))
    q[:len(rows)] = q_all[rows]
    row_lengths = np.zeros(num_rows, np.int32)
    row_lengths[:len(rows)] = lengths[rows]
    live = [(j, tables[r].tolist(), int(lengths[r])) for j, r in enumerate(rows)]
    bucket = num_decode_items(row_lengths, block_size, ppi) + len(rows)
    items = decode_work_items(live, num_rows, block_size, bucket, ppi)
    # q stays float32 so that the output is not rounded to the pool's dtype, which would hide
    # differences in how a row was summed.
    out = _decode(jnp.asarray(q, jnp.float32), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                  *(jnp.asarray(a) for a in items), jnp.asarray(row_lengths))
    return _np32(out)[:len(rows)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_rows_are_bit_identical_whatever_shares_their_call(dtype):
    """Batch invariance: a row's output may not depend on the rows beside it, through the
    call's size or through where its items fall in the work list (a bf16 activation rounded
    from differently summed float32 can round the other way)."""
    everyone = _decode_rows(81, list(range(20)), dtype)
    assert np.isfinite(everyone).all()
    for rows in ([3], [7, 0], [19, 2, 11, 5, 8, 13], list(range(20))[::-1]):
        some = _decode_rows(81, rows, dtype)
        for j, r in enumerate(rows):
            assert (some[j] == everyone[r]).all(), f"row {r} differs when called with rows {rows}"


# --- prefill tiles ---------------------------------------------------------------------------

def _prefill_case(seed, num_heads, num_kv_heads, head_dim, block_size, dtype, chunks,
                  extra_tiles):
    """chunks: (start, length) per sequence; the chunk's KV (positions < start + length) is in
    the pool. Returns (xla args, oracle args, spans): spans[i] = (row in the tiled layout, row
    in the oracle's contiguous layout, length)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array([s + n for s, n in chunks])
    pages_per_seq = max(_cdiv(n, block_size) for n in kv_lens) + 1
    tables, num_blocks = random_tables(rng, kv_lens, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i, n in enumerate(kv_lens):
        fill_pages(rng, k, v, tables[i], n)

    tiles_per_chunk = [_cdiv(n, PREFILL_TILE) for _, n in chunks]
    num_tiles = sum(tiles_per_chunk) + extra_tiles
    num_tokens = num_tiles * PREFILL_TILE
    q_tiled = np.full((num_tokens, num_heads, head_dim), np.nan)   # padding rows hold NaN
    query_pos = np.full(num_tokens, -1, np.int32)
    tile_pages = np.zeros((num_tiles, pages_per_seq), np.int32)
    total = sum(n for _, n in chunks)
    q_ref = np.zeros((total, num_heads, head_dim))
    cu = np.zeros(len(chunks) + 1, np.int32)
    spans, tile, row = [], 0, 0
    for i, ((start, n), t) in enumerate(zip(chunks, tiles_per_chunk)):
        qc = rng.standard_normal((n, num_heads, head_dim))
        base = tile * PREFILL_TILE
        q_tiled[base:base + n] = qc
        query_pos[base:base + n] = start + np.arange(n)
        tile_pages[tile:tile + t] = tables[i]
        q_ref[row:row + n] = qc
        cu[i + 1] = row + n
        spans.append((base, row, n))
        tile += t
        row += n

    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    xla_args = (jnp.asarray(q_tiled, dtype), k, v, jnp.asarray(query_pos),
                jnp.asarray(tile_pages))
    ref_args = (jnp.asarray(q_ref, dtype), k, v, jnp.asarray(kv_lens, jnp.int32),
                jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(chunks)))
    return xla_args, ref_args, spans


PREFILL_CASES = [
    # (seed, heads, kv_heads, head_dim, block_size, dtype, [(start, length)], padding tiles)
    (51, 4, 4, 64, 16, jnp.float32, [(0, 21), (37, 9)], 0),
    (52, 9, 3, 64, 32, jnp.float32, [(45, 30), (0, 5), (70, 1)], 1),
    (53, 8, 2, 128, 16, jnp.float32, [(16, 17), (0, 33), (3, 14), (50, 2)], 2),
    (54, 9, 3, 128, 16, jnp.bfloat16, [(5, 27), (0, 3), (64, 16)], 0),
    (55, 4, 4, 128, 32, jnp.bfloat16, [(33, 7), (0, 19), (1, 45), (80, 12)], 1),
    # contexts of several loop blocks (PREFILL_BLOCK_KEYS each), ending mid-block
    (56, 9, 3, 64, 16, jnp.float32, [(300, 20), (0, 40), (130, 5)], 1),
]

@pytest.mark.parametrize("seed,num_heads,num_kv_heads,head_dim,block_size,dtype,chunks,extra",
                         PREFILL_CASES)
def test_prefill_tiles_match_reference(seed, num_heads, num_kv_heads, head_dim, block_size,
                                       dtype, chunks, extra):
    xla_args, ref_args, spans = _prefill_case(seed, num_heads, num_kv_heads, head_dim,
                                              block_size, dtype, chunks, extra)
    out = _prefill(*xla_args)
    assert out.dtype == dtype
    out, ref = _np32(out), _np32(_ragged_ref(*ref_args))
    out_np = out
    used = np.zeros(out_np.shape[0], bool)
    for i, (base, row, n) in enumerate(spans):
        _check(out[base:base + n], ref[row:row + n], dtype, seed, f" chunk {i}")
        used[base:base + n] = True
    assert (out_np[~used] == 0).all(), f"seed={seed}: padding rows must be exactly zero"


def test_prefill_dots_read_a_bf16_pool_as_bf16():
    """Both prefill dots (q.K and p.V, its probabilities rounded to bf16) take a bf16 pool's
    pages as bf16 and accumulate in f32: p.V over pages converted to float32 was slower on
    this CPU (docs/BENCHMARKS.md). A float32 pool keeps float32 dots."""
    for dtype, operand in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32")):
        xla_args, _, _ = _prefill_case(54, 9, 3, 128, 16, dtype, [(5, 27)], 0)
        text = jax.jit(tiled_prefill_attention_xla).lower(*xla_args).as_text()
        dots = re.findall(r"stablehlo\.dot_general .*: \(tensor<\S+x(\w+)>, tensor<\S+x(\w+)>\)"
                          r" -> tensor<\S+x(\w+)>", text)
        assert dots == [(operand, operand, "f32")] * 2, (dtype, dots)


def test_prefill_custom_scale():
    seed, dtype = 61, jnp.bfloat16
    xla_args, ref_args, spans = _prefill_case(seed, 8, 2, 64, 16, dtype, [(20, 13), (0, 18)], 1)
    for scale in (0.7, 0.05):
        out = _np32(_prefill(*xla_args, scale=jnp.float32(scale)))
        ref = _np32(_ragged_ref(*ref_args, scale=jnp.float32(scale)))
        for i, (base, row, n) in enumerate(spans):
            _check(out[base:base + n], ref[row:row + n], dtype, seed, f" chunk {i}")


def test_prefill_chunks_are_bit_identical_whatever_shares_their_call():
    """A chunk's attention may not depend on the other chunks packed into its call."""
    chunks = [(200, 16), (0, 48), (130, 80), (450, 32)]
    xla_args, _, spans = _prefill_case(91, 9, 3, 64, 16, jnp.float32, chunks, 0)
    together = _np32(_prefill(*xla_args))
    q, k, v, query_pos, tile_pages = xla_args
    for i in range(len(chunks)):
        base, _, n = spans[i]
        tiles = slice(base // PREFILL_TILE, (base + _cdiv(n, PREFILL_TILE) * PREFILL_TILE)
                      // PREFILL_TILE)
        rows = slice(base, base + _cdiv(n, PREFILL_TILE) * PREFILL_TILE)
        alone = _np32(_prefill(q[rows], k, v, query_pos[rows], tile_pages[tiles]))
        assert (alone[:n] == together[base:base + n]).all(), f"chunk {i} differs alone"


# --- jit -------------------------------------------------------------------------------------
# One eager call per case (eager is the slow path here); its result must agree with the jitted
# function the other tests use.

JIT_CASES = [(jnp.float32, None, 1e-6), (jnp.bfloat16, 0.3, 1e-2)]


@pytest.mark.parametrize("dtype,scale,tol", JIT_CASES[:1])
def test_decode_jit_matches_eager(dtype, scale, tol):
    xla_args, ref_args, lengths = _decode_case(71, 9, 3, 64, 16, dtype, 6)
    eager = paged_decode_attention_xla(*xla_args, scale=scale)
    jitted = jax.jit(functools.partial(paged_decode_attention_xla, scale=scale))(*xla_args)
    assert jitted.dtype == eager.dtype == dtype
    _check(eager, _decode_ref(*ref_args, scale=scale), dtype, 71, " eager")
    assert _rel_err(jitted, eager) < tol
    assert (_np32(eager)[lengths == 0] == 0).all()


@pytest.mark.parametrize("dtype,scale,tol", JIT_CASES[1:])
def test_prefill_jit_matches_eager(dtype, scale, tol):
    xla_args, _, spans = _prefill_case(72, 8, 2, 64, 16, dtype, [(20, 13), (0, 18), (7, 3)], 1)
    eager = tiled_prefill_attention_xla(*xla_args, scale=scale)
    jitted = jax.jit(functools.partial(tiled_prefill_attention_xla, scale=scale))(*xla_args)
    assert jitted.dtype == eager.dtype == dtype
    eager_np = _np32(eager)
    assert np.isfinite(eager_np).all()
    assert _rel_err(jitted, eager) < tol
    used = np.zeros(eager_np.shape[0], bool)
    for base, _, n in spans:
        used[base:base + n] = True
    assert (eager_np[~used] == 0).all() and (_np32(jitted)[~used] == 0).all()


def test_decode_work_items_rejects_a_bucket_too_small():
    with pytest.raises(ValueError, match="bucket 2 is too small"):
        decode_work_items([(0, [3, 4], 20), (1, [5], 7)], 2, 16, 2, 1)
