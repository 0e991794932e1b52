"""HF transformers `generate` on vs-vllm's workload (the same 48 chat requests and per-request
output lengths), static batching as users write it: groups of 16 in order, left-padded, greedy,
each group running to its longest output (hf_baselines.run_hf_generate). Output tok/s counts only
each request's own tokens. One untimed pass of the first group (shortened) first, then --passes
timed passes; writes one JSON object. Its own process, so torch's threads never share a
process with XLA's:

    python -m benchmarks.hf_offline --model hf_export/SmolLM2-135M-Instruct --dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

from benchmarks import emit_json
from jaxbatch.benchmarks.workloads import Request, encode_prompts, make_workload


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hf_offline",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF directory (scripts/export_safetensors.py)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the static group's size")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from benchmarks.hf_baselines import run_hf_generate
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    workload = make_workload(args.num_prompts)
    prompts = encode_prompts([{"text": r.text} for r in workload],
                             AutoTokenizer.from_pretrained(args.model))
    requests = [Request(str(r.idx), ids, r.max_tokens, kind=r.kind)
                for r, ids in zip(workload, prompts)]
    warm = [dataclasses.replace(r, output_len=4) for r in requests[:args.max_num_seqs]]
    run_hf_generate(model, warm, args.max_num_seqs, progress=False)
    passes = []
    for _ in range(args.passes):
        t = time.perf_counter()
        run = run_hf_generate(model, requests, args.max_num_seqs, progress=False)
        seconds = time.perf_counter() - t
        n_out = sum(len(tr.token_times) for tr in run.traces)
        passes.append({"seconds": round(seconds, 3), "output_tokens": n_out,
                       "output_tokens_per_s": round(n_out / seconds, 2)})
    result = {"engine": "hf generate", "transformers_version": transformers.__version__,
              "torch_version": torch.__version__, "model": args.model, "dtype": args.dtype,
              "threads": args.threads, "group_size": args.max_num_seqs,
              "num_prompts": len(requests),
              "expected_output_tokens": sum(r.output_len for r in requests),
              "loadavg": os.getloadavg(), "passes": passes,
              "output_tokens_per_s": max(p["output_tokens_per_s"] for p in passes)}
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
