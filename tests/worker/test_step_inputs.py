"""Warm-up covers every call the layout can make: boundary plans (fewest and most rows, shortest
and longest contexts, smallest and largest chunks) for each layout, checked against the keys
`executable_keys` lists. Host only: no device work, no compilation."""
from __future__ import annotations

import dataclasses
import itertools

import jax
import pytest

from cpu_kernels import paged_prefill
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import DecodeEntry, PrefillChunk, SamplingRow, StepPlan
from jaxbatch.worker.attention.block_tables import BlockTableBackend
from jaxbatch.worker.attention.work_lists import WorkListBackend
from jaxbatch.worker.step_inputs import StepLayout

# One backend of each metadata kind, and the one-chunk-per-call oracle.
BACKENDS = {"xla": WorkListBackend(),
            "xla_packed": WorkListBackend(prefill_kernel=paged_prefill.paged_prefill_attention),
            "pallas": BlockTableBackend("pallas"),
            "reference": BlockTableBackend("reference")}

CONFIGS = [
    # max_num_seqs and max_model_len that are not powers of two, and a roomy one.
    SchedulerConfig(max_num_seqs=5, block_size=16, num_blocks=200, max_model_len=300,
                    max_num_batched_tokens=5 + 64, prefill_chunk_size=64),
    SchedulerConfig(max_num_seqs=8, block_size=8, num_blocks=600, max_model_len=512,
                    max_num_batched_tokens=2048, prefill_chunk_size=256),
]


def _row(seq_id, position):
    return SamplingRow(seq_id, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, position, 1, [], [], None)


