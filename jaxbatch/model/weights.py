"""Hugging Face state-dict names -> our params pytree (numpy in, numpy out; no JAX, no torch)."""
from __future__ import annotations

import numpy as np

from jaxbatch.model.config import ModelConfig


def params_from_hf_state(cfg: ModelConfig, state: dict[str, np.ndarray], source: str) -> dict:
    """`state` maps HF parameter names (with or without the `model.` prefix) to arrays.

    torch Linear weights are [out, in]; we store [in, out]."""
    def get(name: str) -> np.ndarray:
        for key in (name, "model." + name):
            if key in state:
                return np.asarray(state[key])
        raise ValueError(f"checkpoint {source} is missing tensor {name!r}")

    def linear(name: str) -> np.ndarray:
        return get(name + ".weight").T

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layer = {
            "attn_norm": get(p + "input_layernorm.weight"),
            "wq": linear(p + "self_attn.q_proj"),
            "wk": linear(p + "self_attn.k_proj"),
            "wv": linear(p + "self_attn.v_proj"),
            "wo": linear(p + "self_attn.o_proj"),
            "mlp_norm": get(p + "post_attention_layernorm.weight"),
            "w_gate": linear(p + "mlp.gate_proj"),
            "w_up": linear(p + "mlp.up_proj"),
            "w_down": linear(p + "mlp.down_proj"),
        }
        if cfg.qkv_bias:
            for short, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                layer[short] = get(p + f"self_attn.{proj}.bias")
        if cfg.o_bias:
            layer["bo"] = get(p + "self_attn.o_proj.bias")
        layers.append(layer)
    params = {"embed": get("embed_tokens.weight"), "layers": layers,
              "final_norm": get("norm.weight")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    expected = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "wq": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        "wk": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
        "w_down": (cfg.intermediate_size, cfg.hidden_size),
    }
    for key, shape in expected.items():
        arr = params[key] if key == "embed" else params["layers"][0][key]
        if arr.shape != shape:
            raise ValueError(f"checkpoint {source}: tensor {key} has shape {arr.shape}, "
                             f"config says {shape}")
    return params
