"""Pallas paged-attention kernels against the plain-jnp oracles (interpret mode on CPU) and their
input validation (lowering for the cuda platform: tests/worker/test_lowering.py).

Inputs are fresh on every run; the seed is in every failure message (set KERNEL_TEST_SEED to
replay one). Every pool slot a test does not fill holds NaN: unused pages, the null block 0 and
the tail of each sequence's last page, so any masked value that reaches arithmetic shows up.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import paged_decode_attention_ref, ragged_paged_attention_ref
from paged_inputs import SeededRng, fill_pages, nan_pool, random_tables

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.fixture
def rng():
    return SeededRng(int(os.environ.get("KERNEL_TEST_SEED",
                                         int.from_bytes(os.urandom(4), "little"))))


def _check(out, ref, dtype, seed, empty_rows=()):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert out.shape == ref.shape, f"seed={seed}"
    assert np.isfinite(out).all(), f"seed={seed}: NaN/inf leaked into the output"
    assert np.isfinite(ref).all(), f"seed={seed}: the reference itself is not finite"
    for rows in empty_rows:
        assert (out[rows] == 0).all(), f"seed={seed}: rows {rows} must be exactly zero"
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < TOLERANCE[dtype], f"seed={seed}: relative error {err:.3g}"


# --- paged decode ----------------------------------------------------------------------------

DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, pages/tile, soft_cap)
    (2, 2, 64, 16, jnp.float32, 1, None, None),       # GQA 1, one split
    (6, 2, 64, 32, jnp.float32, None, 1, 20.0),       # GQA 3, auto splits, soft cap
    (8, 2, 128, 16, jnp.bfloat16, 2, 1, None),        # GQA 4, two splits, several tiles each
    (8, 1, 128, 32, jnp.float32, 3, 1, None),         # GQA 8, uneven splits
    (8, 2, 64, 16, jnp.bfloat16, 1, 2, 5.0),          # GQA 4, one split, strong soft cap
    (16, 2, 64, 16, jnp.bfloat16, None, None, None),  # GQA 8, production defaults
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,splits,tile,cap",
                         DECODE_CASES)
def test_paged_decode_matches_reference(rng, num_heads, num_kv_heads, head_dim, block_size,
                                        dtype, splits, tile, cap):
    batch, pages_per_seq = 4, 5
    context = pages_per_seq * block_size
    lengths = rng.integers(1, context + 1, batch)
    lengths[0] = 0                                                       # empty slot
    lengths[1] = rng.integers(1, pages_per_seq) * block_size + rng.integers(1, block_size)
    lengths[2] = context                                                 # table full
    tables, num_blocks = random_tables(rng, lengths, pages_per_seq, block_size)
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i in range(batch):
        fill_pages(rng, k, v, tables[i], lengths[i])
    q = jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), dtype)
    args = (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(lengths, jnp.int32))

    out = paged_decode_attention(*args, soft_cap=cap, num_splits=splits,
                                 pages_per_compute_block=tile, interpret=True)
    ref = paged_decode_attention_ref(*args, soft_cap=cap)
    _check(out, ref, dtype, rng.seed, empty_rows=[0])


def test_paged_decode_custom_scale_and_all_empty(rng):
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 16, 64)), jnp.float32)
    tables = jnp.asarray(rng.permutation(np.arange(1, 5)).reshape(2, 2), jnp.int32)
    lengths = jnp.asarray([19, 32], jnp.int32)
    kw = dict(scale=0.3, num_splits=2, pages_per_compute_block=1, interpret=True)
    out = paged_decode_attention(q, k, -k, tables, lengths, **kw)
    _check(out, paged_decode_attention_ref(q, k, -k, tables, lengths, scale=0.3),
           jnp.float32, rng.seed)
    poisoned = jnp.full_like(k, jnp.nan)
    empty = paged_decode_attention(q, poisoned, poisoned, tables, jnp.zeros(2, jnp.int32), **kw)
    assert (np.asarray(empty) == 0).all(), f"seed={rng.seed}"


# --- ragged paged attention ------------------------------------------------------------------

RAGGED_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype, block_q, soft_cap)
    (2, 2, 64, 16, jnp.float32, None, None),      # GQA 1: 64-token q blocks
    (6, 2, 64, 32, jnp.float32, 4, 10.0),         # GQA 3 (padded to 4), many q blocks
    (8, 2, 128, 16, jnp.bfloat16, None, None),    # GQA 4
    (8, 1, 128, 32, jnp.bfloat16, 2, None),       # GQA 8, 2-token q blocks
    (12, 4, 128, 16, jnp.bfloat16, 8, 30.0),      # GQA 3, 8-token q blocks
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,block_q,cap",
                         RAGGED_CASES)
def test_ragged_matches_reference(rng, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                  block_q, cap):
    max_seqs, pages_per_seq, num_tokens = 6, 4, 48
    context = pages_per_seq * block_size
    # A decode token, a long chunk, an idle sequence, a short chunk, a decode token; the last
    # slot is past num_seqs and holds garbage that must be ignored.
    q_lens = np.array([1, rng.integers(17, 26), 0, rng.integers(2, 9), 1, 7])
    num_seqs = 5
    kv_lens = np.array([rng.integers(q, context + 1) for q in q_lens])
    kv_lens[2] = rng.integers(1, context)                 # idle sequence with cached context
    kv_lens[3] = q_lens[3]                                # chunk that starts the sequence
    cu = np.concatenate([[0], np.cumsum(q_lens[:num_seqs])]).astype(np.int32)
    cu = np.concatenate([cu, np.full(max_seqs - num_seqs, cu[-1] + 3)]).astype(np.int32)
    tables, num_blocks = random_tables(rng, kv_lens[:num_seqs], pages_per_seq, block_size)
    tables = np.concatenate([tables, rng.integers(0, num_blocks, (1, pages_per_seq))])
    k, v = nan_pool(num_kv_heads, num_blocks, block_size, head_dim)
    for i in range(num_seqs):
        fill_pages(rng, k, v, tables[i], kv_lens[i])
    q = rng.standard_normal((num_tokens, num_heads, head_dim))
    q[cu[num_seqs]:] = np.nan                             # padding tokens: must give zeros
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
            jnp.int32(num_seqs))

    out = ragged_paged_attention(*args, soft_cap=cap, block_q=block_q, interpret=True)
    ref = ragged_paged_attention_ref(*args, soft_cap=cap)
    _check(out, ref, dtype, rng.seed, empty_rows=[slice(int(cu[num_seqs]), None)])


def test_ragged_rows_without_keys_give_zeros(rng):
    """kv_len < q_len puts the first queries before position 0: they see no key at all and, as
    in the reference, give zeros rather than 0/0."""
    q = jnp.asarray(rng.standard_normal((16, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 3, 16, 64)), jnp.float32)
    meta = (jnp.asarray([2], jnp.int32), jnp.asarray([[2]], jnp.int32),
            jnp.asarray([0, 5], jnp.int32), jnp.int32(1))
    out = ragged_paged_attention(q, k, k, *meta, interpret=True)
    _check(out, ragged_paged_attention_ref(q, k, k, *meta), jnp.float32, rng.seed,
           empty_rows=[slice(0, 3), slice(5, None)])


# --- KV write --------------------------------------------------------------------------------

def test_write_kv_then_read_back(rng):
    kvh, blocks, block_size, head_dim, tokens = 2, 6, 16, 64, 10
    k_pages = jnp.zeros((kvh, blocks, block_size, head_dim), jnp.bfloat16)
    slots = rng.choice(np.arange(block_size, blocks * block_size), tokens, replace=False)
    slots[-2:] = [3, 3]                                   # padded tokens land in null block 0
    k = rng.standard_normal((tokens, kvh, head_dim)).astype(np.float32)
    v = rng.standard_normal((tokens, kvh, head_dim)).astype(np.float32)
    new_k, new_v = write_kv(k_pages, k_pages, jnp.asarray(k), jnp.asarray(v),
                            jnp.asarray(slots, jnp.int32))
    got_k = np.asarray(new_k[:, slots[:-2] // block_size, slots[:-2] % block_size], np.float32)
    got_v = np.asarray(new_v[:, slots[:-2] // block_size, slots[:-2] % block_size], np.float32)
    want_k = np.asarray(jnp.asarray(k[:-2], jnp.bfloat16), np.float32).swapaxes(0, 1)
    want_v = np.asarray(jnp.asarray(v[:-2], jnp.bfloat16), np.float32).swapaxes(0, 1)
    np.testing.assert_array_equal(got_k, want_k, err_msg=f"seed={rng.seed}")
    np.testing.assert_array_equal(got_v, want_v, err_msg=f"seed={rng.seed}")
    written = np.zeros((blocks, block_size), bool)
    written[slots // block_size, slots % block_size] = True
    assert (np.asarray(new_k, np.float32)[:, ~written] == 0).all(), "a write spilled elsewhere"


# --- validation ------------------------------------------------------------------------------

def _decode_args(heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32):
    return dict(q=jnp.zeros((2, heads, head_dim), dtype),
                k_pages=jnp.zeros((kv_heads, 4, block_size, head_dim), dtype),
                v_pages=jnp.zeros((kv_heads, 4, block_size, head_dim), dtype),
                block_tables=jnp.zeros((2, 2), jnp.int32), lengths=jnp.zeros((2,), jnp.int32))


def _ragged_args(**kw):
    a = _decode_args(**kw)
    return dict(q=a["q"], k_pages=a["k_pages"], v_pages=a["v_pages"],
                kv_lens=jnp.zeros((2,), jnp.int32), page_indices=jnp.zeros((2, 2), jnp.int32),
                cu_q_lens=jnp.zeros((3,), jnp.int32), num_seqs=jnp.int32(2))


BAD_INPUTS = [
    (dict(block_size=24), {}, "page size must be a power of two"),
    (dict(head_dim=96), {}, "head_dim must be a power of two"),
    (dict(heads=6, kv_heads=4), {}, "not a multiple of num_kv_heads"),
    ({}, dict(q=jnp.zeros((2, 8, 64), jnp.bfloat16)), "q dtype"),
    ({}, dict(v_pages=jnp.zeros((2, 4, 16, 64), jnp.bfloat16)), "differ in dtype"),
    ({}, dict(q=jnp.zeros((2, 8, 64, 1))), "q must have rank 3"),
    ({}, dict(k_pages=jnp.zeros((2, 4, 16)), v_pages=jnp.zeros((2, 4, 16))), "rank 4"),
    ({}, dict(q=jnp.zeros((2, 8, 32))), "head_dim 32"),
    (dict(dtype=jnp.float16), {}, "float32 or bfloat16"),
]


@pytest.mark.parametrize("shape_kw,override,match", BAD_INPUTS)
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_wrappers_reject_unsupported_inputs(kernel, shape_kw, override, match):
    if kernel == "decode":
        fn, args = paged_decode_attention, _decode_args(**shape_kw)
    else:
        fn, args = ragged_paged_attention, _ragged_args(**shape_kw)
    args.update(override)
    with pytest.raises(ValueError, match=match):
        fn(*args.values(), interpret=True)


@pytest.mark.parametrize("override,match", [
    (dict(block_tables=jnp.zeros((2, 2), jnp.float32)), "block_tables must be int32"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), r"lengths must have shape \(2,\)"),
    (dict(block_tables=jnp.zeros((3, 2), jnp.int32)), "block_tables must have shape"),
])
def test_decode_rejects_bad_tables(override, match):
    args = _decode_args()
    args.update(override)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*args.values(), interpret=True)


@pytest.mark.parametrize("override,match", [
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), r"cu_q_lens must have shape \(3,\)"),
    (dict(kv_lens=jnp.zeros((2,), jnp.uint32)), "kv_lens must be int32"),
    (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs must be an int32 scalar"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), "page_indices must have rank 2"),
])
def test_ragged_rejects_bad_metadata(override, match):
    args = _ragged_args()
    args.update(override)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*args.values(), interpret=True)


def test_tuning_knobs_are_validated():
    args = _decode_args()
    with pytest.raises(ValueError, match="pages_per_compute_block must be a power of two"):
        paged_decode_attention(*args.values(), pages_per_compute_block=3, interpret=True)
    with pytest.raises(ValueError, match="Triton's minimum"):
        paged_decode_attention(*_decode_args(block_size=8).values(), pages_per_compute_block=1,
                               interpret=True)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_decode_attention(*args.values(), num_splits=0, interpret=True)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        ragged_paged_attention(*_ragged_args().values(), block_q=3, interpret=True)
    with pytest.raises(ValueError, match="fewer than 16 rows"):
        ragged_paged_attention(*_ragged_args().values(), block_q=2, interpret=True)


def test_write_kv_rejects_bad_inputs():
    pages = jnp.zeros((2, 4, 16, 64), jnp.float32)
    kv = jnp.zeros((3, 2, 64), jnp.float32)
    slots = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="must be"):
        write_kv(pages, pages, jnp.zeros((3, 4, 64)), jnp.zeros((3, 4, 64)), slots)
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        write_kv(pages, pages, kv, kv, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match="differ in shape"):
        write_kv(pages, pages, kv, jnp.zeros((4, 2, 64)), slots)


# Lowering for the cuda platform of every production configuration: tests/worker/test_lowering.py.
