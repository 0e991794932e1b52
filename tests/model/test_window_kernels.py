"""Sliding-window attention in every backend: the reference, the xla (CPU) functions and the
Pallas kernels in interpret mode, float and int8 pools, against a plain numpy oracle that
masks each query's keys to p - window < pos <= p (Hugging Face's sliding-window mask).
Windows shorter than the context (1 key, a few, mid-page) and longer than it; one bound off
by one must be told apart (`test_an_off_by_one_window_is_visible`). Pools are NaN wherever
nothing was written, so a key outside the window that reaches arithmetic shows."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_inputs import fill_pages, nan_pool, random_tables
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import paged_decode_attention_ref, ragged_paged_attention_ref
from pallas_kernels.xla_paged_attention import (PREFILL_TILE, decode_work_items,
                                                paged_decode_attention_xla,
                                                tiled_prefill_attention_xla)

BLOCK, PAGES, HEADS, KV_HEADS, DIM = 16, 4, 4, 2, 64
CONTEXT = BLOCK * PAGES
WINDOWS = [1, 20, 1000]               # 1000: longer than any context here
SCALE = DIM ** -0.5


def _oracle(q, k, v, table, positions, length, window, scale=SCALE, cap=None):
    """numpy: each query row (position positions[i]) of one sequence over its keys."""
    pos = np.arange(length)
    keys = k[:, table[pos // BLOCK], pos % BLOCK].astype(np.float64)          # [KVH, n, D]
    vals = v[:, table[pos // BLOCK], pos % BLOCK].astype(np.float64)
    group = q.shape[1] // k.shape[0]
    out = np.zeros(q.shape)
    for i, p in enumerate(positions):
        ok = (pos <= p) & (pos > p - window)
        for h in range(q.shape[1]):
            s = keys[h // group, ok] @ q[i, h] * scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vals[h // group, ok]
    return out


def _decode_case(seed):
    rng = np.random.default_rng(seed)
    lengths = np.array([0, 5, 37, CONTEXT, 50])       # empty slot, mid-page, a full table
    tables, num_blocks = random_tables(rng, lengths, PAGES, BLOCK)
    k, v = nan_pool(KV_HEADS, num_blocks, BLOCK, DIM)
    for i, n in enumerate(lengths):
        fill_pages(rng, k, v, tables[i], n)
    q = rng.standard_normal((len(lengths), HEADS, DIM)).astype(np.float32)
    return q, k, v, tables, lengths


def _decode_oracle(case, window, cap=None):
    q, k, v, tables, lengths = case
    out = np.zeros(q.shape)
    for b, n in enumerate(lengths):
        if n:
            out[b] = _oracle(q[b:b + 1], k, v, tables[b], [n - 1], n, window, cap=cap)[0]
    return out


def _decode_backends(case, window, cap=None):
    q, k, v, tables, lengths = (jnp.asarray(a) for a in case)
    w = jnp.int32(window)
    items = decode_work_items([(b, list(case[3][b]), int(n)) for b, n in enumerate(case[4])],
                              len(case[4]), BLOCK, bucket=16, pages_per_item=2)
    items = [jnp.asarray(a) for a in items]
    yield "reference", paged_decode_attention_ref(q, k, v, tables, lengths, window=w,
                                                  soft_cap=cap)
    yield "xla", paged_decode_attention_xla(q, k, v, *items, lengths, window=w, soft_cap=cap)
    # Several splits where the window starts mid-table (interpret mode is slow: one per case).
    for splits in ((1, 3) if window == 20 else (1,)):
        yield f"pallas splits={splits}", paged_decode_attention(
            q, k, v, tables, lengths, window=w, soft_cap=cap, num_splits=splits,
            pages_per_compute_block=1, interpret=True)


def _close(name, out, ref, tol=2e-5):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), f"{name}: NaN leaked (a key outside the window was read)"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_backends_apply_the_window(window):
    case = _decode_case(seed=window)
    cap = 3.0 if window == 20 else None                       # Gemma 2 caps inside windows
    ref = _decode_oracle(case, window, cap=cap)
    for name, out in _decode_backends(case, window, cap=cap):
        _close(f"decode {name} window={window}", out, ref)
        assert (np.asarray(out)[0] == 0).all(), f"{name}: the empty slot must give zeros"


def _ragged_case(seed):
    """A decode token, a long chunk continuing a sequence, a chunk starting one."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.array([1, 29, 11]), np.array([45, 60, 11])
    tables, num_blocks = random_tables(rng, kv_lens, PAGES, BLOCK)
    k, v = nan_pool(KV_HEADS, num_blocks, BLOCK, DIM)
    for i, n in enumerate(kv_lens):
        fill_pages(rng, k, v, tables[i], n)
    q = rng.standard_normal((48, HEADS, DIM)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q[cu[-1]:] = np.nan                                       # padding tokens
    return q, k, v, tables, q_lens, kv_lens, cu


def _ragged_oracle(case, window):
    q, k, v, tables, q_lens, kv_lens, cu = case
    out = np.zeros(q.shape)
    for s in range(len(q_lens)):
        positions = kv_lens[s] - q_lens[s] + np.arange(q_lens[s])
        out[cu[s]:cu[s + 1]] = _oracle(q[cu[s]:cu[s + 1]], k, v, tables[s], positions,
                                       kv_lens[s], window)
    return out


def _tiles(case):
    """The xla prefill layout: each chunk padded to whole PREFILL_TILE tiles, a table per tile.
    Returns (q [T'], query_pos [T'], tile_pages, row of each packed token in q)."""
    q, _, _, tables, q_lens, kv_lens, cu = case
    rows, pos, tile_pages = [], [], []
    for s in range(len(q_lens)):
        n = -(-q_lens[s] // PREFILL_TILE) * PREFILL_TILE
        rows += list(range(cu[s], cu[s + 1])) + [-1] * (n - q_lens[s])
        pos += list(kv_lens[s] - q_lens[s] + np.arange(q_lens[s])) + [-1] * (n - q_lens[s])
        tile_pages += [tables[s]] * (n // PREFILL_TILE)
    rows = np.array(rows)
    q_tiled = np.where(rows[:, None, None] >= 0, q[np.maximum(rows, 0)], 0).astype(np.float32)
    return q_tiled, np.array(pos, np.int32), np.array(tile_pages, np.int32), rows


@pytest.mark.parametrize("window", WINDOWS)
def test_ragged_backends_apply_the_window(window):
    case = _ragged_case(seed=window)
    q, k, v, tables, _, kv_lens, cu = case
    ref = _ragged_oracle(case, window)
    valid = slice(0, int(cu[-1]))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(tables), jnp.asarray(cu), jnp.int32(len(kv_lens)))
    w = jnp.int32(window)
    outs = {"reference": ragged_paged_attention_ref(*args, window=w)}
    # Small q blocks and 1-page tiles: key loops that start mid-context; defaults once.
    block_q, tile = (None, None) if window == 1000 else (8, 1)
    outs["pallas"] = ragged_paged_attention(*args, window=w, block_q=block_q,
                                            pages_per_compute_block=tile, interpret=True)
    for name, out in outs.items():
        _close(f"ragged {name} window={window}", np.asarray(out)[valid], ref[valid])
        assert (np.asarray(out)[cu[-1]:] == 0).all(), f"{name}: padding must give zeros"
    q_tiled, pos, tile_pages, rows = _tiles(case)
    out = np.asarray(tiled_prefill_attention_xla(
        jnp.asarray(q_tiled), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
        jnp.asarray(tile_pages), window=w))
    _close(f"xla prefill window={window}", out[rows >= 0], ref[rows[rows >= 0]])


def _int8(case_k, case_v, seed):
    """int8 pages with float32 scales; NaN scales where nothing was written."""
    rng = np.random.default_rng(seed)
    written = np.isfinite(case_k[..., 0])
    pages = [np.where(np.isfinite(a), rng.integers(-127, 128, a.shape), 0).astype(np.int8)
             for a in (case_k, case_v)]
    scales = [np.where(written, rng.uniform(0.005, 0.02, written.shape), np.nan)
              .astype(np.float32) for _ in range(2)]
    return pages, scales


@pytest.mark.parametrize("window", [7, 20])
def test_int8_pools_apply_the_window(window):
    q, k, v, tables, lengths = _decode_case(seed=100 + window)
    (k8, v8), (ks, vs) = _int8(k, v, seed=window)
    dequant = [np.where(np.isfinite(s)[..., None], p * s[..., None], np.nan)
               for p, s in ((k8, ks), (v8, vs))]
    ref = _decode_oracle((q, *dequant, tables, lengths), window)
    a = dict(k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs), window=jnp.int32(window))
    args = (jnp.asarray(q), jnp.asarray(k8), jnp.asarray(v8))
    items = [jnp.asarray(x) for x in decode_work_items(
        [(b, list(tables[b]), int(n)) for b, n in enumerate(lengths)], len(lengths), BLOCK, 16, 2)]
    _close("int8 reference", paged_decode_attention_ref(*args, jnp.asarray(tables),
                                                        jnp.asarray(lengths), **a), ref)
    _close("int8 xla", paged_decode_attention_xla(*args, *items, jnp.asarray(lengths), **a), ref)
    _close("int8 pallas", paged_decode_attention(*args, jnp.asarray(tables), jnp.asarray(lengths),
                                                 num_splits=2, pages_per_compute_block=1,
                                                 interpret=True, **a), ref)
    # Prefill over the same int8 pool: a chunk of 20 tokens ending at the full table.
    t_lens, kv = np.array([20]), np.array([CONTEXT])
    qp = np.random.default_rng(window).standard_normal((32, HEADS, DIM)).astype(np.float32)
    cu = np.array([0, 20], np.int32)
    ragged_ref = _ragged_oracle((qp, *dequant, tables[3:4], t_lens, kv, cu), window)[:20]
    out = ragged_paged_attention(jnp.asarray(qp), *args[1:], jnp.asarray(kv, jnp.int32),
                                 jnp.asarray(tables[3:4]), jnp.asarray(cu), jnp.int32(1),
                                 interpret=True, block_q=8, pages_per_compute_block=1, **a)
    _close("int8 ragged pallas", np.asarray(out)[:20], ragged_ref)


def test_an_off_by_one_window_is_visible():
    """The comparisons above would catch a bound one key too wide or too narrow: the oracle's
    results for windows w and w + 1 differ far beyond the tolerance."""
    case = _decode_case(seed=3)
    for window in (1, 7, 20):
        a, b = _decode_oracle(case, window), _decode_oracle(case, window + 1)
        assert np.abs(a - b).max() / np.abs(a).max() > 1e-2


@pytest.mark.parametrize("window", [20, 70])
def test_xla_prefill_starts_its_key_loop_at_the_window(window):
    """A chunk at the end of a 200-token context: the key loop starts blocks in (64 keys a
    block here), and must not start one block too late."""
    rng = np.random.default_rng(window)
    pages, kv_len, q_len = 13, 200, 24
    tables, num_blocks = random_tables(rng, [kv_len], pages, BLOCK)
    k, v = nan_pool(KV_HEADS, num_blocks, BLOCK, DIM)
    fill_pages(rng, k, v, tables[0], kv_len)
    q = rng.standard_normal((32, HEADS, DIM)).astype(np.float32)
    positions = kv_len - q_len + np.arange(q_len)
    ref = _oracle(q[:q_len], k, v, tables[0], positions, kv_len, window)
    query_pos = np.full(32, -1, np.int32)
    query_pos[:q_len] = positions
    out = tiled_prefill_attention_xla(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(query_pos), jnp.asarray(np.repeat(tables, 2, 0)),
                                      window=jnp.int32(window))
    _close(f"xla prefill window={window}", np.asarray(out)[:q_len], ref)
