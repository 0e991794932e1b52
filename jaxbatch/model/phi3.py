"""Phi-3 / Phi-4-mini: Llama's layer with q, k, v fused in `qkv_proj` and gate, up fused in
`gate_up_proj`, split here at load; a window on every layer when `sliding_window` is set
(HF's Phi3 masks every layer with it); partial rotary (Phi-4-mini) through
`partial_rotary_factor`; LongRoPE within the original context (`_longrope`)."""
from __future__ import annotations

import math

from jaxbatch.model.config import windows_from_layer_types
from jaxbatch.model.weights import Reader

ARCHITECTURES = ("Phi3ForCausalLM",)


def config_fields(hf: dict, base: dict) -> dict:
    no_types = {k: v for k, v in hf.items() if k != "layer_types"}
    fields = dict(o_bias=False, qkv_bias=False, **windows_from_layer_types(no_types, lambda i: True))
    scaling = dict(base["rope_scaling"] or ())
    if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        fields.update(_longrope(hf, scaling))
    return fields


def _longrope(hf: dict, scaling: dict) -> dict:
    """LongRoPE (Phi-3 long-context, Phi-4-mini) as HF computes it for sequences up to
    original_max_position_embeddings: the short factors, cos and sin scaled by the attention
    factor. HF switches every position to the long factors once a sequence outgrows that
    length; one frequency table per layer cannot, so the model length is capped there (the
    engine refuses a longer max_model_len with a ValueError) instead of computed wrong."""
    original = (scaling.get("original_max_position_embeddings")
                or hf.get("original_max_position_embeddings"))
    if not original:
        raise ValueError("Phi3ForCausalLM longrope needs original_max_position_embeddings")
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_attention_factor=float(attention),
                max_position_embeddings=min(int(original), hf["max_position_embeddings"]))


def layer_weights(r: Reader, cfg, i: int) -> dict:
    p = f"layers.{i}."
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = r.linear(p + "self_attn.qkv_proj")                       # [d, (H + 2K) * Dh]
    gate_up = r.linear(p + "mlp.gate_up_proj")                     # [d, 2F]: gate, then up
    return {"attn_norm": r.get(p + "input_layernorm.weight"),
            "mlp_norm": r.get(p + "post_attention_layernorm.weight"),
            "wq": qkv[:, :q_width], "wk": qkv[:, q_width:q_width + kv_width],
            "wv": qkv[:, q_width + kv_width:], "wo": r.linear(p + "self_attn.o_proj"),
            "w_gate": gate_up[:, :cfg.intermediate_size],
            "w_up": gate_up[:, cfg.intermediate_size:],
            "w_down": r.linear(p + "mlp.down_proj")}
