"""`jaxbatch bench NAME [ARGS]` (also `python -m jaxbatch bench ...`), as `vllm bench` has them:
`jaxbatch bench` lists the names, `jaxbatch bench NAME --help` gives a benchmark's flags. A name
is imported only once chosen, so listing starts no JAX. `dispatch` serves `python -m benchmarks`."""
from __future__ import annotations

import importlib
import sys

# What a user runs to decide, by module name (the lab's instruments: `python -m benchmarks`).
BENCHMARKS = {
    "throughput": "continuous vs static batching on the same compiled steps, $ / M tokens",
    "latency": "TTFT under Poisson arrivals, chunked prefill vs unchunked",
    "serve": "any OpenAI-compatible server under load: vllm bench serve's figures, /health",
    "startup": "LLM() to first token: cold, warm (lowered store), traced",
    "prefix": "prefix caching on vs off: shared system prompt, multi-turn, distinct",
    "spec": "speculative decoding (n-gram) on vs off at 1/4/16 concurrent requests",
    "structured": "structured outputs' cost: 0/50/100 % JSON-schema requests",
    "lora": "LoRA adapters' cost per decode step: 0, 1, max_loras adapters active",
    "quant": "int8 KV cache and int8 weights: capacity and throughput on one budget",
    "roofline": "decode and prefill steps against this machine's bandwidth and GEMM floors",
}
FOOTER = ["Throughput reports state the cost per million output tokens at --price-per-hour "
          "(default: a list price for this machine; see jaxbatch/benchmarks/machine.py).",
          "Diagnostics, peers (vLLM, HF) and the GPU harness: `python -m benchmarks` in a "
          "checkout (docs/BENCHMARKS.md)."]


def usage(prog: str, names: dict[str, str], footer=FOOTER) -> str:
    width = max(map(len, names))
    return "\n".join([f"usage: {prog} NAME [ARGS ...]   ({prog} NAME --help: its flags)", "",
                      "benchmarks:"] + [f"  {name:<{width}}  {line}" for name, line in names.items()]
                     + [""] + list(footer))


def dispatch(argv, prog: str, names: dict[str, str], module_of, footer=FOOTER) -> int:
    """Lists `names` or runs one: `module_of(name)`'s `main(rest of argv)`."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(prog, names, footer))
        return 0
    if argv[0] not in names:
        print(f"{prog}: unknown benchmark {argv[0]!r}\n\n{usage(prog, names, footer)}",
              file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(name := module_of(argv[0]))
    except ModuleNotFoundError as e:
        if e.name != name:
            raise       # the benchmark exists but something it imports does not: show that
        print(f"this installation has no {name} ({name.replace('.', '/')}.py is missing)",
              file=sys.stderr)
        return 2
    result = module.main(argv[1:])
    return result if isinstance(result, int) else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return dispatch(argv, "jaxbatch bench", BENCHMARKS, lambda name: f"jaxbatch.benchmarks.{name}")
