"""What LoRA adapters cost a decode step: a random model of the embedded model's shapes (SmolLM2-135M:
hidden 576, 30 layers) with random rank-16 PEFT adapters on all seven layer matrices; decode
steps at 16 and 64 rows with 0, 1 and `max_loras` adapters active, against the same model in an
engine without LoRA. Engines take turns, `--rounds` times (the machine is shared). Adapters
are written in PEFT's format directly (`adapter_config.json` + `adapter_model.safetensors`), so
neither torch nor peft is needed. (The batch delta's two forms alone: the lab's
`python -m benchmarks lora-delta`.)

    python -m jaxbatch bench lora --rows 16 64 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from jaxbatch.benchmarks.machine import machine_info
from jaxbatch.benchmarks.report import table, write_report

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def matrix_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each target matrix."""
    q, kv, d, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def write_random_adapter(folder: str, cfg, rank: int, seed: int) -> None:
    """A PEFT LoRA directory: A [r, in] and B [out, r] per layer and target, small random values."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (n_in, n_out) in matrix_shapes(cfg).items():
        for layer in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) /
                                                  np.sqrt(n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) *
                                                  0.01).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "use_rslora": False, "bias": "none"}, f)


def decode_step_ms(engine, rows: int, lora_requests, tokens: int, tag: str) -> float:
    """Median wall time of the steps where all `rows` requests decode (prefill steps and the
    last ones, as rows finish, left out)."""
    from jaxbatch import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(rows):
        kw = {"lora_request": lora_requests[i % len(lora_requests)]} if lora_requests else {}
        engine.add_request(f"{tag}-{i}", [5 + i, 6, 7, 8], sp, **kw)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[4:-2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--model", default="small", help="a shape of random_models.MODEL_SHAPES")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench_out/lora")
    args = ap.parse_args(argv)
    from jaxbatch import LoRARequest
    from jaxbatch.benchmarks.random_models import random_model
    from jaxbatch.engine.llm_engine import LLMEngine
    loaded = random_model(args.model, dtype=args.dtype)
    cfg = loaded.config
    root = tempfile.mkdtemp(prefix="jaxbatch-lora-bench-")
    adapters = []
    for i in range(args.max_loras):
        write_random_adapter(os.path.join(root, str(i)), cfg, args.rank, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, os.path.join(root, str(i))))
    common = dict(loaded=loaded, max_model_len=128, max_num_seqs=max(args.rows),
                  compilation_cache=False, enable_prefix_caching=False)
    plain = LLMEngine(**common)
    lora = LLMEngine(**common, enable_lora=True, max_loras=args.max_loras,
                     max_lora_rank=args.rank)
    cases = [("no LoRA engine", plain, []), ("LoRA engine, 0 adapters", lora, []),
             ("LoRA engine, 1 adapter", lora, adapters[:1]),
             (f"LoRA engine, {args.max_loras} adapters", lora, adapters)]
    results = {(name, rows): [] for name, _, _ in cases for rows in args.rows}
    for r in range(args.rounds):
        for rows in args.rows:
            for name, engine, active in cases:
                ms = decode_step_ms(engine, rows, active, args.tokens, f"{r}-{rows}-{name}")
                results[(name, rows)].append(ms)
                print(f"round {r}, {rows} rows, {name}: {ms:.2f} ms", flush=True)
    table_rows = []
    for name, _, _ in cases:
        row = [name]
        for rows in args.rows:
            med = statistics.median(results[(name, rows)])
            base = statistics.median(results[("no LoRA engine", rows)])
            row.append(f"{med:.1f} ms ({med / base:.2f}x)")
        table_rows.append(row)
    md = table(["decode step (median)"] + [f"{rows} rows" for rows in args.rows], table_rows)
    print(md)
    report = {"machine": machine_info(), "args": vars(args),
              "compilations_after_warmup": [plain.stats()["num_compilations_after_warmup"],
                                            lora.stats()["num_compilations_after_warmup"]],
              "results": {f"{name} @ {rows}": v for (name, rows), v in results.items()}}
    for path in write_report(args.out, "lora", report, md):
        print("wrote", path)
    return 0
