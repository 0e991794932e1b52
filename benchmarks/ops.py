"""Where one engine step's device time goes, op by op: XLA's own profiler (`jax.profiler`)
around steady decode steps and one prefill chunk, each op named with its shape from the
compiled executable's HLO.

    python -m benchmarks ops [--rows 16 64] [--prefill-tokens 256] [--dtype auto]
                                 [--steps 5] [--top 20] [--random-model SHAPE]
                                 [--quantization w8a8]

Decode: `rows` requests decoding in lockstep at contexts in (ctx/2, ctx] (roofline's steady
engine, no overlap); prefill: one chunk of a second request (the first compiled the step).
Each op's time is the sum of its trace events over the traced steps, divided by the steps;
the tracer adds its own cost, so compare ops within one run, not against an untraced step.
An op's class says what it is for: `dot` (an XNNPACK / ynn fusion: matmuls and attention's
batched dots), `gemm kernel` / `decode kernel` / `prefill kernel` / `norm kernel` (our CPU
kernels' custom calls), `switched dot` (a `lax.switch` picking one layer's matrix on CPU,
timed as one event with the dot or GEMM call inside it), `weight copy` (a slice of a stacked
layer matrix copied out before its dot), `gather` (KV pages), `loop` (the attention's while
loop, wrapping the ops inside it), `other`.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shutil
import tempfile
import time

import numpy as np

from benchmarks.observer import ExecutableTimer, observe
from jaxbatch.benchmarks.random_models import add_model_arguments, load_bench_model
from jaxbatch.benchmarks.report import table, write_report
from jaxbatch.engine.config import QUANTIZATION_METHODS
from jaxbatch.worker.executable_keys import MODEL_CALLS     # the runner's model-call kinds

# "%name = shape fusion(" or "%name = shape op(" in an HLO text
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^)]*\)|\S+) ([\w\-]+)\(")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """name -> (shape, opcode or fusion kind) for every instruction of an HLO module text."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        if opcode == "fusion":
            kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(\w+)", line)
            opcode = f"fusion:{kind.group(1)}" if kind else "fusion"
        elif opcode == "custom-call":
            target = re.search(r'custom_call_target="([\w.\-]+)"', line)
            opcode = f"custom-call:{target.group(1)}" if target else opcode
        ops[name] = (re.sub(r"\{[^}]*\}", "", shape), opcode)
    return ops


def executable_ops(compiled: dict, keys) -> dict[str, tuple[str, str]]:
    """`hlo_ops` of the executables `keys` name (compiled: key -> executable). Op names repeat
    across executables and a trace names only the op: on a clash the model call's op wins."""
    ops = {}
    for key in sorted(keys, key=lambda k: k[0] in MODEL_CALLS):        # model calls last
        ops.update(hlo_ops(compiled[key].as_text()))
    return ops


def op_class(name: str, shape: str, opcode: str, weight_shapes: set[str]) -> str:
    if "ynn" in opcode or "xnn" in opcode or opcode == "dot" or name.startswith(("ynn", "xnn")):
        return "dot"
    if "jaxbatch_packed_gemm" in opcode or "jaxbatch_w8a8_gemm" in opcode:
        return "gemm kernel"
    if "jaxbatch_paged_decode" in opcode:
        return "decode kernel"
    if "jaxbatch_paged_prefill" in opcode:
        return "prefill kernel"
    if "jaxbatch_add_rms_norm" in opcode:
        return "norm kernel"
    if opcode == "while" or name.startswith("while"):
        return "loop"
    if opcode == "conditional" or name.startswith("cond."):
        return "switched dot"
    if "bitcast-convert" in name and shape.split("[")[-1] in weight_shapes:
        return "weight copy"
    if "gather" in name or opcode == "gather":
        return "gather"
    return "other"


def trace_ops(fn, calls: int) -> tuple[collections.Counter, collections.Counter, float]:
    """Runs fn() `calls` times under jax.profiler; -> (microseconds, count) per event name, and
    the seconds per call (the profiler's start and export excluded)."""
    import jax
    tmp = tempfile.mkdtemp(prefix="jaxbatch-ops-")
    try:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds = (time.perf_counter() - start) / calls
        (path,) = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    micros, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            micros[e["name"]] += e["dur"]
            counts[e["name"]] += 1
    return micros, counts, seconds


