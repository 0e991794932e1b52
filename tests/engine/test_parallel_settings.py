"""Scale-out settings that cannot work are refused before anything is placed or compiled
(in this one-device process; the 8-device refusals are in tp_checks.check_bad_settings)."""
from __future__ import annotations

import pytest

from jaxbatch.engine.build import build_engine
from jaxbatch.engine.llm_engine import LLMEngine
from tp_checks import SETTINGS, model


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 must be a positive integer"),
    (dict(tensor_parallel_size="2"), "must be a positive integer"),
    (dict(tensor_parallel_size=2), "needs 2 devices; 1 given"),
    (dict(data_parallel_size=0), "data_parallel_size=0"),
    (dict(data_parallel_size=2, tensor_parallel_size=2), "needs 4 devices"),
    (dict(num_processes=2, process_id=0), "coordinator_address"),
    (dict(num_processes=2, process_id=2, coordinator_address="localhost:1"), "process_id=2"),
])
def test_bad_scale_out_settings_raise_value_error(kwargs, words):
    with pytest.raises(ValueError, match=words):
        build_engine(loaded=model(8), **{**SETTINGS, **kwargs})


def test_one_device_engine_reports_tensor_parallel_size_one():
    engine = LLMEngine(loaded=model(8), **SETTINGS)
    assert engine.runner.tp is None and engine.stats()["tensor_parallel_size"] == 1
