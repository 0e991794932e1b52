"""Throughput of one engine against tensor-parallel and data-parallel ones, on the same greedy
workload, and whether their tokens agree (they must: tensor parallelism only changes the order
of float sums, data parallelism nothing a request can see).

    python -m benchmarks scaleout --devices 3 --tensor-parallel-size 3   # CPU: 3 virtual devices
    python -m benchmarks scaleout --devices 2 --data-parallel-size 2
    python -m benchmarks scaleout --device gpu --tensor-parallel-size 8  # every GPU of a host

On a CPU, virtual devices (--devices) share the same cores: the figures say what the split
costs in collectives and dispatch, not what a second chip would add. The embedded model has
9 query / 3 KV heads, so it splits 1 or 3 ways (or 9). Prints one JSON line, with the cost per
million output tokens at --price-per-hour. The virtual devices must be set before JAX starts:
run it as its own process (`python -m benchmarks scaleout` is one).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

from jaxbatch.benchmarks.machine import add_price_argument, machine_info, resolve_price
from jaxbatch.benchmarks.report import cost_per_million
from jaxbatch.benchmarks.workloads import load_prompts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks scaleout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1, help="CPU only: virtual devices")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    add_price_argument(ap)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jaxbatch import LLM, SamplingParams

    texts = [p["text"] for p in load_prompts()]
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size,
              data_parallel_size=args.data_parallel_size)
    ready = time.perf_counter() - start
    tok = llm.get_tokenizer()
    # Every 7th prompt of the bundled set: short questions, instructions and long documents.
    prompts = [tok(texts[(7 * i) % len(texts)])["input_ids"][: args.max_model_len // 2]
               for i in range(args.num_requests)]
    # Mixed output lengths, deterministic: 8 .. max_tokens.
    params = [SamplingParams(temperature=0, ignore_eos=True,
                             max_tokens=8 + (i * 7) % max(1, args.max_tokens - 7))
              for i in range(args.num_requests)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    price = resolve_price(args.price_per_hour, machine_info())
    result = {
        "backend": jax.default_backend(), "devices": jax.device_count(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size, "requests": args.num_requests,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": n_out,
        "seconds": round(elapsed, 2), "output_tok_per_s": round(n_out / elapsed, 1),
        "startup_s": round(ready, 1), "cpu_cores": len(os.sched_getaffinity(0)),
        "tokens_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12],
        "usd_per_million_output_tokens": cost_per_million(n_out / elapsed, price["usd_per_hour"]),
        "price": price}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
