"""`jaxbatch bench NAME [ARGS]` (also `python -m jaxbatch bench ...`): every benchmark by name, as
`vllm bench` has them. `jaxbatch bench` or `jaxbatch bench --help` lists them; `jaxbatch bench
NAME --help` gives a benchmark's own flags.

Each name maps to a module of this package with `main(argv)`. Nothing is imported until a name
is chosen: listing stays instant and starts no JAX.
"""
from __future__ import annotations

import importlib
import sys

# name: (module in jaxbatch.benchmarks, one line for the list). What a user runs to decide;
# the diagnostics, peer drivers and GPU harness are `python -m benchmarks` in the repository.
BENCHMARKS = {
    "throughput": ("throughput", "offline throughput: continuous vs static batching on the same "
                                 "compiled steps, $ per million tokens"),
    "latency": ("latency", "TTFT under Poisson arrivals, chunked prefill vs unchunked"),
    "serve": ("serve", "load generator for any OpenAI-compatible server (vllm bench serve's "
                       "figures, goodput, /health under load)"),
    "startup": ("startup", "LLM() to first token: cold, warm (lowered store), traced"),
    "prefix": ("prefix", "prefix caching on vs off: shared system prompt, multi-turn, distinct"),
    "spec": ("spec", "speculative decoding (n-gram) on vs off at 1/4/16 concurrent requests"),
    "structured": ("structured", "structured outputs' cost: 0/50/100 % JSON-schema requests"),
    "lora": ("lora", "LoRA adapters' cost per decode step: 0, 1, max_loras adapters active"),
    "quant": ("quant", "int8 KV cache and int8 weights: capacity and throughput on one budget"),
    "roofline": ("roofline", "decode and prefill steps against this machine's bandwidth and "
                             "GEMM floors, measured in the same run"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: jaxbatch bench NAME [ARGS ...]   (jaxbatch bench NAME --help: its flags)",
             "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in BENCHMARKS.items()]
    lines += ["", "Throughput reports state the cost per million output tokens at "
              "--price-per-hour (default: a list price for this machine; see "
              "jaxbatch/benchmarks/machine.py).",
              "Diagnostics, peers (vLLM, HF) and the GPU harness: `python -m benchmarks` in a "
              "checkout (docs/BENCHMARKS.md)."]
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
