"""Model hyper-parameters as a frozen record. Built from a Hugging Face config dict; reads no disk."""
from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hashable form of HF's rope_scaling dict: tuple of (key, value) pairs, or None.
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2, and Llama with attention_bias
    o_bias: bool = False            # Llama with attention_bias
    # The longest sequence this engine runs the model at. For a model with a sliding attention
    # window narrower than the checkpoint's max_position_embeddings it is the window: the
    # engine's attention is full causal, which equals sliding-window attention only while a
    # sequence fits in the window, so longer sequences are refused (LLMEngine raises when
    # max_model_len exceeds this) instead of computed wrong.
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None       # the checkpoint's window, when it applies

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        model_type = hf.get("model_type", "llama")
        if archs[0] not in SUPPORTED_ARCHITECTURES and model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported architecture {archs[0]!r} (model_type {model_type!r}); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope_scaling is not None:
            rope_theta = rope_theta or rope_scaling.get("rope_theta")
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if rope_type == "default" else tuple(sorted(
                (k, v) for k, v in rope_scaling.items() if k != "rope_theta"))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        is_qwen2 = model_type == "qwen2" or archs[0] == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        max_positions = hf.get("max_position_embeddings", 2048)
        window = sliding_window_of(hf)
        if window is not None and window < max_positions:
            max_positions = window
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            max_position_embeddings=max_positions,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )


def sliding_window_of(hf: dict[str, Any]) -> int | None:
    """The attention window a Hugging Face config applies to every layer, or None.

    Mistral applies `sliding_window` whenever it is set (null in Mistral 7B v0.2 and later).
    Qwen2 only with `use_sliding_window`, and then only from layer `max_window_layers` on; a
    window on some layers only is refused here, as there is no per-layer window in the engine.
    Llama has none."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    model_type = hf.get("model_type", "llama")
    archs = hf.get("architectures") or []
    if model_type == "qwen2" or "Qwen2ForCausalLM" in archs:
        if not hf.get("use_sliding_window", False):
            return None
        first = hf.get("max_window_layers", 0)
        if 0 < first < hf["num_hidden_layers"]:
            raise ValueError(f"this Qwen2 checkpoint uses a sliding window from layer {first} "
                             f"of {hf['num_hidden_layers']} on; per-layer windows are not "
                             "supported")
        return int(window) if first == 0 else None
    if model_type == "mistral" or "MistralForCausalLM" in archs:
        return int(window)
    return None
