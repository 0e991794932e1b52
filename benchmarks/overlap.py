"""Host/device overlap (`async_scheduling`) on vs off, in one run, warm, on the embedded model:

  mixed    the throughput benchmark's offline workload (48 chat requests, output lengths lognormal(32, 1) in
           [8, 256], 16 slots, greedy): output tokens/s, steps, step wall time
  decode   16 sequences decoding in lockstep (contexts ~200), 25 steps: the step-time breakdown,
           also with --host-delay-ms added to every step (observer.HostDelay: what overlap
           hides when the host's share of a step is large, as on a fast accelerator)

Breakdown per step: wall (what engine.step() takes), device wait (the host blocked reading a
step's tokens: `stats()["device_wait_seconds"]`), host = wall - wait. Without overlap the host's
work (schedule, lay out, dispatch, apply tokens, outputs) adds to the device time; with overlap it
runs while the device computes the previous step, so the wall time per step should drop by
about the host time, and the wait grow by what the host no longer adds. Both engines share one
runner (same executables); on/off alternate --repeats times; medians reported.

    python -m benchmarks overlap [--repeats 3] [--out bench_out] [--price-per-hour USD]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np

from jaxbatch.benchmarks.harness import (pow2_model_len, run_jaxbatch, run_on_embedded_model,
                                         summarize)
from jaxbatch.benchmarks.machine import add_price_argument
from benchmarks.observer import HostDelay, observe
from jaxbatch.benchmarks.report import cost_cell, price_line, table
from jaxbatch.benchmarks.workloads import encode_prompts, load_prompts, offline_requests

MODES = ("off", "on")


def mixed_run(engine, requests) -> dict:
    before = engine.stats()
    run = run_jaxbatch(engine, requests, "mixed", progress=False)
    after = engine.stats()
    steps = after["num_steps"] - before["num_steps"]
    wait = after["device_wait_seconds"] - before["device_wait_seconds"]
    wall = sum(run.step_seconds)
    return {"output_tokens_per_s": summarize(run)["output_tokens_per_s"], "steps": steps,
            "step_ms": 1e3 * wall / steps, "device_wait_ms": 1e3 * wait / steps,
            "host_ms": 1e3 * (wall - wait) / steps,
            "overlapped_steps": after["num_overlapped_steps"] - before["num_overlapped_steps"],
            "compilations_after_warmup": after["num_compilations_after_warmup"]}


@contextlib.contextmanager
def _nothing():
    yield


def decode_run(engine, slots=16, context=200, steps=25, host_delay_ms=0.0) -> dict:
    from jaxbatch import SamplingParams
    engine.reset_prefix_cache()
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    for i in range(slots):
        engine.add_request(f"d{i}", rng.integers(0, vocab, context).tolist(),
                           SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True))
    # Through every prefill (16 x 200 tokens take a dozen steps) into steady decoding: two
    # decode-only steps dispatched in a row (one token per sequence computed).
    while sum(1 for _, seqs, _, tokens in engine.step_log[-2:] if tokens == seqs == slots) < 2:
        engine.step()
    walls, waits = [], []
    # The delay is where each step is read back: with overlap the next step already runs then.
    with observe(engine, HostDelay(host_delay_ms)) if host_delay_ms else _nothing():
        for _ in range(steps):
            wait0, start = engine.device_wait_seconds, time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            waits.append(engine.device_wait_seconds - wait0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"step_ms": med(walls), "device_wait_ms": med(waits),
            "host_ms": med([w - d for w, d in zip(walls, waits)])}


def bench_overlap(loaded, args) -> dict:
    from jaxbatch.engine.llm_engine import LLMEngine
    entries = load_prompts()
    prompts = encode_prompts(entries, loaded.tokenizer)
    requests = offline_requests(prompts, [e["kind"] for e in entries], args.num_requests,
                                (32, 1.0, 8, 256), seed=0)
    settings = dict(loaded=loaded, max_num_seqs=16, max_model_len=pow2_model_len(requests))
    on = LLMEngine(async_scheduling=True, **settings)
    engines = {"on": on, "off": LLMEngine(runner=on.runner, async_scheduling=False, **settings)}
    for engine in engines.values():          # an untimed pass each (caches, allocator)
        run_jaxbatch(engine, requests, "warm", progress=False)
    workloads = ["mixed"] + [f"decode+{d:g}ms" for d in args.host_delay_ms]
    runs = {m: {w: [] for w in workloads} for m in MODES}
    for r in range(args.repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[mode]["mixed"].append(mixed_run(engines[mode], requests))
            for delay in args.host_delay_ms:
                runs[mode][f"decode+{delay:g}ms"].append(
                    decode_run(engines[mode], host_delay_ms=delay))
            print(mode, json.dumps({k: v[-1] for k, v in runs[mode].items()}), flush=True)
    report = {"requests": len(requests), "repeats": args.repeats, "workloads": workloads}
    for workload in workloads:
        report[workload] = {m: {k: statistics.median(x[k] for x in runs[m][workload])
                                for k in runs[m][workload][0]} for m in MODES}
        report[workload]["on/off tok/s or step"] = (
            report[workload]["on"]["output_tokens_per_s"] / report[workload]["off"]["output_tokens_per_s"]
            if workload == "mixed" else
            report[workload]["on"]["step_ms"] / report[workload]["off"]["step_ms"])
    return report


def markdown(report) -> str:
    price, rows = report.get("price") or {}, []
    for workload in report["workloads"]:
        for mode in MODES:
            e = report[workload][mode]
            tok = e.get("output_tokens_per_s")
            rows.append([workload, mode, "–" if tok is None else f"{tok:.1f}",
                         "–" if tok is None else cost_cell(tok, price), f"{e['step_ms']:.1f}",
                         f"{e['host_ms']:.1f}", f"{e['device_wait_ms']:.1f}", e.get("steps", "–")])
    return table(["workload", "overlap", "out tok/s", "$ / M out tok", "step ms",
                  "host ms (step − wait)", "device wait ms", "steps"], rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--host-delay-ms", type=float, nargs="+", default=[0.0, 50.0],
                    help="host time added to every step in the decode runs (HostDelay)")
    ap.add_argument("--out", default="bench_out")
    add_price_argument(ap)
    args = ap.parse_args(argv)
    report = run_on_embedded_model(bench_overlap, args, "overlap.json")
    print(markdown(report))
    print(price_line(report["price"]))
    return report


if __name__ == "__main__":
    main()