def _table(cfg, num_tokens):
    return list(range(1, -(-num_tokens // cfg.block_size) + 1))


def _decode_plans(cfg):
    for n in range(1, cfg.max_num_seqs + 1):
        for positions in ([0] * n, [cfg.max_model_len - 1] * n,
                          [0] * (n - 1) + [cfg.max_model_len - 1]):
            decodes = [DecodeEntry(i, i, 5, p, _table(cfg, p + 1)) for i, p in enumerate(positions)]
            yield StepPlan(0, [], decodes, {i: _row(i, p) for i, p in enumerate(positions)})


def _prefill_plans(cfg, chunks_per_call):
    chunk = cfg.prefill_chunk_size
    for k in range(1, chunks_per_call + 1):
        for size, at_end in itertools.product((1, chunk // 2 + 1, chunk), (False, True)):
            start = cfg.max_model_len - size - 1 if at_end else 0
            chunks = [PrefillChunk(i, [7] * size, start, _table(cfg, start + size), True,
                                   1 if i == 0 else None) for i in range(k)]
            yield StepPlan(0, chunks, [], {i: _row(i, start + size) for i in range(k)})


@pytest.mark.parametrize("cfg", CONFIGS, ids=["odd_sizes", "roomy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_call_of_a_boundary_plan_has_a_warmed_key(cfg, backend):
    layout = StepLayout(cfg, BACKENDS[backend], unified=True)
    chunks_per_call = layout.chunks_per_call
    keys = set(layout.executable_keys())
    assert len(keys) == len(layout.executable_keys()), "a key is listed twice"
    seen = set()
    for plan in _decode_plans(cfg):
        call = layout.decode_call(plan)
        seen |= {call.key, ("sample", len(call.rows))}
    for plan in _prefill_plans(cfg, chunks_per_call):
        for group in layout.pack_prefills(plan.prefills):
            call = layout.prefill_call(group, plan, {})
            seen |= {call.key, ("sample", len(call.rows)), ("prompt_logprobs", call.key[1])}
            assert call.want_prompt_logprobs == any(c.prompt_logprobs is not None for c in group)
    for plan in _mixed_plans(cfg, chunks_per_call):              # as the runner dispatches
        for call in layout.model_calls(plan, {}):
            seen.add(call.key)
            for part in call.parts or (call,):
                seen.add(("sample", len(part.rows)))
                if part.key[0] == "prefill":
                    seen.add(("prompt_logprobs", part.key[1]))
    missing = seen - keys
    assert not missing, f"calls with no warmed executable: {sorted(missing)}"


def test_placeholder_calls_have_the_shapes_of_real_calls():
    cfg = CONFIGS[0]
    for backend in ("xla", "xla_packed", "pallas"):
        layout = StepLayout(cfg, BACKENDS[backend])
        plan = next(_decode_plans(cfg))
        real = layout.decode_call(plan)
        fake = layout.placeholder_call(*real.key)
        shapes = lambda call: [getattr(a, "shape", None) for a in
                               __import__("jax").tree.leaves(call.args)]
        assert shapes(real) == shapes(fake)
        plan = next(_prefill_plans(cfg, 8))
        real = layout.prefill_call(plan.prefills, plan, {})
        assert shapes(real) == shapes(layout.placeholder_call(*real.key))


def _mixed_plans(cfg, chunks_per_call):
    """Decode plans with prefill chunks of other sequences added (seq ids from 100)."""
    for decode_plan, prefill_plan in itertools.product(
            itertools.islice(_decode_plans(cfg), 0, None, 4), _prefill_plans(cfg, chunks_per_call)):
        chunks = [dataclasses.replace(c, seq_id=100 + c.seq_id) for c in prefill_plan.prefills]
        sampling = {**decode_plan.sampling,
                    **{100 + k: v for k, v in prefill_plan.sampling.items()}}
        yield StepPlan(0, chunks, decode_plan.decodes, sampling)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["odd_sizes", "roomy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_unified_step_runs_decode_rows_inside_the_first_prefill_call(cfg, backend):
    """With `unified`, a step whose decode rows fill the largest row bucket and that has
    prefills makes one ("mixed", ...) call whose parts are exactly the calls it would
    otherwise make, and every such key is warmed; smaller decode batches, and backends
    without `mixed_calls` (which list no mixed key), keep separate calls."""
    layout = StepLayout(cfg, BACKENDS[backend], unified=True)
    separate = StepLayout(cfg, BACKENDS[backend])
    keys = set(layout.executable_keys())
    mixes = BACKENDS[backend].mixed_calls
    largest = layout.decode_row_buckets()[-1]
    assert any(k[0] == "mixed" for k in keys) == mixes
    assert all(k[1] == largest for k in keys if k[0] == "mixed")
    kinds = set()
    for plan in _mixed_plans(cfg, layout.chunks_per_call):
        calls = layout.model_calls(plan, {})
        alone = separate.model_calls(plan, {})
        kinds |= {c.key[0] for c in calls}
        if not mixes or alone[-1].key[1] != largest:
            assert [c.key for c in calls] == [c.key for c in alone]
            continue
        assert len(calls) == len(alone) - 1
        mixed = calls[0]
        decode, prefill = mixed.parts
        assert mixed.key in keys, mixed.key
        # The parts are the separate layout's decode call and first prefill call, unchanged.
        for part, twin in ((decode, alone[-1]), (prefill, alone[0])):
            assert part.key == twin.key and part.rows == twin.rows
            for a, b in zip(jax.tree.leaves(part.args), jax.tree.leaves(twin.args)):
                assert (a == b).all()
        # Calls that did not fit the first prefill call follow it, unchanged.
        assert [c.key for c in calls[1:]] == [c.key for c in alone[1:-1]]
    assert kinds == ({"mixed", "decode", "prefill"} if mixes else {"decode", "prefill"})
    # Decode-only and prefill-only steps are unchanged.
    plan = next(_decode_plans(cfg))
    assert [c.key[0] for c in layout.model_calls(plan, {})] == ["decode"]
    plan = next(_prefill_plans(cfg, 2))
    assert [c.key[0] for c in layout.model_calls(plan, {})] == ["prefill"]
    if mixes:
        plan = next(p for p in _mixed_plans(cfg, 1)
                    if layout.decode_row_bucket(len(p.decodes)) == largest)
        real = layout.model_calls(plan, {})[0]
        assert real.key[0] == "mixed"
        fake = layout.placeholder_call(*real.key)
        shapes = lambda call: [getattr(a, "shape", None) for a in jax.tree.leaves(call.args)]
        assert shapes(real) == shapes(fake)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_starts_after_the_last_real_token_of_every_call(backend):
    """`decoder.padding_start` of a call's slot mapping (the layout's padding writes into the
    null block's slot 0, and comes last) is its real rows: a decode call's entries, a prefill
    call's packed tokens, a mixed call's whole decode bucket and then its prefill tokens; a
    warm-up placeholder has none. One small jnp op a call: the function the model runs."""
    import numpy as np

    from jaxbatch.model.decoder import padding_start
    cfg = CONFIGS[0]
    layout = StepLayout(cfg, BACKENDS[backend], unified=True)

    def start(slot_mapping):
        return int(padding_start(np.asarray(slot_mapping)))

    def prefill_tokens(call):
        return call.q_starts[-1] + len(call.chunks[-1].token_ids)
    speculative = []          # two proposed tokens after each sequence's: a row each
    for n in (1, 2):
        decodes = [DecodeEntry(i, i, 5, 20, _table(cfg, 23), draft_token_ids=[6, 7])
                   for i in range(n)]
        speculative.append(StepPlan(0, [], decodes, {i: _row(i, 20) for i in range(n)},
                                    {i: [_row(i, 21), _row(i, 22)] for i in range(n)}))
    for plan in itertools.chain(itertools.islice(_decode_plans(cfg), 0, None, 2), speculative):
        call = layout.decode_call(plan)
        assert start(call.args[3]) == len(call.decode_rows)
    for plan in _prefill_plans(cfg, layout.chunks_per_call):
        for group in layout.pack_prefills(plan.prefills):
            call = layout.prefill_call(group, plan, {})
            assert start(call.args[2]) == prefill_tokens(call)
    mixed = 0
    for plan in itertools.islice(_mixed_plans(cfg, layout.chunks_per_call), 0, None, 3):
        for call in layout.model_calls(plan, {}):
            if call.key[0] == "mixed":
                decode, prefill = call.parts
                both = np.concatenate([decode.args[3], prefill.args[2]])
                assert start(both) == decode.key[1] + prefill_tokens(prefill)
                mixed += 1
    assert mixed or not BACKENDS[backend].mixed_calls
    from benchmarks.step_keys import every_row_real as _every_row_real
    for key in layout.bucket_shapes():
        call = layout.placeholder_call(*key)
        parts = call.parts or (call,)
        assert all(start(p.args[3] if p.key[0] == "decode" else p.args[2]) == 0 for p in parts)
        # `bench step-keys` times placeholders with every row real
        real = _every_row_real(key, call.args)
        slots = np.concatenate([real[3], real[7]]) if key[0] == "mixed" else (
            real[3] if key[0] == "decode" else real[2])
        assert start(slots) == len(slots)
