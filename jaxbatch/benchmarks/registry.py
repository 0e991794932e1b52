"""`jaxbatch bench NAME [ARGS]` (also `python -m jaxbatch bench ...`): every benchmark by name, as
`vllm bench` has them. `jaxbatch bench` or `jaxbatch bench --help` lists them; `jaxbatch bench
NAME --help` gives a benchmark's own flags.

Each name maps to a module of this package with `main(argv)`. Nothing is imported until a name
is chosen: listing stays instant, and a benchmark that sets up devices before JAX starts
(scaleout's virtual CPU devices) still can.
"""
from __future__ import annotations

import importlib
import sys

# name: (module in jaxbatch.benchmarks, one line for the list)
BENCHMARKS = {
    "throughput": ("throughput", "offline throughput: continuous vs static vs HF transformers "
                                 "(--device gpu: random 1B/8B shapes, MBU)"),
    "latency": ("latency", "TTFT under Poisson arrivals, chunked prefill vs unchunked"),
    "serve": ("serve", "load generator for any OpenAI-compatible server (vllm bench serve's "
                       "figures, /health under load)"),
    "startup": ("startup", "LLM() to first token: cold, warm (lowered store), traced"),
    "prefix": ("prefix", "prefix caching on vs off: shared system prompt, multi-turn, distinct"),
    "spec": ("spec", "speculative decoding (n-gram) on vs off at 1/4/16 concurrent requests"),
    "quant": ("quant", "int8 KV cache and int8 weights: capacity and throughput on one budget"),
    "overlap": ("overlap", "host/device overlap (async scheduling) on vs off"),
    "profile": ("profile", "device time per executable on the mixed chat workload"),
    "vs-vllm": ("vs_vllm", "jaxbatch vs vLLM's CPU build, offline LLM.generate, interleaved"),
    "vllm-offline": ("vllm_offline", "vLLM's side of vs-vllm (run with vLLM's venv python)"),
    "scaleout": ("scaleout", "tensor / data parallel throughput against one engine"),
    "step-keys": ("step_keys", "step time of chosen executable keys (pricing a bucket change)"),
    "accuracy": ("accuracy", "what int8 costs in accuracy: top-1, KL, perplexity"),
    "accuracy-bf16": ("accuracy_bf16", "bf16 against float32: top-1, KL, perplexity ratio, "
                      "greedy agreement"),
    "dtype": ("dtype", "bf16 vs float32 on this CPU: per-executable profile, a small mix"),
    "roofline": ("roofline", "decode and prefill steps against the copy-bandwidth and GEMM-peak "
                             "floors measured in the same run"),
    "attention-read": ("attention_read", "decode attention alone against the read bandwidth: "
                       "pages contiguous and scattered"),
    "ops": ("ops", "one decode step and one prefill chunk op by op (XLA's profiler, HLO shapes)"),
    "calls": ("calls", "our CPU kernels' calls in decode steps, timed where they run, untraced"),
    "gemm": ("gemm", "our CPU GEMM kernel over packed weights against XLA's dot, per matrix "
                     "and row count"),
    "decode-floor": ("decode_floor", "one decode step against its dense floor, with a breakdown"),
    "detok": ("detok", "host cost of detokenization and stop strings per token"),
    "gpu-e2e": ("gpu_e2e", "the GPU end-to-end harness (scripts/gpu_check.sh runs it)"),
    "hostile": ("hostile", "hostile clients against the server"),
    "structured": ("structured", "structured outputs' cost: 0/50/100 % JSON-schema requests"),
    "families": ("families", "what a family's own layers cost: random ~100M Llama, Qwen3, "
                             "Gemma 3 on one workload"),
    "lora": ("lora", "LoRA adapters' cost per decode step at 16 / 64 rows: 0, 1, max_loras "
                     "adapters active, against no LoRA"),
    "structured-mask-cost": ("structured_mask_cost", "host cost of grammar masks: tokenizer "
                             "build, schema compile, advance + fill per step"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: jaxbatch bench NAME [ARGS ...]   (jaxbatch bench NAME --help: its flags)",
             "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in BENCHMARKS.items()]
    lines += ["", "Throughput reports state the cost per million output tokens at "
              "--price-per-hour (default: a list price for this machine; see "
              "jaxbatch/benchmarks/machine.py)."]
    return "\n".join(lines)


def load(name: str):
    """The benchmark's module, or None (with a message on stderr) when it is not there."""
    module = f"jaxbatch.benchmarks.{BENCHMARKS[name][0]}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise       # the benchmark exists but something it imports does not: show that
        print(f"jaxbatch bench {name}: this installation has no {module} "
              f"(jaxbatch/benchmarks/{BENCHMARKS[name][0]}.py is missing)", file=sys.stderr)
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"jaxbatch bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = load(name)
    if module is None:
        return 2
    result = module.main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