def _weight_shapes(params) -> set[str]:
    """'in,out]' strings of every stacked layer matrix's per-layer slice (only stacks are
    sliced and copied: per-layer matrices are read in place)."""
    import jax
    shapes = set()
    for leaf in jax.tree.leaves(params["layers"]):
        if leaf.ndim == 3:
            shapes.add(",".join(map(str, leaf.shape[1:])) + "]")
    return shapes


def profile_step(engine, step_fn, steps: int, top: int) -> dict:
    """Traces `steps` calls of step_fn; the ops of the executables those steps ran."""
    with observe(engine, ExecutableTimer()) as timer:    # which executables the steps run
        micros, counts, wall = trace_ops(step_fn, steps)
    hlo = executable_ops(engine.runner.executables.compiled, timer.per_key)
    weights = _weight_shapes(engine.runner.params)
    rows, by_class = [], collections.Counter()
    for name, us in micros.items():
        if name not in hlo:
            continue
        shape, opcode = hlo[name]
        cls = op_class(name, shape, opcode, weights)
        ms = us / steps / 1e3
        rows.append({"op": name, "class": cls, "shape": shape, "ms": ms,
                     "calls": counts[name] / steps})
        if cls != "loop":                 # a loop's time is its body ops' time again
            by_class[cls] += ms
    rows.sort(key=lambda r: -r["ms"])
    return {"traced_step_ms": 1e3 * wall, "by_class_ms": dict(by_class), "ops": rows[:top]}


def _markdown(title: str, prof: dict) -> str:
    classes = table(["class", "ms per step"], [[c, f"{ms:.1f}"] for c, ms in
                                              sorted(prof["by_class_ms"].items(), key=lambda x: -x[1])])
    ops = table(["op", "class", "shape", "calls", "ms per step"],
                [[r["op"], r["class"], r["shape"], f"{r['calls']:.0f}", f"{r['ms']:.2f}"]
                 for r in prof["ops"]])
    return f"### {title} (traced step {prof['traced_step_ms']:.1f} ms)\n\n{classes}\n\n{ops}"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks ops", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[16])
    ap.add_argument("--context", type=int, default=256, help="a power of two")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="0: no prefill")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    add_model_arguments(ap)
    ap.add_argument("--out", default="bench_out/ops")
    args = ap.parse_args(argv)
    from jaxbatch import SamplingParams
    from jaxbatch.benchmarks.roofline import steady_decode_engine
    from jaxbatch.engine.llm_engine import LLMEngine
    loaded = load_bench_model(args)

    report, sections = {"args": vars(args)}, []
    for rows in args.rows:
        engine = steady_decode_engine(loaded, rows, args.context, args.steps + 2, seed=0,
                                      quantization=args.quantization)
        engine.step()                                   # the prefills
        engine.step()                                   # the first decode compiles
        prof = profile_step(engine, engine.step, args.steps, args.top)
        report[f"decode_{rows}"] = prof
        sections.append(_markdown(f"decode, {rows} rows, context <= {args.context}", prof))
    if args.prefill_tokens:
        tokens = args.prefill_tokens
        engine = LLMEngine(loaded=loaded, max_num_seqs=4, max_model_len=2 * tokens,
                           prefill_chunk_size=tokens, warmup=False, async_scheduling=False,
                           enable_prefix_caching=False, quantization=args.quantization)
        rng = np.random.default_rng(0)
        vocab = engine.model_config.vocab_size
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for i in range(2):
            engine.add_request(f"p{i}", rng.integers(3, vocab, tokens).tolist(), sp)
            if i == 0:                                  # compiles the chunk's executable
                while engine.has_unfinished_requests():
                    engine.step()
        prof = profile_step(engine, engine.step, 1, args.top)
        report["prefill"] = prof
        sections.append(_markdown(f"prefill, one chunk of {tokens} tokens", prof))
    md = "\n\n".join(sections)
    print(md)
    for path in write_report(args.out, "ops", report, md):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
