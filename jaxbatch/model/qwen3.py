"""Qwen3: Llama's layer with an RMSNorm over each head's q and k before RoPE."""
from __future__ import annotations

from jaxbatch.model.config import windows_from_layer_types
from jaxbatch.model.weights import llama_layer

ARCHITECTURES = ("Qwen3ForCausalLM",)


def qwen_windows(hf: dict) -> dict:
    """Qwen2/3 slide only with `use_sliding_window`, on layers from `max_window_layers` on
    (HF's own layer_types say so when the config was written by transformers 5)."""
    if not hf.get("use_sliding_window", False):
        return {}
    first = hf.get("max_window_layers", 0)
    return windows_from_layer_types(hf, lambda i: i >= first)


def config_fields(hf: dict, base: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))     # Qwen3's bias covers o_proj too
    return dict(qk_norm=True, qkv_bias=bias, o_bias=bias, **qwen_windows(hf))


layer_weights = llama_layer
