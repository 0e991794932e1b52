"""The KV prefetch hint channel (`cpu_kernels/kv_prefetch.h`, `kv_hints.py`): decode attention
of layer l publishes exactly the pages its rows read at layer l + 1, the GEMMs after it claim
them, and the xla backend tells the kernel where the next layer's blocks lie. Results never
depend on it (the kernel and GEMM tests run with it on); what is checked here is that the hints
name the right memory. Skipped where the kernels cannot run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import kv_hints, packed_gemm, paged_decode
from jaxbatch.model.config import ModelConfig
from jaxbatch.worker.attention.work_lists import WorkListBackend
from pallas_kernels.xla_paged_attention import decode_work_items

REASON = paged_decode.unavailable_reason() or packed_gemm.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

LAYERS, BLOCKS, BS, KVH, HEADS, D = 3, 12, 16, 2, 4, 32   # BLOCKS: blocks per layer


def _kernel(q, k, v, items, lengths, off, next_layer_blocks, window=None):
    fn = jax.jit(lambda q, k, v, s, p, f, n, o: paged_decode.paged_decode_attention(
        q, k, v, s, p + o, f, n, window=window, next_layer_blocks=next_layer_blocks))
    return jax.block_until_ready(fn(q, k, v, *items, lengths, jnp.int32(off)))


def _case(dtype):
    """Three rows over layer-0 block ids (the kernel adds a layer's offset), one empty."""
    rng = np.random.default_rng(0)
    lengths = np.array([40, 0, 17], np.int32)
    tables = {0: [5, 2, 9], 2: [7, 11]}
    live = [(row, table, int(lengths[row])) for row, table in tables.items()]
    items = decode_work_items(live, len(lengths), BS, 4, 2)
    shape = (KVH, LAYERS * BLOCKS, BS, D)
    stored = jnp.uint16 if dtype == jnp.bfloat16 else jnp.float32
    k = jnp.asarray(rng.integers(0, 1 << 14, shape) if stored == jnp.uint16
                    else rng.standard_normal(shape), stored)
    v = jnp.asarray(np.asarray(k)[::-1].copy())
    q = jnp.asarray(rng.standard_normal((len(lengths), HEADS, D)), dtype)
    return q, k, v, tuple(jnp.asarray(a) for a in items), jnp.asarray(lengths), tables


def _expected(k, v, tables, lengths, layer, keep=lambda pos: True):
    """(key address, value address, bytes) of every page each row reads at `layer`, row by
    row, page by page, kv head by kv head."""
    itemsize = k.dtype.itemsize
    out = []
    for row, table in tables.items():
        for j, block in enumerate(table):
            if j * BS >= lengths[row] or not keep(j * BS):
                continue
            page = layer * BLOCKS + block
            for g in range(KVH):
                at = (g * LAYERS * BLOCKS + page) * BS * D * itemsize
                out.append((k.unsafe_buffer_pointer() + at, v.unsafe_buffer_pointer() + at,
                            BS * D * itemsize))
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_publishes_the_next_layers_pages(dtype):
    q, k, v, items, lengths, tables = _case(dtype)
    _kernel(q, k, v, items, lengths, 0 * BLOCKS, BLOCKS)
    assert kv_hints.published() == _expected(k, v, tables, np.asarray(lengths), 1)
    _kernel(q, k, v, items, lengths, 1 * BLOCKS, BLOCKS)
    assert kv_hints.published() == _expected(k, v, tables, np.asarray(lengths), 2)


def test_a_window_publishes_only_the_pages_it_sees():
    q, k, v, items, lengths, tables = _case(jnp.bfloat16)
    _kernel(q, k, v, items, lengths, 0, BLOCKS, window=9)
    lens = np.asarray(lengths)
    # row 0 (length 40) sees positions 31..39: its pages at 16 and 32; row 2 (17): 8..16
    seen = {0: lambda pos: pos + BS > 31, 2: lambda pos: pos + BS > 8}
    expected = [e for row in tables for e in
                _expected(k, v, {row: tables[row]}, lens, 1, seen[row])]
    assert kv_hints.published() == expected


def test_the_last_layer_and_an_unknown_distance_publish_nothing():
    q, k, v, items, lengths, _ = _case(jnp.bfloat16)
    _kernel(q, k, v, items, lengths, 0, BLOCKS)
    assert kv_hints.published()
    _kernel(q, k, v, items, lengths, (LAYERS - 1) * BLOCKS, BLOCKS)   # no layer after it
    assert kv_hints.published() == []
    _kernel(q, k, v, items, lengths, 0, BLOCKS)
    _kernel(q, k, v, items, lengths, 0, 0)       # an earlier call's pages are not left behind
    assert kv_hints.published() == []


def test_a_gemm_after_decode_claims_every_published_page():
    """GEMM tiles bound by arithmetic (the first of two or more row tiles: 16 rows) drain the
    queue; a single-tile GEMM, bound by its weights' stream, leaves it alone."""
    q, k, v, items, lengths, _ = _case(jnp.bfloat16)
    rng = np.random.default_rng(1)
    w = jnp.asarray(packed_gemm.pack(rng.standard_normal((576, 960)).astype(jnp.bfloat16)))
    gemm = jax.jit(packed_gemm.matmul)
    _kernel(q, k, v, items, lengths, 0, BLOCKS)
    jax.block_until_ready(gemm(jnp.ones((8, 576), jnp.bfloat16), w))
    assert kv_hints.claimed() == 0
    count = len(kv_hints.published())
    jax.block_until_ready(gemm(jnp.ones((16, 576), jnp.bfloat16), w))
    assert kv_hints.claimed() >= count > 0


def test_turned_off_nothing_is_published():
    q, k, v, items, lengths, _ = _case(jnp.bfloat16)
    _kernel(q, k, v, items, lengths, 0, 0)     # an unknown distance: empties the queue
    kv_hints.set_enabled(False)
    try:
        _kernel(q, k, v, items, lengths, 0, BLOCKS)
        assert kv_hints.published() == []
    finally:
        kv_hints.set_enabled(True)
    _kernel(q, k, v, items, lengths, 0, BLOCKS)
    assert kv_hints.published()


def test_the_xla_backend_passes_the_distance_to_the_next_layer():
    cfg = ModelConfig(vocab_size=64, hidden_size=HEADS * D, intermediate_size=64,
                      num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KVH, head_dim=D)
    from jaxbatch.worker.kernels import KernelOptions, choose
    # the AVX512 GEMM reads the hints (AMX tiles do not: nothing is published for them)
    backend = WorkListBackend().with_kernels(choose(model_cfg=cfg, dtype=jnp.bfloat16,
                                                    pool_dtype=jnp.uint16,
                                                    options=KernelOptions(cpu_gemm="packed")))
    q, k, v, items, lengths, _ = _case(jnp.bfloat16)
    attend = backend.decode_attend(items + (lengths,), 0.5)
    hlo = jax.jit(attend).lower(q, k, v, jnp.int32(0)).as_text()
    assert f"next_layer_blocks = {BLOCKS}" in hlo, hlo[-2000:]


def test_a_publication_stops_at_its_byte_cap():
    """kv_prefetch.h's kMaxBytes (4 MB): the first rows' pages, in the order they are read."""
    rows, pages, blocks = 64, 20, 64 * 20 + 1
    lengths = np.full(rows, pages * BS, np.int32)
    tables = {r: list(range(1 + r * pages, 1 + (r + 1) * pages)) for r in range(rows)}
    items = decode_work_items([(r, t, int(lengths[r])) for r, t in tables.items()], rows, BS,
                              rows * pages // 2, 2)
    k = jnp.zeros((KVH, 2 * blocks, BS, D), jnp.uint16)
    v = jnp.zeros_like(k)
    q = jnp.zeros((rows, HEADS, D), jnp.bfloat16)
    fn = jax.jit(lambda *a: paged_decode.paged_decode_attention(*a, next_layer_blocks=blocks))
    jax.block_until_ready(fn(q, k, v, *(jnp.asarray(a) for a in items), jnp.asarray(lengths)))
    page_bytes = BS * D * 2
    published = kv_hints.published()
    assert len(published) == (4 << 20) // (2 * page_bytes) < rows * pages * KVH
    first = [(k.unsafe_buffer_pointer() + (g * 2 * blocks + blocks + b) * page_bytes)
             for r in range(rows) for b in tables[r] for g in range(KVH)][:len(published)]
    assert [p[0] for p in published] == first
