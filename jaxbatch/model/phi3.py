"""Phi-3 / Phi-4-mini: Llama's layer with q, k, v fused in `qkv_proj` and gate, up fused in
`gate_up_proj`, split here at load; a window on every layer when `sliding_window` is set
(HF's Phi3 masks every layer with it); partial rotary (Phi-4-mini) through
`partial_rotary_factor`."""
from __future__ import annotations

from jaxbatch.model.config import windows_from_layer_types
from jaxbatch.model.weights import Reader

ARCHITECTURES = ("Phi3ForCausalLM",)


def config_fields(hf: dict, base: dict) -> dict:
    scaling = dict(base["rope_scaling"] or ())
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in ("longrope", "su"):
        # HF switches between short and long factors by the current sequence length: one
        # fixed frequency table per layer cannot do that yet.
        raise ValueError("Phi3ForCausalLM with rope_scaling type 'longrope' (the long-context "
                         "variants) is not supported yet; the 4k-context checkpoints are")
    no_types = {k: v for k, v in hf.items() if k != "layer_types"}
    return dict(o_bias=False, qkv_bias=False, **windows_from_layer_types(no_types, lambda i: True))


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
