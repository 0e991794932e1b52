"""A random-weight Hugging Face checkpoint of a real model's shape, written by
`save_pretrained` (the real layout: every engine loads it as it loads the real model), with the
embedded model's tokenizer, so jaxbatch, vLLM and llama.cpp can be compared at sizes people run
on a machine without the real weights.

    python -m benchmarks random-checkpoint --shape tinyllama-1.1b --out ckpt/tinyllama-1.1b-random

Weights ~ N(0, 0.02^2) (transformers' initializer_range), stored in bf16; the vocabulary is the
tokenizer's (49,152), so prompts and outputs are real text tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# Llama-family shapes: (hidden, intermediate, layers, heads, kv heads, tied embeddings)
SHAPES = {
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}


def write(shape: str, out: str, seed: int = 0) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxbatch.model.loader import load_tokenizer, resolve_source
    hidden, intermediate, layers, heads, kv_heads, tied = SHAPES[shape]
    tokenizer = load_tokenizer(resolve_source(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=tied, max_position_embeddings=4096,
                         rope_theta=10000.0, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"shape": shape, "out": out, "parameters": sum(p.numel() for p in model.parameters())}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks random-checkpoint",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(json.dumps(write(args.shape, args.out, args.seed)))
    return 0


if __name__ == "__main__":
    main()
