"""Tiny random Hugging Face checkpoints of every registered family, written by save_pretrained
(the real checkpoint layout), with a small word-level tokenizer saved beside them."""
from __future__ import annotations

import os

# hidden 64, 4 layers, GQA 4/2, head_dim 16, a window of 8 shorter than the prompts.
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
WINDOW = 8
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES = {
    # name: (transformers config class, overrides)
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=2)),
    # Soft caps low enough to bite on a random model (Gemma 2 ships 50 and 30).
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=0.5, final_logit_softcapping=3.0,
                                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                        sliding_window_pattern=2, rope_parameters={
                                            "full_attention": {"rope_type": "linear",
                                                               "factor": 4.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 1e4}})),
    # Phi-4-mini's rope: longrope (short factors within 128 positions) on 3/4 of each head.
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, head_dim=None,
                                original_max_position_embeddings=128,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.75,
                                                 "short_factor": [1.0, 1.3, 1.9, 2.6, 4.0, 7.5],
                                                 "long_factor": [1.5, 3.0, 6.0, 12.0, 24.0,
                                                                 48.0]})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=WINDOW)),
    # Renormalised top-k weights are Mixtral's (always); Qwen3-MoE here without them.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, norm_topk_prob=False, **MOE)),
}


def hf_config(name: str):
    import transformers
    cls_name, overrides = FAMILIES[name]
    kwargs = {k: v for k, v in {**BASE, **overrides}.items() if v is not None}
    return getattr(transformers, cls_name)(**kwargs)


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer over "w3" .. "w{V-1}" with <pad>, <s>, </s> as ids 0, 1, 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def write_checkpoint(name: str, folder: str, seed: int = 0):
    """save_pretrained of a random `name` model (float32) and its tokenizer -> the HF model."""
    import torch
    import transformers
    config = hf_config(name)
    if name.startswith("gemma"):
        config._attn_implementation = "eager"     # what Gemma is defined against
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Random init has norms at identity (or 0 for Gemma's 1 + w) and tiny weights:
            # perturb the norms so a norm applied wrongly shows.
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.3)
    model.eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    make_tokenizer(config.vocab_size).save_pretrained(folder)
    return model
