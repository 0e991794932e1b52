"""The registry: which architectures load, what each family's config becomes, and the
combinations refused with a clear error instead of computed wrong."""
from __future__ import annotations

import json

import numpy as np
import pytest

from families import hf_config
from jaxbatch.model.registry import config_from_hf
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.registry import supported_architectures

EXPECTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
            "Qwen3MoeForCausalLM"}


def _hf(name, **changes):
    hf = hf_config(name).to_dict()
    hf.update(changes)
    return hf


def test_the_registry_serves_the_documented_architectures():
    assert set(supported_architectures()) == EXPECTED


def test_an_unknown_architecture_is_named_and_the_supported_ones_listed(tmp_path):
    hf = _hf("qwen3", architectures=["OlmoeForCausalLM"])
    with pytest.raises(ValueError, match="OlmoeForCausalLM.*supported: .*Gemma3ForCausalLM"):
        config_from_hf(hf)
    # The same through the loader, before any weight is read.
    from jaxbatch import LLM
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported architecture 'OlmoeForCausalLM'"):
        LLM(model=str(tmp_path), warmup=False)


def test_family_configs():
    g2 = config_from_hf(_hf("gemma2"))
    assert g2.layer_windows == (8, 0, 8, 0) and g2.attn_soft_cap == 0.5
    assert g2.final_soft_cap == 3.0 and g2.norm_offset == 1.0 and g2.embed_scale == 8.0
    assert g2.attention_scale == 24 ** -0.5 and g2.hidden_act == "gelu_tanh"
    # Gemma 2 without layer_types (configs written before transformers 5): even layers slide.
    old = _hf("gemma2")
    del old["layer_types"]
    assert config_from_hf(old).layer_windows == (8, 0, 8, 0)
    g3 = config_from_hf(_hf("gemma3"))
    assert g3.qk_norm and g3.attn_soft_cap is None and g3.layer_windows == (8, 0, 8, 0)
    assert [theta for theta, _ in g3.layer_rope] == [1e4, 1e6, 1e4, 1e6]
    assert dict(g3.layer_rope[1][1])["factor"] == 4.0 and g3.layer_rope[0][1] is None
    # Gemma 3's older config keys: rope_local_base_freq and rope_scaling (global layers only).
    legacy = _hf("gemma3", rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    del legacy["rope_parameters"]
    legacy_cfg = config_from_hf(legacy)
    assert legacy_cfg.layer_rope[0] == (1e4, None)
    assert dict(legacy_cfg.layer_rope[1][1])["factor"] == 8.0
    phi = config_from_hf(_hf("phi3"))
    assert phi.rotary_dim == 12 and phi.layer_windows == (8,) * 4
    # longrope: factor 1024 / 128 = 8 -> sqrt(1 + ln 8 / ln 128); capped at 128 positions.
    assert phi.rope_attention_factor == pytest.approx((1 + np.log(8) / np.log(128)) ** 0.5)
    assert phi.max_position_embeddings == 128
    q3 = config_from_hf(_hf("qwen3"))
    assert q3.qk_norm and q3.layer_windows == (0, 0, 8, 8)
    mix = config_from_hf(_hf("mixtral"))
    assert (mix.num_experts, mix.num_experts_per_tok, mix.norm_topk_prob) == (4, 2, True)
    assert not config_from_hf(_hf("qwen3_moe")).norm_topk_prob


@pytest.mark.parametrize("name,changes,match", [
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                   "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
                  original_max_position_embeddings=None), "original_max_position_embeddings"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "dense layers among the experts"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "dense layers among the experts"),
    ("gemma2", dict(hidden_activation="relu"), "hidden_activation='relu'"),
])
def test_combinations_that_do_not_work_yet_are_refused(name, changes, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(_hf(name, **changes))
