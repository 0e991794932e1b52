"""Hugging Face state-dict names -> our params pytree (numpy in, numpy out; no JAX, no torch).

The pieces every family shares are here (`attention_weights`, `mlp_weights`, the reader); what
a family names differently is its own `layer_weights` (`model/registry.py` picks the family).
Layer keys, all [in, out] (torch Linear weights are [out, in]; we transpose):
    attn_norm wq wk wv wo mlp_norm w_gate w_up w_down       every family
    bq bk bv / bo                                           qkv_bias / o_bias
    q_norm k_norm [Dh]                                      qk_norm (Qwen3, Gemma 3)
    post_attn_norm post_mlp_norm [d]                        sandwich_norm (Gemma 2/3)
    w_router [d, E], we_gate we_up [E, d, F], we_down [E, F, d]    MoE in place of w_gate..
"""
from __future__ import annotations

import numpy as np

from jaxbatch.model.config import ModelConfig


class Reader:
    """Looks tensors up by HF name, with or without the `model.` prefix."""

    def __init__(self, state: dict[str, np.ndarray], source: str):
        self.state, self.source = state, source

    def has(self, name: str) -> bool:
        return name in self.state or "model." + name in self.state

    def get(self, name: str) -> np.ndarray:
        for key in (name, "model." + name):
            if key in self.state:
                return np.asarray(self.state[key])
        raise ValueError(f"checkpoint {self.source} is missing tensor {name!r}")

    def linear(self, name: str) -> np.ndarray:
        return self.get(name + ".weight").T


def attention_weights(r: Reader, cfg: ModelConfig, p: str) -> dict:
    """Separate q/k/v/o projections under `{p}self_attn.` (Phi-3 fuses them: phi3.py)."""
    a = p + "self_attn."
    layer = {"wq": r.linear(a + "q_proj"), "wk": r.linear(a + "k_proj"),
             "wv": r.linear(a + "v_proj"), "wo": r.linear(a + "o_proj")}
    if cfg.qkv_bias:
        for short, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            layer[short] = r.get(a + f"{proj}.bias")
    if cfg.o_bias:
        layer["bo"] = r.get(a + "o_proj.bias")
    if cfg.qk_norm:
        layer["q_norm"], layer["k_norm"] = r.get(a + "q_norm.weight"), r.get(a + "k_norm.weight")
    return layer


def mlp_weights(r: Reader, p: str) -> dict:
    m = p + "mlp."
    return {"w_gate": r.linear(m + "gate_proj"), "w_up": r.linear(m + "up_proj"),
            "w_down": r.linear(m + "down_proj")}


def llama_layer(r: Reader, cfg: ModelConfig, i: int) -> dict:
    """Pre-norm layer: input_layernorm, attention, post_attention_layernorm (before the MLP)."""
    p = f"layers.{i}."
    return {"attn_norm": r.get(p + "input_layernorm.weight"),
            "mlp_norm": r.get(p + "post_attention_layernorm.weight"),
            **attention_weights(r, cfg, p), **mlp_weights(r, p)}


def params_from_hf_state(cfg: ModelConfig, state: dict[str, np.ndarray], source: str) -> dict:
    """`state` maps HF parameter names (with or without the `model.` prefix) to arrays."""
    from jaxbatch.model.registry import family_for_architecture
    family = family_for_architecture(cfg.architecture)
    r = Reader(state, source)
    layers = [family.layer_weights(r, cfg, i) for i in range(cfg.num_layers)]
    params = {"embed": r.get("embed_tokens.weight"), "layers": layers,
              "final_norm": r.get("norm.weight")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = r.linear("lm_head")
    expected = {"embed": (cfg.vocab_size, cfg.hidden_size),
                "wq": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                "wk": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)}
    if cfg.num_experts:
        expected["we_down"] = (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    else:
        expected["w_down"] = (cfg.intermediate_size, cfg.hidden_size)
    for key, shape in expected.items():
        arr = params[key] if key == "embed" else params["layers"][0][key]
        if arr.shape != shape:
            raise ValueError(f"checkpoint {source}: tensor {key} has shape {arr.shape}, "
                             f"config says {shape}")
    return params
