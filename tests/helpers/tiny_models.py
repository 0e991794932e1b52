"""Tiny random Hugging Face checkpoints of each supported variant, and their params for us."""
from __future__ import annotations

import numpy as np

VARIANTS = {
    # name: (transformers config class name, overrides)
    "llama_tied_mha": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_untied_gqa2": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_gqa4_bias": ("LlamaConfig", dict(num_key_value_heads=1, attention_bias=True)),
    "llama3_rope_scaling": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_linear_rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "linear", "factor": 4.0})),
    "qwen2_qkv_bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # head_dim 32 (the others' is 16) in a group of 8: decode attention's AMX variant
    "llama_gqa8_head_dim_32": ("LlamaConfig", dict(hidden_size=256, num_attention_heads=8,
                                                   num_key_value_heads=1)),
}


def make_hf_model(variant: str, seed: int = 0):
    import torch
    import transformers
    cls_name, overrides = VARIANTS[variant]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
                rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    config = getattr(transformers, cls_name)(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init has tiny weights; scale biases up so a missing bias would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.eval()
    return model


def ours_from_hf(model):
    """(ModelConfig, float32 params) converted the same way the loader converts checkpoints."""
    import jax.numpy as jnp
    import jax
    from jaxbatch.model.registry import config_from_hf
    from jaxbatch.model.weights import params_from_hf_state
    cfg = config_from_hf(model.config.to_dict())
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = params_from_hf_state(cfg, state, "tiny")
    return cfg, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def random_token_prompts(rng: np.random.Generator, lengths, vocab: int = 256):
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]
