"""Where the device time of the mixed chat workload goes, executable by executable.

    python -m benchmarks profile [--model DIR] [--num-requests 48] [--max-num-seqs 16]
                           [--prefix-caching] [--dtype float32] [--quantization w8a8]
                           [--no-unified-step] [--block-size 16]

The serve benchmark's workload (bundled prompts, chat template, output lengths lognormal(32, 1) in
[8, 256]) through `LLM.chat` on the embedded model or `--model` (a checkpoint directory, e.g.
`random-checkpoint`'s), greedy, in `--dtype` (float32 unless told), after an untimed pass over
the first max-num-seqs requests. Host/device overlap is off and every executable is waited for,
so each call's wall time is its device time (observer.ExecutableTimer on the runner's hook; the
run is slower than a normal one by the host's share: what it is for is the split). Prints calls and seconds per kind (decode, prefill, sample, ...)
and per key, and the prefill tokens computed against the prompt tokens (bucket padding).

Last, the workload's compute floor: its FLOPs (every prompt and output token through the layer
matrices, the LM head once per output token, attention over each token's context) at the
GEMM peak measured in the same run (`roofline.gemm_peak`), against the device seconds: the
share of the machine's arithmetic the run used, and so the most any engine could gain here.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.observer import ExecutableTimer, observe
from jaxbatch.benchmarks.report import table
from jaxbatch.benchmarks.workloads import make_workload
from jaxbatch.engine.config import QUANTIZATION_METHODS


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                    help="the engine option")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    ap.add_argument("--unified-step", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine option: decode rows inside the step's prefill call")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    from jaxbatch import LLM, SamplingParams

    workload = make_workload(args.num_requests)
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=args.max_num_seqs,
              max_model_len=2048, dtype=args.dtype, async_scheduling=False,
              enable_prefix_caching=args.prefix_caching, prefix_cache_granularity="block",
              unified_step=args.unified_step, block_size=args.block_size)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in workload]
    chats = [[{"role": "user", "content": r.text}] for r in workload]
    llm.chat(chats[:args.max_num_seqs], params[:args.max_num_seqs], use_tqdm=False)

    llm.llm_engine.reset_prefix_cache()
    with observe(llm.llm_engine, ExecutableTimer()) as timer:
        start = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per_key, prefill_tokens, kinds = timer.per_key, timer.prefill_tokens, timer.by_kind()

    print(f"wall {wall:.1f} s, {tokens} output tokens, {tokens / wall:.1f} tok/s "
          f"(overlap off, every call waited for)")
    print(f"prefill tokens: {prefill_tokens['prompt']} in prompts, "
          f"{prefill_tokens['computed']} computed")
    print(table(["kind", "calls", "seconds"],
                [[kind, n, f"{seconds:.2f}"] for kind, (n, seconds) in sorted(kinds.items())]))
    print(table(["key", "calls", "seconds", "ms per call"],
                [[key, n, f"{seconds:.2f}", f"{1e3 * seconds / n:.1f}"]
                 for key, (n, seconds) in sorted(per_key.items(), key=lambda kv: -kv[1][1])]))
    floor = workload_floor(llm.llm_engine, outs)
    device_s = sum(seconds for _, seconds in kinds.values())
    print(f"compute floor: {floor['gflop']:.0f} GFLOP at {floor['peak_tflops']:.2f} TFLOP/s "
          f"(measured) = {floor['seconds']:.2f} s, {tokens / floor['seconds']:.0f} output tok/s; "
          f"device time {device_s:.2f} s = {device_s / floor['seconds']:.2f} x the floor")
    report = {"wall_s": wall, "floor": floor, "device_s": device_s,
              "output_tokens": tokens, "prefill_tokens": prefill_tokens,
              "kinds": {k: {"calls": n, "seconds": s} for k, (n, s) in kinds.items()},
              "keys": {",".join(map(str, k)): {"calls": n, "seconds": s}
                       for k, (n, s) in per_key.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def workload_floor(engine, outs) -> dict:
    """The FLOPs of the run's tokens (see the module doc) and their time at the measured peak."""
    from jaxbatch.benchmarks.roofline import gemm_peak, matmul_params
    cfg = engine.model_config
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim   # q.K and p.V per key
    flops = 0
    for out in outs:
        prompt, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        total = prompt + generated
        flops += 2 * matmul_params(cfg) * total + 2 * cfg.vocab_size * cfg.hidden_size * generated
        flops += attention * total * (total + 1) // 2          # token t attends to t + 1 keys
    peak = gemm_peak(engine.stats()["dtype"])
    return {"gflop": flops / 1e9, "peak_tflops": peak / 1e12, "seconds": flops / peak}


if __name__ == "__main__":
    main()
