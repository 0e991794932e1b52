"""The in-process harness: drive a warmed engine over a workload and measure what `vllm bench
serve` reports, plus the per-step log and the ideal continuous/static ratio. A token's time is
when `LLMEngine.step()` hands it to the caller."""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import time
from collections import deque

import numpy as np
from tqdm.auto import tqdm

from jaxbatch.benchmarks.report import stats_ms

_RUN_IDS = itertools.count()


def ideal_ratio(output_lens, slots) -> dict:
    """Decode steps each batching mode needs for these lengths, served in order, prefill
    ignored: static takes groups of `slots`, each max(its lengths) steps; continuous gives each
    request the slot that frees first (FCFS list scheduling), >= ceil(total / slots) steps."""
    static = sum(max(output_lens[i:i + slots]) for i in range(0, len(output_lens), slots))
    free_at = [0] * slots
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    continuous, bound = max(free_at), math.ceil(sum(output_lens) / slots)
    return {"static_steps": static, "continuous_steps": continuous,
            "continuous_steps_lower_bound": bound, "ideal_ratio": static / continuous,
            "ratio_vs_lower_bound": static / bound}


@dataclasses.dataclass
class Trace:
    """One request as one engine served it; times on that engine's clock (seconds)."""
    rid: str
    kind: str
    prompt_len: int
    output_len: int
    arrival: float
    token_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunResult:
    engine: str
    start: float                    # clock value at t=0 of the timed run
    traces: list[Trace]
    # per engine step: (seconds since start, sequences computed, KV blocks in use, tokens)
    steps: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)
    # wall time of each of those steps (the gaps between step ends also hold idle waits)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """As a report holds it: traces and step log, times from the run's start."""
        return {"engine": self.engine, "info": self.info, "steps": self.steps,
                "step_seconds": self.step_seconds,
                "traces": [{**dataclasses.asdict(t), "arrival": t.arrival - self.start,
                            "token_times": [x - self.start for x in t.token_times]}
                           for t in self.traces]}


def summarize(run: RunResult) -> dict:
    """vllm bench serve's figures. TPOT excludes the first token; ITL pools every gap."""
    done = [t for t in run.traces if len(t.token_times) == t.output_len]
    if not done:
        raise RuntimeError(f"{run.engine}: no request completed")
    duration = max(t.token_times[-1] for t in done) - run.start
    out_tokens, in_tokens = sum(len(t.token_times) for t in done), sum(t.prompt_len for t in done)
    return {"completed": len(done), "requests": len(run.traces), "duration_s": duration,
            "input_tokens": in_tokens, "output_tokens": out_tokens,
            "request_throughput": len(done) / duration,
            "output_tokens_per_s": out_tokens / duration,
            "total_tokens_per_s": (in_tokens + out_tokens) / duration,
            "ttft": stats_ms([t.token_times[0] - t.arrival for t in done]),
            "tpot": stats_ms([(t.token_times[-1] - t.token_times[0]) / (t.output_len - 1)
                              for t in done if t.output_len > 1]),
            "itl": stats_ms([b - a for t in done for a, b in itertools.pairwise(t.token_times)]),
            "e2el": stats_ms([t.token_times[-1] - t.arrival for t in done])}


def step_stats(run: RunResult, slots: int) -> dict:
    """Slot occupancy, KV blocks in use, and where step time went: prefill-chunk vs decode-only
    steps, and the median decode-only step by rows padded to a power of two, as the runner pads."""
    if not run.steps:
        return {}
    seqs, blocks = np.array([s[1] for s in run.steps]), np.array([s[2] for s in run.steps])
    decode = [(s[1], dt) for s, dt in zip(run.steps, run.step_seconds) if s[3] == s[1]]
    prefill = [dt for s, dt in zip(run.steps, run.step_seconds) if s[3] != s[1]]
    by_rows = {}
    for rows, dt in decode:
        by_rows.setdefault(1 << (rows - 1).bit_length(), []).append(dt)
    return {"num_steps": len(run.steps), "mean_slot_occupancy": float(seqs.mean() / slots),
            "max_kv_blocks_in_use": int(blocks.max()),
            "mean_kv_blocks_in_use": float(blocks.mean()), "prefill_steps": len(prefill),
            "prefill_step_seconds": float(sum(prefill)), "decode_only_steps": len(decode),
            "decode_only_seconds": float(sum(dt for _, dt in decode)),
            "mean_rows_per_decode_step": float(np.mean([r for r, _ in decode])) if decode else 0.0,
            "decode_step_ms_by_rows": {r: {"steps": len(v), "median_ms": 1e3 * float(np.median(v))}
                                       for r, v in sorted(by_rows.items())}}


def jaxbatch_engine(loaded, batching, slots, max_model_len, chunk=None, budget=None, **kw):
    from jaxbatch import LLMEngine
    return LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=max_model_len,
                     batching=batching, prefill_chunk_size=chunk, max_num_batched_tokens=budget,
                     warmup=False, **kw)


