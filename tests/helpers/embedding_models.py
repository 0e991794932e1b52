"""Tiny random decoder checkpoints written as embedding models: save_pretrained's layout plus
the files sentence-transformers writes (modules.json, 1_Pooling/config.json), and the Hugging
Face reference: the base model's last hidden state (after the final norm), pooled the same
way."""
from __future__ import annotations

import json
import os

import numpy as np

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=8, query_pre_attn_scalar=24,
                                        sliding_window_pattern=2)),
}
ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token"}


def write_embedding_checkpoint(family: str, folder: str, pooling: str | None = None,
                               normalize: bool = True, matryoshka: list[int] | None = None,
                               seed: int = 0):
    """`pooling` None: no sentence-transformers files (the engine's defaults apply).
    -> the HF model (float32, eval)."""
    import torch
    import transformers
    cls_name, overrides = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**BASE, **overrides})
    if family.startswith("gemma"):
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():      # norms away from identity, so a norm applied wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.eval()
    if matryoshka is not None:
        model.config.matryoshka_dimensions = matryoshka
    model.save_pretrained(folder)
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(folder, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
        with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": BASE["hidden_size"],
                       **{mode: key == pooling for key, mode in ST_MODES.items()}}, f)
    return model


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over "w3" .. "w{V-1}" ("w7 w9" -> [7, 9]), no special tokens
    added, so a text's ids are plain to see."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def hf_embedding(model, prompt: list[int], pooling: str, normalize: bool,
                 dimensions: int | None = None) -> np.ndarray:
    import torch
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(axis=0)}[pooling]
    vector = vector[:dimensions]
    return vector / np.linalg.norm(vector) if normalize else vector
