"""Our CPU kernels' calls in a running engine, timed where they run (`benchmarks/call_log.py`):
per kernel and sizes, calls per decode step, their median and mean, and how much of the step
they fill. The rest of a step is XLA's own ops, the gaps between calls and the host's share of
the cores. Unlike `bench ops` (XLA's profiler), nothing traces the step while it is timed.

    python -m benchmarks calls [--rows 4 16] [--tokens 64] [--dtype auto] [--random-model SHAPE]

For each row count: that many prompts (12 token ids each) through `LLM.generate` with its
defaults (host/device overlap on), greedy, `ignore_eos`, `--tokens` output tokens each; a
first pass warms, the second is recorded. A step runs from one argmax call (its sampling) to
the next; counted are decode steps only (decode attention, no prefill attention, every GEMM
of the row count's rows). Attention and argmax see the step's rows padded to its bucket; a
GEMM computes the real ones. Means show what the slow calls cost (a thread taken off its
core), medians what a call usually takes.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks import call_log
from jaxbatch.benchmarks.machine import machine_info
from jaxbatch.benchmarks.random_models import add_model_arguments, load_bench_model
from jaxbatch.benchmarks.report import table, write_report

KIND, A, B, C, ENTRY, END = range(6)    # call_log.records() columns
IDS = {name: k for k, name in call_log.KERNELS.items()}


def instrument() -> None:
    """The call log is compiled in only for an instrumented build of the kernels:
    `call_log.instrument()` switches this process to it, before any kernel is registered (so
    before the first model loads). A build that logs every call has no such switch."""
    switch = getattr(call_log, "instrument", None)
    if switch is not None:
        switch()


def decode_steps(records: np.ndarray, rows: int) -> list[tuple[np.ndarray, int]]:
    """(the records of each decode step, when it ended). A step runs from one argmax call
    (each step's sampling has one) to the next one's entry; kept are those with decode
    attention, no prefill attention, every GEMM of `rows` rows, and every call ended."""
    marks = np.flatnonzero(records[:, KIND] == IDS["argmax"])
    steps = []
    for first, last in zip(marks[:-1], marks[1:]):
        step = records[first:last]
        kinds, gemms = step[:, KIND], step[step[:, KIND] == IDS["gemm"]]
        if (np.any(kinds == IDS["decode attention"])
                and not np.any(kinds == IDS["prefill attention"])
                and np.all(gemms[:, A] == rows) and np.all(step[:, END] > 0)):
            steps.append((step, int(records[last, ENTRY])))
    return steps


def summarize(steps: list[tuple[np.ndarray, int]]) -> dict:
    """Per (kernel, a, b, c): calls per step, median and mean µs, ms per step; and the
    steps' own median and mean, and the time inside the kernels a step."""
    durations: dict[tuple, list[float]] = {}
    walls, inside = [], []
    for step, end in steps:
        walls.append((end - step[0, ENTRY]) / 1e3)
        took = (step[:, END] - step[:, ENTRY]) / 1e3
        inside.append(float(took.sum()))
        for record, us in zip(step, took):
            key = (call_log.KERNELS[int(record[KIND])], *map(int, record[A:C + 1]))
            durations.setdefault(key, []).append(float(us))
    n = len(steps)
    calls = [{"kernel": key[0], "sizes": dict(zip(call_log.SIZES[key[0]], key[1:])),
              "calls_per_step": len(us) / n, "median_us": statistics.median(us),
              "mean_us": statistics.fmean(us), "ms_per_step": sum(us) / n / 1e3}
             for key, us in durations.items()]
    calls.sort(key=lambda c: -c["ms_per_step"])
    return {"steps": n, "step_median_ms": statistics.median(walls) / 1e3,
            "step_mean_ms": statistics.fmean(walls) / 1e3,
            "in_kernels_ms": statistics.fmean(inside) / 1e3, "calls": calls}


def record_rows(llm, rows: int, tokens: int, vocab: int) -> dict:
    from jaxbatch import SamplingParams
    # token ids (a random model has no tokenizer): 12 a prompt, each prompt its own
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % (vocab - 1) for j in range(12)]}
               for i in range(rows)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    call_log.start()
    llm.generate(prompts, params, use_tqdm=False)
    records = call_log.stop()
    if call_log.dropped():
        raise RuntimeError(f"{call_log.dropped()} calls past the log's capacity: fewer --tokens")
    steps = decode_steps(records, rows)
    if not steps:
        raise RuntimeError(f"no decode step of {rows} rows recorded ({len(records)} calls): "
                           "the CPU kernels do not run here, or every step mixed in prefill")
    return {"rows": rows, **summarize(steps)}


def report_md(results: list[dict]) -> str:
    parts = []
    for r in results:
        share = r["in_kernels_ms"] / r["step_mean_ms"]
        parts.append(
            f"### {r['rows']} rows: {r['steps']} decode steps, median {r['step_median_ms']:.2f} "
            f"ms, mean {r['step_mean_ms']:.2f} ms; in our kernels {r['in_kernels_ms']:.2f} ms "
            f"a step ({share:.0%} of the mean)\n\n" + table(
                ["kernel", "sizes", "calls / step", "median µs", "mean µs", "ms / step"],
                [[c["kernel"], ", ".join(f"{k} {v}" for k, v in c["sizes"].items() if k != "-"),
                  f"{c['calls_per_step']:.1f}", f"{c['median_us']:.1f}", f"{c['mean_us']:.1f}",
                  f"{c['ms_per_step']:.2f}"] for c in r["calls"]]))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks calls",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    add_model_arguments(ap)
    ap.add_argument("--out", default="bench_out/calls")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.tokens < 4:
        ap.error("--rows at least 1, --tokens at least 4")
    instrument()
    from jaxbatch import LLM
    loaded = load_bench_model(args)
    vocab = loaded.config.vocab_size
    results = []
    for rows in args.rows:
        llm = LLM(loaded=loaded, max_num_seqs=rows, enable_prefix_caching=False)
        try:
            results.append(record_rows(llm, rows, args.tokens, vocab))
        except RuntimeError as e:
            print(f"bench calls: {e}")
            return 1
    md = report_md(results)
    print(md)
    for path in write_report(args.out, "calls", {"machine": machine_info(), "args": vars(args),
                                                  "results": results}, md):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
