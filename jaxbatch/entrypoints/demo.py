"""The main job on the embedded model: a few dozen chat requests of mixed lengths served by
continuous batching, then the same requests in static mode on the same compiled steps.

    python -m jaxbatch.entrypoints.demo [--requests 24] [--max-num-seqs 8] [--show 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

from jaxbatch import LLM, SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning a new language.",
    "What is 12 times 12?",
    "Describe the water cycle step by step.",
    "Who wrote Romeo and Juliet?",
    "Write a short story about a robot who learns to paint.",
    "What are the primary colors?",
    "Explain what a black hole is to a ten-year-old.",
    "Name the planets of the solar system.",
    "Why do leaves change color in autumn?",
]
# Long-tailed answer lengths, as real traffic has: most short, a few long.
MAX_TOKENS = [16, 24, 96, 64, 12, 128, 16, 160, 16, 96, 48, 80]


def run(llm: LLM, conversations, params) -> dict:
    engine = llm.llm_engine
    compile_before = engine.runner.compile_seconds
    steps_before = len(engine.step_log)
    start = time.monotonic()
    outs = llm.chat(conversations, params, use_tqdm=False)
    wall = time.monotonic() - start
    compile_s = engine.runner.compile_seconds - compile_before
    log = engine.step_log[steps_before:]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "outputs": outs, "wall": wall, "compile": compile_s, "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft": statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs),
        "steps": len(log),
        "occupancy": statistics.mean(active for _, active, _, _ in log) / engine.config.max_num_seqs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--show", type=int, default=6, help="answers to print in full")
    args = ap.parse_args()

    print("Loading the embedded SmolLM2-135M-Instruct ...", flush=True)
    llm = LLM(max_num_seqs=args.max_num_seqs, max_model_len=1024)
    engine = llm.llm_engine
    print(f"loaded in {engine.load_seconds:.1f} s; {engine.config.num_blocks - 1} KV blocks of "
          f"{engine.config.block_size} tokens; attention: {engine.runner.backend}")
    # Same weights, same compiled steps, same KV pool: only the scheduling differs.
    static = LLM.from_engine(LLMEngine(
        loaded=engine.loaded, runner=engine.runner, batching="static",
        max_num_seqs=args.max_num_seqs, max_model_len=1024, num_blocks=engine.config.num_blocks))

    conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                     for i in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)])
              for i in range(args.requests)]
    # LLM() compiled (or loaded from the cache) every shape either mode can produce, and ran
    # each model step once (warmup_runs), so the timed runs below measure serving, never the
    # compiler or an executable's first-run setup.
    report = engine.runner.warmup_report
    print(f"warm-up: {report['executables']} executables in {engine.warmup_seconds:.1f} s "
          f"(tracing {report['lower_s']:.1f} s, first runs {report['run_s']:.1f} s, "
          f"compiling or reading the cache besides {report['compile_s']:.1f} s)")
    results = {"continuous": run(llm, conversations, params)}
    results["static"] = run(static, conversations, params)
    after = engine.stats()["num_compilations_after_warmup"]
    print(f"compilations after warm-up: {after}")

    for conv, out in list(zip(conversations, results["continuous"]["outputs"]))[: args.show]:
        print(f"\n> {conv[0]['content']}\n{out.outputs[0].text.strip()}  [{out.outputs[0].finish_reason}]")
    same = [o.outputs[0].token_ids for o in results["continuous"]["outputs"]] == \
           [o.outputs[0].token_ids for o in results["static"]["outputs"]]
    print(f"\n{args.requests} requests, {args.max_num_seqs} slots; identical outputs in both modes: {same}")
    print("| mode | output tokens | steps | tokens/s | mean TTFT s | slot occupancy | compile s |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['tokens']} | {r['steps']} | {r['tok_s']:.1f} | {r['ttft']:.2f} | "
              f"{r['occupancy']:.0%} | {r['compile']:.1f} |")
    c, s = results["continuous"], results["static"]
    print(f"continuous / static: {c['tok_s'] / s['tok_s']:.2f}x tokens/s, {s['steps'] / c['steps']:.2f}x fewer steps")


if __name__ == "__main__":
    main()
