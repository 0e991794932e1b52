"""The kernel seam's choice of a bf16 or w8a8 model's matmuls on a CPU (`cpu_gemm`): XLA's
dots where the CPU has AMX (oneDNN's bf16 or int8 tiles) or when asked, our packed kernels
(AVX512-BF16, VNNI) otherwise; a float32 model keeps the packed kernel (AMX has no float32
tiles)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from cpu_kernels import availability, packed_gemm, w8a8_gemm
from jaxbatch.model.config import ModelConfig
from jaxbatch.worker.kernels import KernelOptions, choose

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def _choice(dtype, cpu_gemm):
    return choose(model_cfg=CFG, dtype=dtype, pool_dtype=dtype, platform="cpu",
                  options=KernelOptions(cpu_gemm=cpu_gemm))


def test_xla_asked_for_takes_xlas_dots_and_no_packed_weights():
    choice = _choice(jnp.bfloat16, "xla")
    assert not choice.weight_form.packed
    assert choice.describe()["matmul"] == "XLA dots (cpu_gemm='xla')"


@pytest.mark.skipif(packed_gemm.unavailable_reason() is not None, reason="no packed kernel here")
def test_packed_asked_for_and_float32_models_take_the_packed_kernel():
    assert _choice(jnp.bfloat16, "packed").weight_form.packed
    assert _choice(jnp.float32, "xla").weight_form.packed


@pytest.mark.skipif(packed_gemm.unavailable_reason() is not None, reason="no packed kernel here")
def test_auto_follows_the_cpus_amx():
    choice = _choice(jnp.bfloat16, "auto")
    assert choice.weight_form.packed == (not availability.cpu_has("amx_bf16"))
    assert ("AMX" in choice.describe()["matmul"]) == availability.cpu_has("amx_bf16")


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="cpu_gemm='tiles'"):
        _choice(jnp.bfloat16, "tiles")


def _w8a8_choice(cpu_gemm, cpu_kernels="auto"):
    return choose(model_cfg=CFG, dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16, platform="cpu",
                  options=KernelOptions(cpu_gemm=cpu_gemm, cpu_kernels=cpu_kernels,
                                        int8_activations=True))


def test_w8a8_takes_xlas_int8_dots_when_asked_and_on_an_amx_cpu():
    assert _w8a8_choice("xla").weight_form.w8a8_kernel == "xla"
    auto = _w8a8_choice("auto") if availability.cpu_has("amx_int8") else None
    if auto is not None:
        assert auto.weight_form.w8a8_kernel == "xla"
        assert "AMX" in auto.describe()["w8a8"]


@pytest.mark.skipif(w8a8_gemm.unavailable_reason() is not None, reason="no VNNI kernel here")
def test_w8a8_packed_asked_for_takes_the_vnni_kernel():
    assert _w8a8_choice("packed").weight_form.w8a8_kernel == "cpu"


def test_w8a8_with_the_cpu_kernels_off_is_refused_even_where_xla_could_run_it():
    with pytest.raises(ValueError, match="cpu_kernels='off'"):
        _w8a8_choice("auto", cpu_kernels="off")
