"""The kernel seam's choice of a bf16 or w8a8 model's matmuls on a CPU (`cpu_gemm`): our kernels
over packed weights, met by AMX tiles where the CPU has them (auto, or 'amx', refused where it
cannot run) or by AVX512-BF16 / VNNI ('packed'), or XLA's dots ('xla'); a float32 model keeps
the AVX512 kernel (AMX has no float32 tiles)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from cpu_kernels import packed_gemm, w8a8_gemm
from jaxbatch.model.config import ModelConfig
from jaxbatch.worker.kernels import KernelOptions, choose

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
HAS_AMX = packed_gemm.amx_why_not() is None
needs_packed = pytest.mark.skipif(packed_gemm.unavailable_reason() is not None,
                                  reason="no packed kernel here")


def _choice(dtype, cpu_gemm):
    return choose(model_cfg=CFG, dtype=dtype, pool_dtype=dtype, platform="cpu",
                  options=KernelOptions(cpu_gemm=cpu_gemm))


def test_xla_asked_for_takes_xlas_dots_and_no_packed_weights():
    choice = _choice(jnp.bfloat16, "xla")
    assert not choice.weight_form.packed
    assert choice.describe()["matmul"] == "XLA dots (cpu_gemm='xla')"


@needs_packed
def test_packed_asked_for_and_float32_models_take_the_avx512_kernel():
    for choice in (_choice(jnp.bfloat16, "packed"), _choice(jnp.float32, "xla"),
                   _choice(jnp.float32, "auto")):
        assert choice.weight_form.packed and not choice.weight_form.amx
        assert "AMX" not in choice.describe()["matmul"]


@needs_packed
def test_auto_follows_the_cpus_amx():
    choice = _choice(jnp.bfloat16, "auto")
    assert choice.weight_form.packed
    assert choice.weight_form.amx == HAS_AMX
    assert ("AMX tiles" in choice.describe()["matmul"]) == HAS_AMX


@needs_packed
def test_amx_asked_for_runs_or_is_refused_saying_why(monkeypatch):
    if HAS_AMX:
        assert _choice(jnp.bfloat16, "amx").weight_form.amx
    monkeypatch.setattr(packed_gemm, "amx_why_not", lambda: "this CPU lacks amx_bf16")
    with pytest.raises(ValueError, match="cpu_gemm='amx'.*lacks amx_bf16"):
        _choice(jnp.bfloat16, "amx")
    assert not _choice(jnp.bfloat16, "auto").weight_form.amx


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="cpu_gemm='tiles'"):
        _choice(jnp.bfloat16, "tiles")


def _w8a8_choice(cpu_gemm, cpu_kernels="auto"):
    return choose(model_cfg=CFG, dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16, platform="cpu",
                  options=KernelOptions(cpu_gemm=cpu_gemm, cpu_kernels=cpu_kernels,
                                        int8_activations=True))


def test_w8a8_takes_xlas_int8_dots_when_asked():
    assert _w8a8_choice("xla").weight_form.w8a8_kernel == "xla"


@pytest.mark.skipif(w8a8_gemm.unavailable_reason() is not None, reason="no VNNI kernel here")
def test_w8a8_auto_takes_amx_tiles_where_the_cpu_has_them_and_packed_vnni(monkeypatch):
    auto = _w8a8_choice("auto")
    assert auto.weight_form.w8a8_kernel == ("amx" if HAS_AMX else "cpu")
    assert ("AMX" in auto.describe()["w8a8"]) == HAS_AMX
    assert _w8a8_choice("packed").weight_form.w8a8_kernel == "cpu"
    monkeypatch.setattr(w8a8_gemm, "amx_why_not", lambda: "this CPU lacks amx_int8")
    assert _w8a8_choice("auto").weight_form.w8a8_kernel == "cpu"
    # (where the CPU has no AMX at all the bf16 check names every flag it lacks)
    with pytest.raises(ValueError, match="cpu_gemm='amx'.*lacks .*amx_int8"):
        _w8a8_choice("amx")


def test_w8a8_with_the_cpu_kernels_off_is_refused_even_where_xla_could_run_it():
    with pytest.raises(ValueError, match="cpu_kernels='off'"):
        _w8a8_choice("auto", cpu_kernels="off")


@pytest.mark.parametrize("dtype, options, why", [
    (jnp.float32, {}, "float32 matrices"),
    (jnp.bfloat16, {"cpu_kernels": "off"}, "cpu_kernels='off'"),
    (jnp.bfloat16, {"weight_layout": "stacked"}, "stacked weight layout")])
def test_amx_asked_for_where_it_cannot_apply_is_refused_not_ignored(dtype, options, why):
    with pytest.raises(ValueError, match=f"cpu_gemm='amx' cannot apply to .*{why}"):
        choose(model_cfg=CFG, dtype=dtype, pool_dtype=dtype, platform="cpu",
               options=KernelOptions(cpu_gemm="amx", **options))
    with pytest.raises(ValueError, match="cpu_gemm='amx' cannot apply to a gpu backend"):
        choose(model_cfg=CFG, dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16, platform="gpu",
               options=KernelOptions(cpu_gemm="amx"))


@needs_packed
@pytest.mark.skipif(packed_gemm.why_not(jnp.bfloat16, 64, 64) is not None, reason="no kernel")
def test_kv_hints_are_published_only_where_the_layers_gemm_reads_them(monkeypatch):
    """The packed AVX512 loop reads decode attention's hints; AMX tiles do not, so there the
    choice says so and decode attention publishes nothing (next_layer_blocks 0)."""
    monkeypatch.setattr(packed_gemm, "amx_why_not", lambda: None)
    cfg = dataclasses.replace(CFG, hidden_size=256, head_dim=64)     # the decode kernel's heads
    tiles, loop = [choose(model_cfg=cfg, dtype=jnp.bfloat16, pool_dtype=jnp.uint16,
                          platform="cpu", options=KernelOptions(cpu_gemm=gemm))
                   for gemm in ("auto", "packed")]
    if tiles.decode_attention is None:
        pytest.skip(f"no C++ decode attention here: {tiles.describe()['decode_attention']}")
    assert tiles.describe()["kv_prefetch"].startswith("off (")
    assert not tiles.decode_attention.keywords["publish"]
    assert loop.describe()["kv_prefetch"].startswith("on")
    assert loop.decode_attention.keywords["publish"]
