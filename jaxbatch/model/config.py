"""Model hyper-parameters as a frozen record. Built from a Hugging Face config dict; reads no disk.

`registry.config_from_hf` reads the fields every decoder shares here (`base_fields`) and lets
the checkpoint's family (`model/registry.py`, keyed by `architectures`) add what is its own:
q/k norms, sandwich norms, per-layer windows and RoPE bases, soft-capping, experts. Every field
a family adds has a default that means "as in Llama", so a config built by hand for a Llama
test stays valid. Host side: imports neither JAX nor the family files until asked to parse.
"""
from __future__ import annotations

import dataclasses
from typing import Any

NO_WINDOW = 0        # in `layer_windows`: the layer attends to its whole causal context

# Configs without `architectures` (models built with from_config, old exports) name their
# family by model_type only.
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def architecture_of(hf: dict[str, Any]) -> str:
    """`architectures[0]`; else the model_type's; else Llama, as before the registry."""
    archs = hf.get("architectures")
    if archs:
        return archs[0]
    model_type = hf.get("model_type", "llama")
    if model_type not in _ARCH_OF_MODEL_TYPE:
        raise ValueError(f"config.json has no architectures and an unsupported model_type "
                         f"{model_type!r}; supported: {', '.join(_ARCH_OF_MODEL_TYPE)}")
    return _ARCH_OF_MODEL_TYPE[model_type]


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
    # The checkpoint's own limit. Sliding windows no longer cap it: every attention backend
    # applies the window (`layer_windows`), so a sequence may outgrow it. Phi-3's longrope
    # caps it at original_max_position_embeddings (model/phi3.py says why).
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None       # the widest window any layer applies, if any
    architecture: str = "LlamaForCausalLM"
    # ---- what families add (defaults: Llama) ----
    hidden_act: str = "silu"                # "silu" | "gelu_tanh" (Gemma's gelu_pytorch_tanh)
    norm_offset: float = 0.0                # Gemma's RMSNorm scales by (offset + w), offset 1
    qk_norm: bool = False                   # Qwen3, Gemma 3: RMSNorm per head on q, k
    sandwich_norm: bool = False             # Gemma 2/3: norms after attention and MLP too
    embed_scale: float | None = None        # Gemma: embeddings x sqrt(hidden)
    query_pre_attn_scalar: float | None = None   # Gemma: scores scaled by this ** -0.5
    attn_soft_cap: float | None = None      # Gemma 2: cap * tanh(score / cap)
    final_soft_cap: float | None = None     # Gemma 2: the same on the logits
    # Per layer: the window (NO_WINDOW: full). None when no layer has one (the kernels then
    # take no window at all and compile exactly as before).
    layer_windows: tuple[int, ...] | None = None
    # Per layer (theta, rope_scaling tuple) where layers differ (Gemma 3's local/global); None:
    # every layer uses rope_theta / rope_scaling.
    layer_rope: tuple[tuple[float, tuple | None], ...] | None = None
    partial_rotary_factor: float = 1.0      # Phi-4-mini rotates 3/4 of each head
    rope_attention_factor: float = 1.0      # longrope: cos and sin scaled by this
    num_experts: int = 0                    # > 0: every layer's MLP is a routed MoE block
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True             # renormalise the top-k router weights

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        for name in ("layer_windows", "layer_rope"):
            value = getattr(self, name)
            if value is not None and len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def attention_scale(self) -> float:
        """What q @ k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def rope_of(params: dict[str, Any] | None, theta: float | None = None):
    """(theta, hashable scaling or None) from one HF rope dict (`rope_scaling` or
    `rope_parameters`; "default" scaling is None)."""
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or theta or 10000.0
    params.pop("partial_rotary_factor", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Lists (longrope's factors) become tuples: the config is hashed as a compile key.
    scaling = None if rope_type == "default" or not params else tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    return float(theta), scaling


def base_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every supported decoder reads the same way."""
    num_heads = hf["num_attention_heads"]
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if rope is not None and "rope_theta" not in rope and "rope_type" not in rope \
            and "type" not in rope:
        rope = None                         # per layer type (Gemma 3): the family reads it
    theta, scaling = rope_of(rope, hf.get("rope_theta"))
    partial = (hf.get("partial_rotary_factor")
               or (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=architecture_of(hf),
        partial_rotary_factor=float(partial),
    )


def windows_from_layer_types(hf: dict[str, Any], default_sliding) -> dict[str, Any]:
    """{layer_windows, sliding_window} from HF's `layer_types` ("sliding_attention" layers get
    `sliding_window`), or, for configs written before layer_types existed, from
    `default_sliding(i)` -> bool. Nothing when the config has no window."""
    window = hf.get("sliding_window")
    if window is None:
        return {}
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    sliding = ([t == "sliding_attention" for t in types] if types
               else [bool(default_sliding(i)) for i in range(num_layers)])
    if len(sliding) != num_layers:
        raise ValueError(f"layer_types has {len(sliding)} entries for {num_layers} layers")
    if not any(sliding):
        return {}
    return dict(layer_windows=tuple(int(window) if s else NO_WINDOW for s in sliding),
                sliding_window=int(window))
