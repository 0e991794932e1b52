"""Every cross-feature refusal lives in EngineConfig (issue 54), so an invalid combination is a
ValueError before any weight loads: tensor parallelism x int8 (cache or weights), LoRA x tensor
parallelism (by size or by devices=), LoRA x a runner= built without LoRA; LoRA x the lowered
store is resolved there too (off for LoRA engines); the pooling runner x what it does not
combine with."""
from __future__ import annotations

import pytest

from jaxbatch.engine import setup
from jaxbatch.engine.config import EngineConfig
from jaxbatch.engine.llm_engine import LLMEngine


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the combination was refused")
    monkeypatch.setattr(setup, "load_weights", refuse)


class RunnerWithoutLoRA:
    """What `runner=` hands a LoRA engine when it was built without LoRA (no adapter pool)."""


@pytest.mark.parametrize("kwargs,says", [
    (dict(tensor_parallel_size=2, kv_cache_dtype="int8"), "int8 KV cache or int8 weights"),
    (dict(tensor_parallel_size=2, quantization="int8"), "int8 KV cache or int8 weights"),
    (dict(devices=["a device"], kv_cache_dtype="int8"), "devices= with an int8"),
    (dict(devices=["a device"], quantization="int8"), "devices= with an int8"),
    (dict(tensor_parallel_size=2, enable_lora=True), "enable_lora=True is not supported"),
    (dict(devices=["a device"], enable_lora=True), "enable_lora=True is not supported with devices="),
    (dict(runner=RunnerWithoutLoRA(), enable_lora=True), "cannot reuse a runner= built without it"),
    # Embeddings: the pooling options need the pooling runner, which is one device, no LoRA,
    # no speculation (yet)
    (dict(pooling_type="mean"), "pooling_type needs runner='pooling'"),
    (dict(pooling_normalize=False), "pooling_normalize needs runner='pooling'"),
    (dict(runner="pooling", tensor_parallel_size=2), "runner='pooling' is not supported with"),
    (dict(runner="pooling", enable_lora=True), "runner='pooling' is not supported with"),
    (dict(runner="pooling", speculative_config={"method": "ngram"}),
     "runner='pooling' is not supported with speculative_config"),
    (dict(runner="embed"), "runner='embed'; choose one of generate, pooling"),
])
def test_a_refused_combination_fails_before_anything_loads(nothing_loads, kwargs, says):
    with pytest.raises(ValueError, match=says):
        LLMEngine("some/model", warmup=False, **kwargs)


def test_lora_engines_keep_the_lowered_store_off():
    assert EngineConfig.from_kwargs(compilation_cache=True).uses_lowered_store
    assert not EngineConfig.from_kwargs(compilation_cache=False).uses_lowered_store
    assert not EngineConfig.from_kwargs(compilation_cache=True, enable_lora=True).uses_lowered_store
