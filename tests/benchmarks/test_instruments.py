"""Instruments of the lab (benchmarks/, outside the wheel) that have no other run in the suite."""
from __future__ import annotations


def test_quant_step_times_float32_and_int8_weights_alike():
    from benchmarks.quant_step import decode_step_ab
    from jaxbatch.benchmarks.random_models import random_model
    from jaxbatch.model.quantize import quantize_params
    loaded = random_model("tiny", "float32")
    result = decode_step_ab({"float32": loaded.params, "int8": quantize_params(loaded.params)},
                            loaded.config, rows=2, context=32, reps=2)
    assert set(result) == {"float32", "int8"} and all(ms > 0 for ms in result.values())


def test_lora_delta_times_both_forms_beside_the_base_matmul():
    from benchmarks import lora_delta
    deltas = lora_delta.main(["--rows", "4"])
    assert set(deltas[4]) == {"base matmul", "one-hot einsum", "per-row gather"}
    assert all(ms > 0 for ms in deltas[4].values())
