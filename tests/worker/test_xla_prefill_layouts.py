"""The xla backend's two prefill layouts (`attention/work_lists.py`): chunks starting on tiles
in the call itself, or packed back to back and gathered into tiles by attention alone. Each
attends exactly as causal attention over the sequence's pages says, on either path (the jnp
tiles, and the C++ kernel where this machine builds it); and the runner picks packing only
where the kernel reads the pool."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from cpu_kernels import paged_prefill
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import PrefillChunk, SamplingRow, StepPlan
from jaxbatch.model.config import ModelConfig
from jaxbatch.worker.kernels import choose
from jaxbatch.worker.attention.work_lists import WorkListBackend
from jaxbatch.worker.step_inputs import StepLayout
from pallas_kernels.reference import keys_as_stored
from pallas_kernels.xla_paged_attention import tiled_prefill_attention_xla

CFG = SchedulerConfig(max_num_seqs=4, block_size=8, num_blocks=40, max_model_len=128,
                      max_num_batched_tokens=128, prefill_chunk_size=64)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# (length, start): chunks that end mid-tile, fill one exactly, cross tiles and pages.
CHUNKS = [(5, 0), (16, 9), (23, 30)]


def _row(seq_id, position):
    return SamplingRow(seq_id, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, position, 1, [], [], None)


def _plan():
    chunks, first_block = [], 1
    for i, (n, start) in enumerate(CHUNKS):
        pages = -(-(start + n) // CFG.block_size)
        table = list(range(first_block, first_block + pages))[::-1]      # scattered pages
        first_block += pages
        chunks.append(PrefillChunk(i, [7] * n, start, table, True, None))
    return StepPlan(0, chunks, [], {i: _row(i, s + n) for i, (n, s) in enumerate(CHUNKS)})


def _oracle(q, k, v, chunks, q_starts, scale):
    """Causal attention of each chunk's tokens over its sequence's keys, in float64."""
    group = HEADS // KV_HEADS
    out = {}
    for chunk, q0 in zip(chunks, q_starts):
        table = np.asarray(chunk.block_table)
        for j in range(len(chunk.token_ids)):
            pos = chunk.start + j
            keys = np.arange(pos + 1)
            blocks, offs = table[keys // CFG.block_size], keys % CFG.block_size
            for h in range(HEADS):
                kh, vh = k[h // group, blocks, offs], v[h // group, blocks, offs]   # [pos+1, D]
                s = kh @ q[q0 + j, h] * scale
                p = np.exp(s - s.max())
                out[q0 + j, h] = (p / p.sum()) @ vh
    return out


def _pool_and_q(rng, tokens, bf16):
    import jax.numpy as jnp
    shape = (KV_HEADS, CFG.num_blocks, CFG.block_size, HEAD_DIM)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    q = rng.standard_normal((tokens, HEADS, HEAD_DIM))
    if not bf16:
        return [np.float32(a) for a in (k, v, q)], [jnp.float32(a) for a in (k, v, q)]
    # The pool holds bf16 bit patterns (model/precision.py), keys in its grouped order; the
    # oracle sees the rounded values.
    rounded = [jnp.asarray(a, jnp.bfloat16) for a in (k, v, q)]
    exact = [np.asarray(a.astype(jnp.float32), np.float64) for a in rounded]
    device = [keys_as_stored(rounded[0].view(jnp.uint16), CFG.block_size),
              rounded[1].view(jnp.uint16), rounded[2]]
    return exact, device


@pytest.mark.parametrize("bf16", [False, True], ids=["float32_pool", "bf16_pool"])
@pytest.mark.parametrize("packed", [False, True], ids=["tiles_in_the_call", "packed"])
def test_each_prefill_layout_attends_causally_over_its_pages(packed, bf16):
    # The packed layout with the C++ kernel on bf16 pages, with the jnp tiles on float32 ones.
    jnp_tiles = lambda *a, scale, window: tiled_prefill_attention_xla(*a, scale=scale)
    kernel = paged_prefill.paged_prefill_attention if bf16 else jnp_tiles
    backend = WorkListBackend(prefill_kernel=kernel if packed else None)
    layout = StepLayout(CFG, backend)
    plan = _plan()
    [group] = layout.pack_prefills(plan.prefills)
    call = layout.prefill_call(group, plan, {})
    starts = call.q_starts
    if packed:
        assert starts == [0, 5, 21]                          # back to back
    else:
        assert starts == [0, 16, 32]                         # each from a tile
    tokens = call.key[1]
    rng = np.random.default_rng(7)
    (k, v, q), (dk, dv, dq) = _pool_and_q(rng, tokens, bf16)
    scale = HEAD_DIM ** -0.5
    meta = call.args[3]
    out = np.asarray(backend.prefill_attend(meta, scale)(dq, dk, dv, 0), np.float64)
    assert out.shape == (tokens, HEADS, HEAD_DIM)
    expected = _oracle(q, k, v, group, starts, scale)
    got = np.stack([out[t, h] for t, h in expected])
    want = np.stack(list(expected.values()))
    np.testing.assert_allclose(got, want, atol=3e-2 if bf16 else 1e-5)
    # Rows that hold no chunk's token get no attention output.
    used = {t for t, _ in expected}
    assert not out[[t for t in range(tokens) if t not in used]].any()


def test_the_runner_packs_prefill_only_where_the_kernel_reads_the_pool():
    import jax.numpy as jnp
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    def backend(pool_dtype):
        choice = choose(model_cfg=cfg, dtype=jnp.bfloat16, pool_dtype=pool_dtype)
        return WorkListBackend().with_kernels(choice)
    for pool_dtype in (jnp.float32, jnp.int8, jnp.bfloat16):
        assert not backend(pool_dtype).packed_prefill
    bits = backend(jnp.uint16)
    kernel_runs = (paged_prefill.why_not(jnp.uint16, HEADS, KV_HEADS, HEAD_DIM) is None
                   and jax.default_backend() == "cpu")
    assert bits.packed_prefill == kernel_runs
    assert bits.prefill_align == (1 if kernel_runs else 16)
    # Aligned calls keep buckets that are whole tiles.
    tiled = StepLayout(CFG, WorkListBackend())
    assert all(t % 16 == 0 for t in tiled.prefill_token_buckets())
    packed = StepLayout(CFG, WorkListBackend(prefill_kernel=paged_prefill.paged_prefill_attention))
    assert set(tiled.prefill_token_buckets()) < set(packed.prefill_token_buckets())
    # A bucket of partial tiles is refused, not split into tiles of another size.
    with pytest.raises(AssertionError):
        tiled.backend.placeholder_prefill_metadata(40, 4, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_lays_prefill_out_for_its_pool(dtype):
    """The runner asks the backend for its pool before building its StepLayout: a bf16 pool
    (bf16 bits on CPU) packs where the kernel runs, a float32 one starts chunks on tiles."""
    import jax.numpy as jnp
    from jaxbatch.benchmarks.random_models import random_model
    from jaxbatch.engine.llm_engine import LLMEngine
    engine = LLMEngine(loaded=random_model("tiny", dtype, seed=0), max_num_seqs=2,
                       max_model_len=64, attention_backend="xla", warmup=False)
    runner = engine.runner
    cfg = runner.model_cfg
    kernel_runs = (paged_prefill.why_not(jnp.uint16, cfg.num_heads, cfg.num_kv_heads,
                                         cfg.head_dim) is None and jax.default_backend() == "cpu")
    assert runner.attention.packed_prefill == (dtype == "bfloat16" and kernel_runs)
    assert runner.layout.backend is runner.attention
