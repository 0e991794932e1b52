"""Capacity and throughput of the int8 options on one KV memory budget (the embedded model).

    jaxbatch bench quant [--context 256] [--base-seqs 8] [--requests 32] [--out DIR]

Capacity: the budget is what --base-seqs sequences of --context tokens need in a float32 cache
(the CPU's model dtype); at that `kv_cache_memory_bytes`, the blocks a float32, bfloat16 and
int8 cache get (scales counted), and the largest max_num_seqs whose full context fits.
Throughput: the same requests (random token prompts of context/2 tokens, greedy outputs of
uniformly drawn lengths in [context/8, context/2 - 1], ignore_eos; mixed lengths keep the slots
of continuous batching busy, so no run ends on a near-empty round) through
  f32 KV        at the float32 cache's largest batch       (the baseline)
  int8 KV       at the int8 cache's largest batch          (same memory, more sequences)
  int8 weights  f32 KV, baseline batch                     (int8 weights alone)
  int8 both     int8 KV + int8 weights, int8 cache's batch
each warmed up on every bucket first; output tokens/s over the whole run and the median
decode-only step time. (One decode step, float32 against int8 weights, alone: the lab's
`python -m benchmarks quant-step`.)
Writes bench_quant.json, prints a markdown table (with the cost per million output tokens at
--price-per-hour).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxbatch import SamplingParams
from jaxbatch.benchmarks.machine import add_price_argument, machine_info, resolve_price
from jaxbatch.benchmarks.report import cost_cell, price_line, table, write_json
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import load_model
from jaxbatch.worker.kv_cache import blocks_for_budget, bytes_per_block

BLOCK_SIZE = 16


def capacity(cfg, budget, context):
    pages = -(-context // BLOCK_SIZE)
    rows = {}
    for name, dtype, kv in (("float32", jnp.float32, "auto"), ("bfloat16", jnp.bfloat16, "auto"),
                            ("int8", jnp.float32, "int8")):
        blocks = blocks_for_budget(cfg, BLOCK_SIZE, dtype, budget, kv)
        rows[name] = {"bytes_per_block": bytes_per_block(cfg, BLOCK_SIZE, dtype, kv),
                      "blocks": blocks, "tokens": (blocks - 1) * BLOCK_SIZE,
                      "max_num_seqs": (blocks - 1) // pages}
    return rows


def run(loaded, requests, slots, context, budget, **kw):
    engine = LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=context,
                       kv_cache_memory_bytes=budget, **kw)          # warms up every bucket
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    first_step = len(engine.step_log)
    start = time.monotonic()
    for i, (prompt, _) in enumerate(requests):
        engine.add_request(str(i), prompt, params[i])
    outputs = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
    seconds = time.monotonic() - start
    log = engine.step_log[first_step:]
    times = np.diff([start] + [s[0] for s in log])
    decode = [dt for dt, s in zip(times, log) if s[3] == s[1] == slots]     # all slots decoding
    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0
    return {"max_num_seqs": slots, "num_total_blocks": stats["num_total_blocks"],
            "kv_cache_dtype": stats["kv_cache_dtype"], "quantization": stats["quantization"],
            "seconds": seconds, "output_tokens": outputs, "output_tokens_per_s": outputs / seconds,
            "full_batch_decode_steps": len(decode),
            "decode_step_ms_median": 1e3 * float(np.median(decode)) if decode else None,
            "warmup_s": engine.warmup_seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="jaxbatch bench quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256, help="max_model_len, tokens per sequence")
    ap.add_argument("--base-seqs", type=int, default=8,
                    help="the budget is what this many full float32 sequences need")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["f32_kv", "int8_kv", "int8_weights",
                                                      "int8_both"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_quant_out")
    add_price_argument(ap)
    args = ap.parse_args(argv)
    loaded = load_model(None, "float32")
    cfg = loaded.config
    pages = -(-args.context // BLOCK_SIZE)
    budget = (args.base_seqs * pages + 1) * bytes_per_block(cfg, BLOCK_SIZE, jnp.float32)
    cap = capacity(cfg, budget, args.context)
    rng = np.random.default_rng(args.seed)
    half = args.context // 2
    requests = [(rng.integers(3, cfg.vocab_size, half).tolist(),
                 int(rng.integers(args.context // 8, half))) for _ in range(args.requests)]
    big, base = cap["int8"]["max_num_seqs"], cap["float32"]["max_num_seqs"]
    variants = {"f32_kv": (base, {}), "int8_kv": (big, dict(kv_cache_dtype="int8")),
                "int8_weights": (base, dict(quantization="int8")),
                "int8_both": (big, dict(kv_cache_dtype="int8", quantization="int8"))}
    report = {"machine": machine_info(), "args": vars(args), "budget_bytes": budget, "capacity": cap, "runs": {}}
    for name in args.variants:
        slots, kw = variants[name]
        print(f"[bench_quant] {name}: {slots} slots", flush=True)
        report["runs"][name] = run(loaded, requests, slots, args.context, budget, **kw)
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["price"] = resolve_price(args.price_per_hour, report["machine"])
    write_json(Path(args.out) / "bench_quant.json", report)
    print(markdown(report))
    return report


def markdown(report) -> str:
    price = report.get("price") or {}
    lines = [f"KV budget {report['budget_bytes'] / 2**20:.1f} MiB, context "
             f"{report['args']['context']} tokens\n",
             table(["KV cache", "bytes/block", "blocks", "tokens", "max_num_seqs at context"],
                   [[name, c["bytes_per_block"], c["blocks"], c["tokens"], c["max_num_seqs"]]
                    for name, c in report["capacity"].items()]), ""]
    rows = []
    for name, r in report["runs"].items():
        step = r["decode_step_ms_median"]
        rows.append([name, r["max_num_seqs"], f"{r['output_tokens_per_s']:.1f}",
                     cost_cell(r["output_tokens_per_s"], price),
                     "n/a" if step is None else f"{step:.1f}", f"{r['seconds']:.1f}"])
    lines.append(table(["variant", "slots", "output tok/s", "$ / M out tok",
                        "full-batch decode step ms", "wall s"], rows))
    lines.append("\n" + price_line(price))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
