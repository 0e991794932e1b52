"""Tiny random PEFT adapters for the LoRA tests (peft is a test-only dependency)."""
from __future__ import annotations

import copy

import torch


def write_adapter(base_model, folder: str, r: int, targets: list[str], seed: int,
                  alpha: int | None = None, use_rslora: bool = False):
    """Saves a random (init_lora_weights=False) PEFT adapter for `base_model` into `folder`;
    returns the HF model with the adapter merged (`merge_and_unload`), the reference."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=targets,
                        init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():     # random init is small next to the tiny model: make the delta show
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(folder)
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged


def teacher_forced_logprobs(hf_model, token_ids: list[int]) -> list[float]:
    """log p(token[i] | tokens[:i]) for i >= 1, float32."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, t]) for i, t in enumerate(token_ids) if i >= 1]
