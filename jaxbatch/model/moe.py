"""Mixture-of-experts families: Mixtral and Qwen3-MoE.

Every layer's MLP is a routed block (`layers.moe_block`): router logits -> softmax over the
experts -> top-k -> (renormalised: Mixtral always, Qwen3-MoE with `norm_topk_prob`) weights
of k SwiGLU experts. Expert weights are stacked per layer: we_gate, we_up [E, d, F],
we_down [E, F, d], w_router [d, E]. Checkpoints hold one tensor per expert
(`...experts.{e}.w1` for Mixtral, `...experts.{e}.gate_proj` for Qwen3-MoE) as
`save_pretrained` writes them; transformers 5's in-memory fused layout
(`experts.gate_up_proj` [E, 2F, d], `experts.down_proj` [E, d, F]) is read too.
Qwen3-MoE also has Qwen3's q/k norms. Qwen3-MoE checkpoints with dense layers among the
sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused: one scanned layer
body serves every layer.
"""
from __future__ import annotations

import numpy as np

from jaxbatch.model.config import windows_from_layer_types
from jaxbatch.model.qwen3 import qwen_windows
from jaxbatch.model.weights import Reader, attention_weights

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def config_fields(hf: dict, base: dict) -> dict:
    arch = base["architecture"]
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    fields = dict(num_experts=int(num_experts), num_experts_per_tok=int(hf["num_experts_per_tok"]))
    if arch == "MixtralForCausalLM":
        no_types = {k: v for k, v in hf.items() if k != "layer_types"}
        return dict(fields, moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    **windows_from_layer_types(no_types, lambda i: True))
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen3MoeForCausalLM with dense layers among the experts "
                         "(mlp_only_layers / decoder_sparse_step > 1) is not supported")
    bias = bool(hf.get("attention_bias", False))
    return dict(fields, moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True,
                qkv_bias=bias, o_bias=bias, **qwen_windows(hf))


def _experts(r: Reader, cfg, block: str, names: tuple[str, str, str]) -> dict:
    """(gate, up, down) names of one expert's projections -> stacked [in, out] matrices."""
    if r.has(f"{block}experts.gate_up_proj"):
        gate_up = np.swapaxes(r.get(f"{block}experts.gate_up_proj"), 1, 2)      # [E, d, 2F]
        f = gate_up.shape[-1] // 2
        return {"we_gate": gate_up[..., :f], "we_up": gate_up[..., f:],
                "we_down": np.swapaxes(r.get(f"{block}experts.down_proj"), 1, 2)}
    out = {}
    for short, name in zip(("we_gate", "we_up", "we_down"), names):
        out[short] = np.stack([r.linear(f"{block}experts.{e}.{name}")
                               for e in range(cfg.num_experts)])
    return out


def layer_weights(r: Reader, cfg, i: int) -> dict:
    p = f"layers.{i}."
    if cfg.architecture == "MixtralForCausalLM":
        block = p + ("block_sparse_moe." if r.has(p + "block_sparse_moe.gate.weight") else "mlp.")
        names = ("w1", "w3", "w2")
    else:
        block, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    return {"attn_norm": r.get(p + "input_layernorm.weight"),
            "mlp_norm": r.get(p + "post_attention_layernorm.weight"),
            **attention_weights(r, cfg, p), "w_router": r.linear(block + "gate"),
            **_experts(r, cfg, block, names)}
