"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): pre-norm layers, RoPE with the
checkpoint's scaling, GQA, SwiGLU; Qwen2 adds q/k/v biases, Mistral and Qwen2 windows. The
decoder itself (`decoder.py`, `layers.py`) is shared by every family."""
from __future__ import annotations

from jaxbatch.model.config import windows_from_layer_types
from jaxbatch.model.qwen3 import qwen_windows
from jaxbatch.model.weights import llama_layer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def config_fields(hf: dict, base: dict) -> dict:
    arch = base["architecture"]
    bias = bool(hf.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        return dict(qkv_bias=True, o_bias=False, **qwen_windows(hf))
    fields = dict(qkv_bias=bias, o_bias=bias)
    if arch == "MistralForCausalLM":
        # HF's Mistral masks every layer with its window, whatever layer_types says.
        no_types = {k: v for k, v in hf.items() if k != "layer_types"}
        fields.update(windows_from_layer_types(no_types, lambda i: True))
    return fields


layer_weights = llama_layer
