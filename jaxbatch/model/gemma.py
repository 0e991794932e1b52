"""Gemma 2 and Gemma 3 (text).

Both: RMSNorm scaling by (1 + w), embeddings x sqrt(hidden), GELU-tanh MLP, sandwich norms
(input_layernorm -> attention -> post_attention_layernorm, pre_feedforward_layernorm -> MLP
-> post_feedforward_layernorm), scores scaled by query_pre_attn_scalar ** -0.5, tied
embeddings by default, sliding-window layers interleaved with full ones.
Gemma 2: attention-logit and final-logit soft-capping; every other layer slides (0, 2, ...).
Gemma 3: q/k RMSNorm per head, no soft-capping, `layer_types` (five sliding to one full), and
a RoPE base per layer type: `rope_local_base_freq` (or rope_parameters["sliding_attention"])
on sliding layers, rope_theta and the checkpoint's scaling on full ones.
"""
from __future__ import annotations

import math

from jaxbatch.model.config import rope_of, windows_from_layer_types
from jaxbatch.model.weights import Reader, attention_weights, mlp_weights

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def config_fields(hf: dict, base: dict) -> dict:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{base['architecture']} with hidden_activation={act!r} is not "
                         "supported; Gemma checkpoints use gelu_pytorch_tanh")
    fields = dict(
        hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norm=True,
        embed_scale=math.sqrt(hf["hidden_size"]),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or base["head_dim"]),
        attn_soft_cap=hf.get("attn_logit_softcapping"),
        final_soft_cap=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
    if base["architecture"] == "Gemma2ForCausalLM":
        fields.update(windows_from_layer_types(hf, lambda i: i % 2 == 0))
        return fields
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    fields.update(qk_norm=True, **windows_from_layer_types(hf, lambda i: (i + 1) % pattern))
    fields.update(_gemma3_rope(hf, fields.get("layer_windows")))
    return fields


def _gemma3_rope(hf: dict, windows) -> dict:
    params = hf.get("rope_parameters") or {}
    if "sliding_attention" in params or "full_attention" in params:     # transformers 5
        full = rope_of(params.get("full_attention"), hf.get("rope_theta"))
        local = rope_of(params.get("sliding_attention"), hf.get("rope_local_base_freq"))
    else:                                                           # rope_scaling: global only
        full = rope_of(hf.get("rope_scaling") or params, hf.get("rope_theta") or 1e6)
        local = (float(hf.get("rope_local_base_freq") or 10000.0), None)
    sliding = [bool(w) for w in windows] if windows else [False] * hf["num_hidden_layers"]
    return dict(rope_theta=full[0], rope_scaling=full[1],
                layer_rope=tuple(local if s else full for s in sliding))


def layer_weights(r: Reader, cfg, i: int) -> dict:
    p = f"layers.{i}."
    return {"attn_norm": r.get(p + "input_layernorm.weight"),
            "post_attn_norm": r.get(p + "post_attention_layernorm.weight"),
            "mlp_norm": r.get(p + "pre_feedforward_layernorm.weight"),
            "post_mlp_norm": r.get(p + "post_feedforward_layernorm.weight"),
            **attention_weights(r, cfg, p), **mlp_weights(r, p)}
