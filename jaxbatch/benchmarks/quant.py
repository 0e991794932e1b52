"""Capacity and throughput of the int8 options on one KV memory budget (the embedded model).

The budget is what --base-seqs float32 sequences of --context tokens need: the blocks a float32,
bfloat16 and int8 cache get from it and the largest max_num_seqs that fits. The same requests
(mixed output lengths, ignore_eos), in turns --rounds times, through f32_kv (the baseline),
int8_kv (the int8 cache's batch), int8_weights and int8_both: output tokens/s and the median
full-batch decode step. (One step alone: `python -m benchmarks quant-step`.)"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxbatch import LLMEngine, SamplingParams
from jaxbatch.benchmarks.ab import ABBenchmark, compare, full_decode_step_ms, tok_s_cells
from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.harness import drive
from jaxbatch.benchmarks.report import fmt, table
from jaxbatch.worker.kv_cache import blocks_for_budget, bytes_per_block

BLOCK_SIZE = 16
VARIANTS = ("f32_kv", "int8_kv", "int8_weights", "int8_both")


def capacity(cfg, budget, context):
    pages, rows = -(-context // BLOCK_SIZE), {}
    for name, dtype, kv in (("float32", jnp.float32, "auto"), ("bfloat16", jnp.bfloat16, "auto"),
                            ("int8", jnp.float32, "int8")):
        blocks = blocks_for_budget(cfg, BLOCK_SIZE, dtype, budget, kv)
        rows[name] = {"bytes_per_block": bytes_per_block(cfg, BLOCK_SIZE, dtype, kv),
                      "blocks": blocks, "tokens": (blocks - 1) * BLOCK_SIZE,
                      "max_num_seqs": (blocks - 1) // pages}
    return rows


def run(engine, requests) -> dict:
    out, slots = drive(engine, requests), engine.config.max_num_seqs
    assert out["stats"]["num_compilations"] == 0, "compiled after warm-up"
    return {"max_num_seqs": slots, "seconds": out["duration_s"],
            "output_tokens_per_s": out["output_tokens_per_s"],
            "decode_step_ms_median": full_decode_step_ms(out["steps"], slots)}


class Quant(ABBenchmark):
    name = "quant"
    rounds = 1

    def add_arguments(self, ap) -> None:
        add_flags(ap, context=(256, "max_model_len, tokens per sequence"), requests=64,
                  base_seqs=(8, "the budget is what this many full float32 sequences need"))
        ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)

    def bench(self, loaded, args) -> dict:
        cfg, pages = loaded.config, -(-args.context // BLOCK_SIZE)
        budget = (args.base_seqs * pages + 1) * bytes_per_block(cfg, BLOCK_SIZE, jnp.float32)
        cap = capacity(cfg, budget, args.context)
        rng, half = np.random.default_rng(args.seed), args.context // 2
        requests = [(rng.integers(3, cfg.vocab_size, half).tolist(), SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=int(rng.integers(args.context // 8, half))))
            for _ in range(args.requests)]
        big, base = cap["int8"]["max_num_seqs"], cap["float32"]["max_num_seqs"]
        options = {"f32_kv": (base, {}), "int8_kv": (big, dict(kv_cache_dtype="int8")),
                   "int8_weights": (base, dict(quantization="int8")),
                   "int8_both": (big, dict(kv_cache_dtype="int8", quantization="int8"))}
        engines = {name: LLMEngine(loaded=loaded, max_num_seqs=options[name][0],
                                   max_model_len=args.context, kv_cache_memory_bytes=budget,
                                   **options[name][1])          # warms up every bucket
                   for name in args.variants}
        return {"budget_bytes": budget, "capacity": cap,
                "runs": compare(engines, args.rounds, lambda v, _: run(engines[v], requests))}

    def markdown(self, report) -> str:
        lines = [f"KV budget {report['budget_bytes'] / 2**20:.1f} MiB, context "
                 f"{report['args']['context']} tokens\n",
                 table(["KV cache", "bytes/block", "blocks", "tokens", "max_num_seqs at context"],
                       [[name, c["bytes_per_block"], c["blocks"], c["tokens"], c["max_num_seqs"]]
                        for name, c in report["capacity"].items()]), ""]
        runs = report["runs"]
        rows = [[name, r["max_num_seqs"], *tok_s_cells(r["output_tokens_per_s"], report["price"]),
                 f"{runs['ratio'][name]['output_tokens_per_s']:.2f}",
                 fmt(r["decode_step_ms_median"]),
                 f"{r['seconds']:.1f}"] for name, r in runs.items() if name != "ratio"]
        lines.append(table(["variant", "slots", "output tok/s", "$ / M out tok",
                            f"vs {next(iter(runs))}", "full-batch decode step ms", "wall s"], rows))
        return "\n".join(lines)


main = Quant().main
