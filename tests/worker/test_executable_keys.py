"""Executable keys are frozen records with named fields (issue 54), not tuples with string
suffixes: the layout's and the calls' keys are `ModelCallKey` / `SampleKey`, a LoRA variant is a
field, and the tuple form the observers read round-trips through `as_key`. Host only."""
from __future__ import annotations

import dataclasses

import pytest

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import DecodeEntry, PrefillChunk, SamplingRow, StepPlan
from jaxbatch.worker.attention.block_tables import BlockTableBackend
from jaxbatch.worker.attention.work_lists import WorkListBackend
from jaxbatch.worker.executable_keys import ModelCallKey, SampleKey, as_key
from jaxbatch.worker.step_inputs import StepLayout

CFG = SchedulerConfig(max_num_seqs=8, block_size=8, num_blocks=600, max_model_len=512,
                      max_num_batched_tokens=2048, prefill_chunk_size=256)


def _row(seq_id, position):
    return SamplingRow(seq_id, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, position, 1, [], [], None)


@pytest.mark.parametrize("backend", [WorkListBackend(), BlockTableBackend("pallas")])
def test_every_key_is_a_frozen_record(backend):
    layout = StepLayout(CFG, backend, unified=True)
    keys = layout.executable_keys()
    assert keys and all(type(k) in (ModelCallKey, SampleKey) for k in keys)
    assert {k.kind for k in keys} - {"mixed"} == {"decode", "prefill", "sample", "prompt_logprobs"}
    for key in keys:
        assert dataclasses.is_dataclass(key) and not isinstance(key, tuple)
        with pytest.raises(dataclasses.FrozenInstanceError):
            key.kind = "other"
        assert as_key(key.as_tuple()) == key and type(as_key(key.as_tuple())) is type(key)
    plan = StepPlan(0, [PrefillChunk(1, [7] * 20, 0, [1, 2, 3], True, None, 1)],
                    [DecodeEntry(i + 2, i + 2, 5, 9, [4 + i, 20 + i]) for i in range(8)],
                    {i: _row(i, 9) for i in range(1, 10)})
    for call in layout.model_calls(plan, {}):
        assert type(call.key) is ModelCallKey and not call.key.lora
        for part in call.parts or ():
            assert type(part.key) is ModelCallKey
    for mixed in (k for k in keys if k.kind == "mixed"):     # (backends with mixed calls)
        assert mixed.sizes == (mixed.rows, mixed.items, mixed.tokens, mixed.pages)


def test_a_lora_variant_is_a_field_not_a_suffix():
    plain = ModelCallKey.decode(8, 64)
    lora = plain.with_lora()
    assert lora.kind == "decode" and lora.lora and lora != plain and hash(lora) != hash(plain)
    assert lora.with_lora(False) == plain
    assert lora.as_tuple() == ("decode_lora", 8, 64)        # what executable observers read
    assert as_key(("prefill_lora", 32, 4)) == ModelCallKey.prefill(32, 4).with_lora()
    assert as_key(("sample", 8)) == SampleKey("sample", 8)