def drive(engine, requests, concurrency: int | None = None, arrivals=None,
          label: str | None = None) -> dict:
    """Runs `requests`, each (prompt ids, SamplingParams[, add_request keywords]), to the end:
    at most `concurrency` in flight (None: no cap), each added at its offset in `arrivals`
    (seconds, passed on as its arrival_time, so time queued counts in its TTFT; None: all at
    t=0, TTFT from the add); `label` names a progress bar. Returns wall time, tokens/s, TTFT,
    TPOT, per-step (seconds, sequences, tokens), per-request token times, tokens, text, and
    each numeric engine stat's change."""
    run, before, first_logged = next(_RUN_IDS), engine.stats(), len(engine.step_log)
    offsets = [0.0] * len(requests) if arrivals is None else arrivals
    pending = deque(sorted(range(len(requests)), key=lambda i: offsets[i]))
    sent, times, finals, steps = {}, [[] for _ in requests], {}, []
    bar = tqdm(total=len(requests), desc=label, disable=label is None, leave=False)
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        while pending and start + offsets[pending[0]] <= time.monotonic() and (
                concurrency is None or engine.get_num_unfinished_requests() < concurrency):
            i = pending.popleft()
            prompt, params, *options = requests[i]
            options = dict(options[0]) if options else {}
            sent[i] = time.monotonic() if arrivals is None else start + offsets[i]
            if arrivals is not None:
                options["arrival_time"] = sent[i]
            engine.add_request(f"run{run}-{i}", prompt, params, **options)
        if not engine.has_unfinished_requests():        # idle until the next arrival
            time.sleep(max(0.0, start + offsets[pending[0]] - time.monotonic()))
            continue
        logged, began = len(engine.step_log), time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        for _, seqs, _, tokens in engine.step_log[logged:]:
            steps.append((now - began, seqs, tokens))
        for out in outputs:
            i = int(out.request_id.rsplit("-", 1)[1])
            times[i] += [now] * (len(out.outputs[0].token_ids) - len(times[i]))
            if out.finished:
                finals[i] = out.outputs[0]
                bar.update()
    bar.close()
    duration, after = time.monotonic() - start, engine.stats()
    tokens = [list(finals[i].token_ids) for i in range(len(requests))]
    return {"duration_s": duration, "output_tokens": sum(map(len, tokens)),
            "output_tokens_per_s": sum(map(len, tokens)) / duration,
            "ttft": stats_ms([t[0] - sent[i] for i, t in enumerate(times) if t]),
            "tpot": stats_ms([(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]),
            "steps": steps, "start": start, "token_times": times,
            "step_log": [(t - start, *rest) for t, *rest in engine.step_log[first_logged:]],
            "tokens": tokens, "texts": [finals[i].text for i in range(len(requests))],
            "stats": {k: v - before[k] for k, v in after.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and isinstance(before.get(k), (int, float))}}


def run_jaxbatch(engine, requests, label, progress=True) -> RunResult:
    """`drive` over a workload's Requests (greedy, ignore_eos), each at its arrival time, from
    an empty prefix cache (a warm-up run of the same prompts must not serve this one)."""
    from jaxbatch import SamplingParams
    engine.reset_prefix_cache()
    run = drive(engine, [(r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                       ignore_eos=True)) for r in requests],
                arrivals=[r.arrival for r in requests], label=label if progress else None)
    traces = [Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, run["start"] + r.arrival,
                    token_times) for r, token_times in zip(requests, run["token_times"])]
    stats, compiled = engine.stats(), run["stats"]["num_compilations"]
    info = {"compilations_before": stats["num_compilations"] - compiled,
            "compilations_after": stats["num_compilations"],
            "compilations_during_timed_run": compiled,
            "warmup_seconds": engine.warmup_seconds, "compile_seconds": stats["compile_seconds"],
            "num_preemptions": stats["num_preemptions"],
            "config": dataclasses.asdict(engine.config)}
    step_seconds = [s[0] for s in run["steps"]]
    return RunResult(label, run["start"], traces, run["step_log"], step_seconds, info)


def warmed_engine(loaded, batching, slots, model_len, requests, mode, shared=None, **kw):
    """An engine ready to time, warmed by `mode`: 'buckets' compiles every bucket; 'workload'
    runs the same requests at t=0, untimed (scheduling is deterministic: it compiles what its
    offline twin needs, cheaper on a GPU). `shared`: an engine whose runner (compiled steps, KV
    pool) it reuses, so static and continuous run identical executables; a bucket-warmed runner
    needs no second warm-up (a workload warm-up still runs: schedules differ)."""
    engine = jaxbatch_engine(loaded, batching, slots, model_len,
                             runner=shared.runner if shared is not None else None, **kw)
    if mode == "buckets" and shared is None:
        engine.warmup()
    elif mode == "workload":
        start = time.perf_counter()
        run_jaxbatch(engine, [dataclasses.replace(r, arrival=0.0) for r in requests], "warm-up",
                     progress=False)
        engine.warmup_seconds += time.perf_counter() - start
    return engine


def pow2_model_len(requests, block_size=16) -> int:
    """Smallest length with a power-of-two page count that fits every request: no more page
    buckets (and compilations) than the workload needs."""
    need = max(len(r.prompt_ids) + r.output_len for r in requests) + 1
    pages = 1 << max(0, math.ceil(need / block_size) - 1).bit_length()
    return pages * block_size


def enable_xla_cache(path):
    import jax
    from jaxbatch.model.loader import cache_root
    path = os.path.join(cache_root(), "xla") if path is None else path
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
    return path or None
