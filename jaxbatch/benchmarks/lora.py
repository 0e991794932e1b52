"""What LoRA adapters cost a decode step: a random model of the embedded shapes with random
rank-16 PEFT adapters on all seven layer matrices; full-batch decode steps at 16 and 64 rows
with 0, 1 and `max_loras` adapters active, against an engine without LoRA, in turns --rounds
times. (The batch delta's forms alone: `python -m benchmarks lora-delta`.)"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from jaxbatch.benchmarks.ab import ABBenchmark, compare, full_decode_step_ms
from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.harness import drive
from jaxbatch.benchmarks.report import table

def write_random_adapter(folder: str, cfg, rank: int, seed: int) -> None:
    """A PEFT LoRA directory: A [r, in] and B [out, r] per layer and target, small random values."""
    from safetensors.numpy import save_file
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, f = cfg.hidden_size, cfg.intermediate_size
    targets = {"q_proj": ("self_attn", d, q), "k_proj": ("self_attn", d, kv),
               "v_proj": ("self_attn", d, kv), "o_proj": ("self_attn", q, d),
               "gate_proj": ("mlp", d, f), "up_proj": ("mlp", d, f), "down_proj": ("mlp", f, d)}
    rng, tensors = np.random.default_rng(seed), {}
    for module, (block, n_in, n_out) in targets.items():
        for layer in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) /
                                                  np.sqrt(n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) *
                                                  0.01).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(targets), "use_rslora": False, "bias": "none"}, f)


class LoRA(ABBenchmark):
    name = "lora"

    def add_arguments(self, ap) -> None:
        ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
        add_flags(ap, max_loras=4, rank=16, tokens=(24, "tokens per request"),
                  model=("small", "a shape of random_models.MODEL_SHAPES"))
        ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))

    def load(self, args):
        from jaxbatch.benchmarks.random_models import random_model
        return random_model(args.model, dtype=args.dtype)

    def bench(self, loaded, args) -> dict:
        from jaxbatch import LLMEngine, LoRARequest, SamplingParams
        root, adapters = tempfile.mkdtemp(prefix="jaxbatch-lora-bench-"), []
        for i in range(args.max_loras):
            write_random_adapter(os.path.join(root, str(i)), loaded.config, args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, os.path.join(root, str(i))))
        common = dict(loaded=loaded, max_model_len=128, max_num_seqs=max(args.rows),
                      compilation_cache=False, enable_prefix_caching=False)
        plain = LLMEngine(**common)
        lora = LLMEngine(**common, enable_lora=True, max_loras=args.max_loras,
                         max_lora_rank=args.rank)
        cases = {"no LoRA engine": (plain, []), "LoRA engine, 0 adapters": (lora, []),
                 "LoRA engine, 1 adapter": (lora, adapters[:1]),
                 f"LoRA engine, {args.max_loras} adapters": (lora, adapters)}
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

        def measure(case, rows):
            engine, active = cases[case]
            requests = [([5 + i, 6, 7, 8], params,
                         {"lora_request": active[i % len(active)]} if active else {})
                        for i in range(rows)]
            return {"decode_step_ms": full_decode_step_ms(drive(engine, requests)["steps"], rows)}
        results = {rows: compare(cases, args.rounds, lambda case, _: measure(case, rows),
                                 keep=("decode_step_ms",)) for rows in args.rows}
        return {"cases": list(cases), "results": results, "compilations_after_warmup": [
            e.stats()["num_compilations_after_warmup"] for e in (plain, lora)]}

    def markdown(self, report) -> str:
        results = report["results"]
        rows = [[case] + [f"{r[case]['decode_step_ms']:.1f} ms "
                          f"({r['ratio'][case]['decode_step_ms']:.2f}x)" for r in results.values()]
                for case in report["cases"]]
        return table(["decode step (median)"] + [f"{rows} rows" for rows in results], rows)


main = LoRA().main
