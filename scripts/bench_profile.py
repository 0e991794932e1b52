"""Where the device time of the mixed chat workload goes, executable by executable.

    python scripts/bench_profile.py [--num-requests 48] [--max-num-seqs 16] [--prefix-caching]

bench_serve's workload (bundled prompts, chat template, output lengths lognormal(32, 1) in
[8, 256]) through `LLM.chat`, greedy, float32, after an untimed pass over the first
max-num-seqs requests. Host/device overlap is off and every executable is waited for, so each
call's wall time is its device time (the run is slower than a normal one by the host's share;
what it is for is the split). Prints calls and seconds per kind (decode, prefill, sample, ...)
and per key, and the prefill tokens computed against the prompt tokens (bucket padding).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    import jax
    from bench_serve import make_workload
    from jaxbatch import LLM, SamplingParams

    workload = make_workload(args.num_requests)
    llm = LLM(max_num_seqs=args.max_num_seqs, max_model_len=2048, dtype=args.dtype,
              async_scheduling=False, enable_prefix_caching=args.prefix_caching,
              prefix_cache_granularity="block")
    runner = llm.llm_engine.runner
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in workload]
    chats = [[{"role": "user", "content": r.text}] for r in workload]
    llm.chat(chats[:args.max_num_seqs], params[:args.max_num_seqs], use_tqdm=False)

    per_key = collections.defaultdict(lambda: [0, 0.0])
    run = runner._run

    def timed_run(key, call_args):
        start = time.perf_counter()
        out = jax.block_until_ready(run(key, call_args))
        per_key[key][0] += 1
        per_key[key][1] += time.perf_counter() - start
        return out

    prefill_tokens = {"prompt": 0, "computed": 0}
    prefill_call = runner.layout.prefill_call

    def counted_prefill_call(chunks, plan, next_tokens):
        call = prefill_call(chunks, plan, next_tokens)
        prefill_tokens["prompt"] += sum(len(c.token_ids) for c in chunks)
        prefill_tokens["computed"] += call.key[1]
        return call

    runner._run = timed_run
    runner.layout.prefill_call = counted_prefill_call
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    kinds = collections.defaultdict(lambda: [0, 0.0])
    for key, (n, seconds) in per_key.items():
        kinds[key[0]][0] += n
        kinds[key[0]][1] += seconds
    print(f"wall {wall:.1f} s, {tokens} output tokens, {tokens / wall:.1f} tok/s "
          f"(overlap off, every call waited for)")
    print(f"prefill tokens: {prefill_tokens['prompt']} in prompts, "
          f"{prefill_tokens['computed']} computed")
    print("| kind | calls | seconds |\n|---|---|---|")
    for kind, (n, seconds) in sorted(kinds.items()):
        print(f"| {kind} | {n} | {seconds:.2f} |")
    print("| key | calls | seconds | ms per call |\n|---|---|---|---|")
    for key, (n, seconds) in sorted(per_key.items(), key=lambda kv: -kv[1][1]):
        print(f"| {key} | {n} | {seconds:.2f} | {1e3 * seconds / n:.1f} |")
    report = {"wall_s": wall, "output_tokens": tokens, "prefill_tokens": prefill_tokens,
              "kinds": {k: {"calls": n, "seconds": s} for k, (n, s) in kinds.items()},
              "keys": {",".join(map(str, k)): {"calls": n, "seconds": s}
                       for k, (n, s) in per_key.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
