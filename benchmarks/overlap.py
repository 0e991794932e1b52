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
runner (same executables); on/off take turns --repeats times (jaxbatch/benchmarks/ab.py);
medians reported.

    python -m benchmarks overlap [--repeats 3] [--out bench_out] [--price-per-hour USD]
"""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from benchmarks.observer import HostDelay, observe
from jaxbatch.benchmarks.ab import ABBenchmark, compare, tok_s_cells
from jaxbatch.benchmarks.harness import pow2_model_len, run_jaxbatch, summarize
from jaxbatch.benchmarks.report import table
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


class Overlap(ABBenchmark):
    name, prog, report_name = "overlap", "python -m benchmarks overlap", "overlap"
    rounds = 3

    def add_arguments(self, ap) -> None:
        ap.add_argument("--num-requests", type=int, default=48)
        ap.add_argument("--host-delay-ms", type=float, nargs="+", default=[0.0, 50.0],
                        help="host time added to every step in the decode runs (HostDelay)")

    def bench(self, loaded, args) -> dict:
        from jaxbatch.engine.llm_engine import LLMEngine
        entries = load_prompts()
        prompts = encode_prompts(entries, loaded.tokenizer)
        requests = offline_requests(prompts, [e["kind"] for e in entries], args.num_requests,
                                    (32, 1.0, 8, 256), seed=args.seed)
        settings = dict(loaded=loaded, max_num_seqs=16, max_model_len=pow2_model_len(requests))
        on = LLMEngine(async_scheduling=True, **settings)
        engines = {"off": LLMEngine(runner=on.runner, async_scheduling=False, **settings),
                   "on": on}
        for engine in engines.values():          # an untimed pass each (caches, allocator)
            run_jaxbatch(engine, requests, "warm", progress=False)
        report = {"requests": len(requests), "workloads": ["mixed"]}
        report["mixed"] = compare(engines, args.rounds,
                                  lambda m, _: mixed_run(engines[m], requests))
        for delay in args.host_delay_ms:
            name = f"decode+{delay:g}ms"
            report["workloads"].append(name)
            report[name] = compare(engines, args.rounds, lambda m, _: decode_run(
                engines[m], host_delay_ms=delay), keep=("step_ms",))
        return report

    def markdown(self, report) -> str:
        price, rows = report["price"], []
        for workload in report["workloads"]:
            for mode in MODES:
                e = report[workload][mode]
                tok = e.get("output_tokens_per_s")
                rows.append([workload, mode, *(["–", "–"] if tok is None else tok_s_cells(tok, price)),
                             f"{e['step_ms']:.1f}", f"{e['host_ms']:.1f}",
                             f"{e['device_wait_ms']:.1f}", e.get("steps", "–")])
            (ratio,) = report[workload]["ratio"]["on"].values()
            rows.append([workload, "on/off", f"{ratio:.2f}", "", "", "", "", ""])
        return table(["workload", "overlap", "out tok/s (on/off: tok/s or step)", "$ / M out tok",
                      "step ms", "host ms (step − wait)", "device wait ms", "steps"], rows)


main = Overlap().main


if __name__ == "__main__":
    main()
