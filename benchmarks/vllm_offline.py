"""vLLM's offline `LLM.generate` throughput on the serve benchmark's workload (the same prompts, chat
template and per-request output lengths), for comparison with jaxbatch's `LLM.generate` and
with the served numbers. Run it with the vLLM venv's python (scripts/setup_vllm_cpu.sh) from the
repository root (that venv has no jaxbatch installed: `-m` finds it in the current directory;
nothing of jaxbatch that imports JAX is loaded):

    .venv-vllm/bin/python -m benchmarks.vllm_offline --model hf_export/SmolLM2-135M-Instruct
    # both cores for vLLM's compute (by default vLLM's CPU backend reserves one core for its
    # front end; jaxbatch's XLA uses every core):
    .venv-vllm/bin/python -m benchmarks.vllm_offline --model DIR --omp-bind 0-1 --reserved-cpus 0

48 chat requests by default, output lengths round(lognormal(32, 1)) clipped to [8, 256],
16 slots (max_num_seqs), float32, greedy, ignore_eos. An untimed pass of the whole workload
first, then --passes timed passes; prints one JSON object (output tok/s of each pass). Before
2026-11-30 the prefix cache was not reset between passes, so vLLM's timed passes found every
prompt of the untimed pass cached (a number that measured its cache, not its engine).
"""
from __future__ import annotations

import argparse
import os
import time

from benchmarks import emit_json
from jaxbatch.benchmarks.workloads import add_workload_flags, encode_prompts, serve_workload


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_offline",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF directory (scripts/export_safetensors.py)")
    add_workload_flags(ap)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default auto)")
    ap.add_argument("--reserved-cpus", default=None, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    ap.add_argument("--passes", type=int, default=2, help="timed passes after the untimed one")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=True, help="vLLM's prefix caching (its default: on); with it on, "
                    "the cache is reset before every pass, so a pass never reuses the prompts "
                    "of the one before (jaxbatch's bench does the same)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    # vLLM reads these at import / engine start.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    if args.omp_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    if args.reserved_cpus is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)

    import vllm
    from vllm import LLM, SamplingParams

    workload = serve_workload(args)
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, seed=0,
              enable_prefix_caching=args.enable_prefix_caching)
    startup = time.perf_counter() - start
    prompts = encode_prompts([{"text": r.text} for r in workload], llm.get_tokenizer())
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in workload]
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    passes = []
    for i in range(1 + args.passes):
        if args.enable_prefix_caching:
            llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        passes.append({"timed": i > 0, "seconds": round(seconds, 3), "output_tokens": n_out,
                       "output_tokens_per_s": round(n_out / seconds, 2),
                       "total_tokens_per_s": round((n_out + sum(map(len, prompts))) / seconds, 2)})
    timed = [p for p in passes if p["timed"]] or passes
    result = {
        "engine": "vllm", "vllm_version": vllm.__version__, "model": args.model,
        "num_prompts": len(workload), "prompt_tokens": sum(map(len, prompts)),
        "expected_output_tokens": sum(r.max_tokens for r in workload),
        "max_num_seqs": args.max_num_seqs, "dtype": args.dtype,
        "enable_prefix_caching": args.enable_prefix_caching,
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",
                                               "VLLM_CPU_OMP_THREADS_BIND",
                                               "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")},
        "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
        "startup_s": round(startup, 1), "passes": passes,
        "output_tokens_per_s": max(p["output_tokens_per_s"] for p in timed),
        "first_text": outs[0].outputs[0].text[:80],
    }
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
