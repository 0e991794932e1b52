"""Benchmarks jaxbatch against itself (continuous vs static batching) and against Hugging Face
transformers (`generate`, padded static batches; `generate_batch`, its continuous batching) on
the same prompts and output lengths, with the metrics of `vllm bench serve`.

    python scripts/bench.py                                  # CPU defaults, a few minutes
    python scripts/bench.py --engines continuous static      # jaxbatch only
    python scripts/bench.py --workloads online --request-rate 1.5
    python scripts/bench.py --device gpu [--dry-run]         # random-weight 1B/8B shapes, MBU

Workloads (fixed seeds; every request greedy with ignore_eos=True, so lengths are controlled):
  offline  --num-requests requests at t=0, prompts drawn uniformly from the bundled set
           (scripts/bench_prompts.json, chat template applied), output lengths
           round(lognormal(median, sigma)) clipped to [min, max] -- a long tail.
  online   Poisson arrivals at --request-rate: short requests (short/medium prompts) with long
           prompts among them; p99 TTFT of the short ones with chunked prefill vs chunking
           disabled (jaxbatch continuous only).
  prefix   prefix caching on vs off: a shared system prompt, multi-turn conversations and
           distinct prompts (scripts/bench_prefix.py; not in the default set).
Every timed jaxbatch run starts from an empty prefix cache.

Timing is wall clock around the timed part only; every engine is warmed up before it (jaxbatch:
`engine.warmup()` compiles every bucket; HF: a short untimed run). A token's time is when the
engine hands it to the caller: when `LLMEngine.step()` returns it, when HF `generate` finishes the
step that produced it (a StoppingCriteria records the time of every step), or HF continuous
batching's own per-token timestamps. Output: JSON with every figure, PNG plots and a markdown
summary printed last (see --out).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import heapq
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_prefix

import numpy as np
from tqdm.auto import tqdm

DEFAULT_PROMPTS = Path(__file__).with_name("bench_prompts.json")
ENGINES = ("continuous", "static", "hf_generate", "hf_generate_batch")
SHORT_KINDS = ("short", "medium")
# Token-id prompts (no tokenizer) get ~ len(text) / 4 tokens plus what a chat template adds.
CHARS_PER_TOKEN, CHAT_TEMPLATE_TOKENS = 4, 30


# ==== workloads ===================================================================================

@dataclasses.dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    output_len: int
    arrival: float = 0.0          # seconds after the start of the timed run
    kind: str = "short"           # kind of the bundled prompt: short / medium / long


def load_prompts(path=DEFAULT_PROMPTS) -> list[dict]:
    return json.loads(Path(path).read_text())["prompts"]


def encode_prompts(entries, tokenizer) -> list[list[int]]:
    """Chat-templated token ids: what an instruct model is actually served."""
    ids = []
    for entry in entries:
        out = tokenizer.apply_chat_template([{"role": "user", "content": entry["text"]}],
                                            tokenize=True, add_generation_prompt=True,
                                            return_dict=False)
        ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    return ids


def synthetic_prompt_ids(entries, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids with the bundled prompts' approximate lengths (models without tokenizer)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, len(e["text"]) // CHARS_PER_TOKEN
                         + CHAT_TEMPLATE_TOKENS).tolist() for e in entries]


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    return [int(x) for x in np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))),
                                    lo, hi)]


def _truncate(ids, max_len):
    return ids if max_len is None or len(ids) <= max_len else ids[-max_len:]


def offline_requests(prompt_ids, kinds, n, lengths, seed, max_prompt_len=None) -> list[Request]:
    """n requests at t=0; prompts uniform over the set, output lengths from `lengths`
    (median, sigma, lo, hi)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(prompt_ids), n)
    outs = lognormal_lengths(rng, n, *lengths)
    return [Request(f"off-{i}", _truncate(prompt_ids[p], max_prompt_len), outs[i], 0.0, kinds[p])
            for i, p in enumerate(picks)]


def online_requests(prompt_ids, kinds, n_short, n_long, rate, lengths, seed,
                    max_prompt_len=None) -> list[Request]:
    """Poisson arrivals (exponential gaps, mean 1/rate): n_short short/medium prompts with
    n_long long prompts at random positions among them."""
    rng = np.random.default_rng(seed + 1)
    short = [i for i, k in enumerate(kinds) if k in SHORT_KINDS]
    long_ = [i for i, k in enumerate(kinds) if k not in SHORT_KINDS] or short
    picks = list(rng.choice(short, n_short)) + list(rng.choice(long_, n_long))
    picks = [picks[i] for i in rng.permutation(len(picks))]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(picks)))
    outs = lognormal_lengths(rng, len(picks), *lengths)
    return [Request(f"on-{i}", _truncate(prompt_ids[p], max_prompt_len), outs[i],
                    float(arrivals[i]), kinds[p]) for i, p in enumerate(picks)]


def ideal_ratio(output_lens, slots) -> dict:
    """Decode steps each batching mode needs for these lengths (prefill ignored; a request holds
    a slot for exactly its output length in steps, requests are served in order):
      static      groups of `slots` in order; each group takes max(length in group) steps
      continuous  FCFS list scheduling: each request takes the slot that frees first; the last
                  slot to free is the step count (>= the bound ceil(total / slots))."""
    static = sum(max(output_lens[i:i + slots]) for i in range(0, len(output_lens), slots))
    free_at = [0] * slots
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    continuous = max(free_at)
    bound = math.ceil(sum(output_lens) / slots)
    return {"static_steps": static, "continuous_steps": continuous,
            "continuous_steps_lower_bound": bound, "ideal_ratio": static / continuous,
            "ratio_vs_lower_bound": static / bound}


# ==== metrics =====================================================================================

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


def stats_ms(values) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    arr = 1e3 * np.asarray(values, np.float64)
    return {"mean_ms": float(arr.mean()), "median_ms": float(np.median(arr)),
            "p99_ms": float(np.percentile(arr, 99))}


def summarize(run: RunResult, traces=None) -> dict:
    """vllm bench serve's figures. TPOT excludes the first token; ITL pools every gap."""
    traces = run.traces if traces is None else traces
    done = [t for t in traces if len(t.token_times) == t.output_len]
    if not done:
        raise RuntimeError(f"{run.engine}: no request completed")
    end = max(t.token_times[-1] for t in done)
    duration = end - run.start
    out_tokens = sum(len(t.token_times) for t in done)
    in_tokens = sum(t.prompt_len for t in done)
    tpot = [(t.token_times[-1] - t.token_times[0]) / (t.output_len - 1)
            for t in done if t.output_len > 1]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    return {
        "completed": len(done), "requests": len(traces), "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration,
        "ttft": stats_ms([t.token_times[0] - t.arrival for t in done]),
        "tpot": stats_ms(tpot),
        "itl": stats_ms(itl),
        "e2el": stats_ms([t.token_times[-1] - t.arrival for t in done]),
    }


def step_stats(run: RunResult, slots: int) -> dict:
    if not run.steps:
        return {}
    seqs = np.array([s[1] for s in run.steps])
    blocks = np.array([s[2] for s in run.steps])
    return {"num_steps": len(run.steps), "mean_slot_occupancy": float(seqs.mean() / slots),
            "max_kv_blocks_in_use": int(blocks.max()), "mean_kv_blocks_in_use": float(blocks.mean()),
            **step_time_split(run.steps, run.step_seconds)}


def step_time_split(steps, step_seconds) -> dict:
    """Where a run's step time went: steps carrying a prefill chunk vs decode-only steps (one
    token per sequence), and the median decode-only step by rows (a power of two, as the
    runner pads them). Works on bench.json's "steps" and "step_seconds" too."""
    decode = [(s[1], dt) for s, dt in zip(steps, step_seconds) if s[3] == s[1]]
    prefill = [dt for s, dt in zip(steps, step_seconds) if s[3] != s[1]]
    by_rows: dict[int, list[float]] = {}
    for rows, dt in decode:
        by_rows.setdefault(1 << (rows - 1).bit_length(), []).append(dt)
    return {"prefill_steps": len(prefill), "prefill_step_seconds": float(sum(prefill)),
            "decode_only_steps": len(decode),
            "decode_only_seconds": float(sum(dt for _, dt in decode)),
            "mean_rows_per_decode_step": float(np.mean([r for r, _ in decode])) if decode else 0.0,
            "decode_step_ms_by_rows": {r: {"steps": len(v), "median_ms": 1e3 * float(np.median(v))}
                                       for r, v in sorted(by_rows.items())}}


# ==== jaxbatch ====================================================================================

def jaxbatch_engine(loaded, batching, slots, max_model_len, chunk=None, budget=None, **kw):
    from jaxbatch.engine.llm_engine import LLMEngine
    return LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=max_model_len,
                     batching=batching, prefill_chunk_size=chunk, max_num_batched_tokens=budget,
                     warmup=False, **kw)


def run_jaxbatch(engine, requests, label, progress=True) -> RunResult:
    """Drives LLMEngine.step(), adding each request at its arrival time (arrival_time is set to
    the scheduled arrival, so time spent queued counts in TTFT)."""
    from jaxbatch import SamplingParams
    before = engine.stats()["num_compilations"]
    engine.reset_prefix_cache()      # a warm-up run of the same prompts must not serve this one
    first_step = len(engine.step_log)
    traces = {r.rid: Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, 0.0) for r in requests}
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    bar = tqdm(total=len(requests), desc=label, disable=not progress, leave=False)
    step_seconds = []
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0].arrival <= now:
            r = pending.popleft()
            traces[r.rid].arrival = start + r.arrival
            engine.add_request(r.rid, r.prompt_ids, SamplingParams(
                temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
                arrival_time=start + r.arrival)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0].arrival - time.monotonic()))
            continue
        logged, started = len(engine.step_log), time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        if len(engine.step_log) > logged:          # a step that computed something
            step_seconds.append(now - started)
        for out in outputs:
            trace = traces[out.request_id]
            trace.token_times += [now] * (len(out.outputs[0].token_ids) - len(trace.token_times))
            bar.update(out.finished)
    bar.close()
    stats = engine.stats()
    steps = [(t - start, seqs, blocks, tokens)
             for t, seqs, blocks, tokens in engine.step_log[first_step:]]
    info = {"compilations_before": before, "compilations_after": stats["num_compilations"],
            "compilations_during_timed_run": stats["num_compilations"] - before,
            "warmup_seconds": engine.warmup_seconds, "compile_seconds": stats["compile_seconds"],
            "num_preemptions": stats["num_preemptions"],
            "config": dataclasses.asdict(engine.config)}
    return RunResult(label, start, list(traces.values()), steps, step_seconds, info)


def warm_jaxbatch(engine, requests, mode):
    """'buckets': compile every bucket (the runtime then never compiles, whatever arrives);
    'workload': an untimed run of the same requests at t=0 (scheduling is deterministic, so an
    offline run compiles exactly what its timed twin needs; cheaper on a GPU than all buckets)."""
    if mode == "buckets":
        engine.warmup()
    else:
        start = time.perf_counter()
        run_jaxbatch(engine, [dataclasses.replace(r, arrival=0.0) for r in requests], "warm-up",
                     progress=False)
        engine.warmup_seconds += time.perf_counter() - start


def warmed_engine(loaded, batching, slots, model_len, requests, mode, shared=None, **kw):
    """An engine ready to time. With `shared`, it reuses that engine's runner (compiled steps
    and KV pool): static and continuous then run identical executables, and a runner warmed on
    every bucket needs no second warm-up. A workload warm-up still runs, since the other mode's
    schedule may touch buckets this one did not."""
    engine = jaxbatch_engine(loaded, batching, slots, model_len,
                             runner=shared.runner if shared is not None else None, **kw)
    if shared is None or mode == "workload":
        warm_jaxbatch(engine, requests, mode)
    return engine


# ==== Hugging Face ================================================================================

def load_hf_model(threads):
    import torch
    from transformers import AutoModelForCausalLM
    from jaxbatch.model.loader import embedded_gguf_path
    torch.set_num_threads(threads)
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def _pad_id(model) -> int:
    cfg = model.generation_config
    for value in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if value is not None:
            return value[0] if isinstance(value, (list, tuple)) else int(value)


def run_hf_generate(model, requests, slots, label="hf_generate", progress=True) -> RunResult:
    """Static batching as users write it: groups of `slots` in order, left-padded, greedy, each
    group runs to the longest output in it (min_new_tokens = max_new_tokens so EOS cannot end
    it early). Only each request's own requested tokens are counted. Offline only."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):         # called once per generated step
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    pad = _pad_id(model)
    traces = []
    bar = tqdm(total=len(requests), desc=label, disable=not progress, leave=False)
    start = time.perf_counter()
    for g in range(0, len(requests), slots):
        group = requests[g:g + slots]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in group])
        new = max(r.output_len for r in group)
        clock = StepClock()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=pad,
                           stopping_criteria=StoppingCriteriaList([clock]))
        for r in group:
            traces.append(Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, start,
                                clock.times[:r.output_len]))
        bar.update(len(group))
    bar.close()
    return RunResult(label, start, traces, info={"group_size": slots})


def run_hf_generate_batch(model, requests, slots, label="hf_generate_batch",
                          progress=True) -> RunResult:
    """HF continuous batching through the manager `generate_batch` wraps: generate_batch takes
    one max_new_tokens for all requests, its manager's add_request takes one per request, so
    both engines run the same lengths. EOS is disabled (eos_token_id=-1); greedy; at most
    `slots` requests per batch, as jaxbatch's max_num_seqs."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                           eos_token_id=-1, pad_token_id=_pad_id(model))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in requests),
                          max_generated_length=max(r.output_len for r in requests),
                          num_requests=len(requests))
    cb = ContinuousBatchingConfig(max_requests_per_batch=slots)
    traces = {}
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=30,
            workload_hints=hints) as manager:
        bar = tqdm(total=len(requests), desc=label, disable=not progress, leave=False)
        start = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt_ids, request_id=r.rid, max_new_tokens=r.output_len,
                                eos_token_id=-1, record_timestamps=True)
            traces[r.rid] = Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, start)
        finished = 0
        while finished < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"HF continuous batching: {result.error}")
                traces[result.request_id].token_times = list(result.timestamps)
                finished += 1
                bar.update(1)
        bar.close()
    return RunResult(label, start, list(traces.values()), info={"max_requests_per_batch": slots})


def warm_hf(model, requests, slots, engines):
    """A short untimed run of each selected HF path: first-call allocations, thread pools."""
    shortest = sorted(requests, key=lambda r: len(r.prompt_ids))[:4]
    few = [dataclasses.replace(r, output_len=4) for r in shortest]
    if "hf_generate" in engines:
        run_hf_generate(model, few, slots, progress=False)
    if "hf_generate_batch" in engines:
        run_hf_generate_batch(model, few, slots, progress=False)


# ==== CPU benchmark ===============================================================================

def pow2_model_len(requests, block_size=16) -> int:
    """Smallest length with a power-of-two page count that fits every request, so the set of
    page buckets (and compilations) is no larger than the workload needs."""
    need = max(len(r.prompt_ids) + r.output_len for r in requests) + 1
    pages = 1 << max(0, math.ceil(need / block_size) - 1).bit_length()
    return pages * block_size


def bench_offline(args, loaded, hf_model, requests) -> dict:
    """Every selected engine on the same requests; returns summaries and raw runs."""
    slots, model_len = args.max_num_seqs, pow2_model_len(requests)
    runs, first = {}, None
    for name in args.engines:
        if name in ("continuous", "static"):
            engine = warmed_engine(loaded, name, slots, model_len, requests, args.warmup,
                                   shared=first, **args.engine_kwargs)
            runs[name] = run_jaxbatch(engine, requests, name)
            runs[name].info["runner_shared_with"] = first and first.config.batching
            first = first or engine
        elif name == "hf_generate":
            runs[name] = run_hf_generate(hf_model, requests, slots)
        else:
            runs[name] = run_hf_generate_batch(hf_model, requests, slots)
    lens = [r.output_len for r in requests]
    return {
        "requests": [{"rid": r.rid, "kind": r.kind, "prompt_len": len(r.prompt_ids),
                      "output_len": r.output_len} for r in requests],
        "max_model_len": model_len,
        "ideal": ideal_ratio(lens, slots),
        "summaries": {n: {**summarize(run), **step_stats(run, slots), **run.info}
                      for n, run in runs.items()},
        "runs": runs,
    }


def bench_online(args, loaded, requests) -> dict:
    """jaxbatch continuous with chunked prefill vs chunking disabled, same arrivals."""
    slots, model_len = args.max_num_seqs, pow2_model_len(requests)
    longest = max(len(r.prompt_ids) for r in requests)
    whole = 1 << (longest - 1).bit_length()
    variants = {
        # A long prompt takes at most `chunk` tokens a step; the rest of the budget admits
        # short prompts in the same step.
        "chunked": (args.online_chunk, slots + args.online_budget_chunks * args.online_chunk),
        # Chunking disabled: one chunk holds any prompt whole.
        "unchunked": (whole, slots + whole),
    }
    runs, summaries = {}, {}
    for name, (chunk, budget) in variants.items():
        engine = jaxbatch_engine(loaded, "continuous", slots, model_len, chunk, budget,
                                 **args.engine_kwargs)
        warm_jaxbatch(engine, requests, "buckets")   # arrivals vary run to run: compile all
        run = runs[name] = run_jaxbatch(engine, requests, f"online {name}")
        del engine
        short = [t for t in run.traces if t.kind in SHORT_KINDS]
        summaries[name] = {**summarize(run), **step_stats(run, slots), **run.info,
                           "prefill_chunk_size": chunk, "max_num_batched_tokens": budget,
                           "short_ttft": stats_ms([t.token_times[0] - t.arrival for t in short]),
                           "max_step_ms": 1e3 * max(run.step_seconds)}
    return {"requests": [{"rid": r.rid, "kind": r.kind, "prompt_len": len(r.prompt_ids),
                          "output_len": r.output_len, "arrival_s": r.arrival} for r in requests],
            "request_rate": args.request_rate, "summaries": summaries, "runs": runs}


# ==== GPU benchmark ===============================================================================

class KvReadMeter:
    """Wraps runner.dispatch to record, per engine step, the KV tokens the step's decodes must
    read (sum of context lengths) and whether the step was decode-only."""

    def __init__(self, runner):
        self.per_step: list[tuple[int, bool]] = []
        self._runner, self._dispatch = runner, runner.dispatch
        runner.dispatch = self

    def __call__(self, plan, next_tokens):
        self.per_step.append((sum(d.position + 1 for d in plan.decodes), not plan.prefills))
        return self._dispatch(plan, next_tokens)

    def remove(self):
        self._runner.dispatch = self._dispatch


def bandwidth_utilisation(run, meter_steps, weight_bytes, kv_token_bytes, copy_bps) -> dict:
    """MBU per decode-only step = (weights read + KV read) / step time / copy bandwidth.
    Step time is the wall time of `engine.step()` (host work included)."""
    per_step = meter_steps[-len(run.step_seconds):]
    decode = [(kv, dt) for (kv, decode_only), dt in zip(per_step, run.step_seconds) if decode_only]
    moved = [weight_bytes + kv * kv_token_bytes for kv, _ in decode]
    seconds = [dt for _, dt in decode]
    return {"decode_steps": len(decode),
            "mbu_median": float(np.median(np.divide(moved, seconds))) / copy_bps if decode else None,
            "mbu_aggregate": sum(moved) / sum(seconds) / copy_bps if decode else None,
            "decode_step_ms_median": 1e3 * float(np.median(seconds)) if decode else None}


def bench_gpu(args, entries) -> dict:
    """Random-weight Llama shapes (bf16), token-id prompts, continuous vs static, MBU."""
    import jax
    from jaxbatch.benchmarks import gpu_e2e
    from jaxbatch.worker.kv_cache import bytes_per_block
    from jaxbatch.model.quantize import quantize_params
    models = args.gpu_models or (["tiny"] if args.dry_run else ["1B", "8B"])
    copy_bytes = (8 << 20) if args.dry_run else (1 << 30)
    copy_bps = gpu_e2e.copy_bandwidth(copy_bytes)
    out = {"copy_GBps": copy_bps / 1e9, "device": str(jax.devices()[0].device_kind), "models": {}}
    for name in models:
        loaded = gpu_e2e.random_model(name, "bfloat16", args.seed)
        if args.quantization:               # quantized here so the MBU counts int8 bytes
            loaded.params = quantize_params(loaded.params)
        cfg = loaded.config
        prompts = synthetic_prompt_ids(entries, cfg.vocab_size, args.seed)
        requests = offline_requests(prompts, [e["kind"] for e in entries], args.num_requests,
                                    args.lengths, args.seed, args.max_prompt_len)
        weight_bytes = gpu_e2e.param_bytes(loaded.params)
        if not cfg.tie_word_embeddings:     # an untied embedding table is only gathered
            weight_bytes -= loaded.params["embed"].nbytes
        kv_token_bytes = bytes_per_block(cfg, 1, loaded.params["embed"].dtype, args.kv_cache_dtype)
        model_len = pow2_model_len(requests)
        result = {"weight_bytes_read_per_step": weight_bytes, "max_model_len": model_len,
                  "ideal": ideal_ratio([r.output_len for r in requests], args.max_num_seqs),
                  "summaries": {}}
        first = None
        for batching in ("continuous", "static"):
            engine = warmed_engine(loaded, batching, args.max_num_seqs, model_len, requests,
                                   args.warmup, shared=first,
                                   num_blocks=args.max_num_seqs * (model_len // 16) + 1,
                                   **args.engine_kwargs)
            meter = KvReadMeter(engine.runner)
            run = run_jaxbatch(engine, requests, f"{name} {batching}")
            meter.remove()
            result["summaries"][batching] = {
                **summarize(run), **step_stats(run, args.max_num_seqs), **run.info,
                **bandwidth_utilisation(run, meter.per_step, weight_bytes, kv_token_bytes,
                                        copy_bps)}
            first = first or engine
        del engine, first
        gc.collect()                        # frees the KV pool before the next model
        out["models"][name] = result
        del loaded
        gc.collect()
    return out


# ==== report ======================================================================================

def machine_info() -> dict:
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}
    try:
        info["lscpu_model"] = next(
            line.split(":", 1)[1].strip() for line in subprocess.run(
                ["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    import jax
    info.update(jax=jax.__version__, jax_backend=jax.default_backend())
    for mod in ("torch", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return info


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def engine_table(summaries) -> str:
    head = ("| engine | req/s | out tok/s | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms | "
            "ITL mean/med/p99 ms | E2EL mean/med/p99 ms | steps | slot occ. | compiles timed |")
    lines = [head, "|---" * 10 + "|"]
    trio = lambda s: "/".join(_fmt(s[k], 0) for k in ("mean_ms", "median_ms", "p99_ms"))
    for name, s in summaries.items():
        lines.append(f"| {name} | {_fmt(s['request_throughput'], 2)} | "
                     f"{_fmt(s['output_tokens_per_s'])} | {trio(s['ttft'])} | {trio(s['tpot'])} | "
                     f"{trio(s['itl'])} | {trio(s['e2el'])} | {s.get('num_steps', '-')} | "
                     f"{_fmt(s.get('mean_slot_occupancy'), 2)} | "
                     f"{s.get('compilations_during_timed_run', '-')} |")
    return "\n".join(lines)


def online_table(online) -> str:
    lines = ["| online variant | chunk | budget | short TTFT mean/med/p99 ms | all TTFT p99 ms | "
             "max step ms | out tok/s | compiles timed |", "|---" * 8 + "|"]
    for name, s in online["summaries"].items():
        t = s["short_ttft"]
        lines.append(f"| {name} | {s['prefill_chunk_size']} | {s['max_num_batched_tokens']} | "
                     f"{_fmt(t['mean_ms'], 0)}/{_fmt(t['median_ms'], 0)}/{_fmt(t['p99_ms'], 0)} | "
                     f"{_fmt(s['ttft']['p99_ms'], 0)} | {_fmt(s['max_step_ms'], 0)} | "
                     f"{_fmt(s['output_tokens_per_s'])} | {s['compilations_during_timed_run']} |")
    return "\n".join(lines)


def targets(report) -> list[dict]:
    """The issue's targets, each with the measured figure and met / missed / not run."""
    rows = []

    def add(name, value, target, met):
        rows.append({"target": name, "measured": value, "goal": target,
                     "status": "not run" if met is None else ("met" if met else "missed")})
    off = report.get("offline", {})
    s = off.get("summaries", {})
    tps = {k: v["output_tokens_per_s"] for k, v in s.items()}
    if "continuous" in tps and "static" in tps:
        ratio, ideal = tps["continuous"] / tps["static"], off["ideal"]["ideal_ratio"]
        steps = s["static"]["num_steps"] / s["continuous"]["num_steps"]
        add("continuous / static output tok/s", f"{ratio:.2f} (ideal {ideal:.2f}, 0.9 x ideal "
            f"= {0.9 * ideal:.2f}; measured step ratio {steps:.2f})",
            ">= 0.9 x ideal and >= 2.0", ratio >= 0.9 * ideal and ratio >= 2.0)
    for hf, goal in (("hf_generate", 3.0), ("hf_generate_batch", 1.5)):
        if "continuous" in tps and hf in tps:
            r = tps["continuous"] / tps[hf]
            add(f"continuous / {hf} output tok/s", f"{r:.2f}", f">= {goal}", r >= goal)
    floor = report.get("decode_floor")
    if floor:
        for r in floor["results"]:
            add(f"decode step / floor, {r['slots']} slots, context {r['context']}",
                f"{r['ratio_engine_over_floor']:.2f} ({r['engine_step_ms']:.0f} vs "
                f"{r['floor_ms']:.0f} ms)", f"<= {floor['target_ratio']}",
                r["ratio_engine_over_floor"] <= floor["target_ratio"])
    else:
        add("decode step / floor", "run scripts/decode_floor.py --out DIR", "<= 1.3", None)
    on = report.get("online", {}).get("summaries", {})
    if "chunked" in on and "unchunked" in on:
        c, u = on["chunked"]["short_ttft"]["p99_ms"], on["unchunked"]["short_ttft"]["p99_ms"]
        add("online p99 TTFT of short requests, chunked vs unchunked",
            f"{c:.0f} ms vs {u:.0f} ms (max step {on['chunked']['max_step_ms']:.0f} vs "
            f"{on['unchunked']['max_step_ms']:.0f} ms)", "chunked below unchunked", c < u)
    compiles = {f"{part} {k}": v["compilations_during_timed_run"]
                for part in ("offline", "online")
                for k, v in report.get(part, {}).get("summaries", {}).items()
                if "compilations_during_timed_run" in v}
    if compiles:
        add("compilations after warm-up", ", ".join(f"{k}: {v}" for k, v in compiles.items()),
            "0 everywhere", not any(compiles.values()))
    return rows


def targets_table(rows) -> str:
    lines = ["| target | measured | goal | status |", "|---|---|---|---|"]
    lines += [f"| {r['target']} | {r['measured']} | {r['goal']} | {r['status']} |" for r in rows]
    return "\n".join(lines)


def plot_all(report, out_dir: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    off = report.get("offline", {})
    runs = off.get("runs", {})
    slots = report["args"]["max_num_seqs"]
    stepped = {k: r for k, r in runs.items() if r.steps}
    if stepped:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for name, run in stepped.items():
            t = [s[0] for s in run.steps]
            ax1.step(t, [s[1] / slots for s in run.steps], where="post", label=name)
            ax2.step(t, [s[2] for s in run.steps], where="post", label=name)
        ax1.set_ylabel("slot occupancy")
        ax1.set_title(f"Offline workload, {slots} slots: sequences computed per step")
        ax2.set_ylabel("KV blocks in use")
        ax2.set_xlabel("seconds since start")
        ax1.legend()
        files.append(_save(fig, out_dir / "occupancy.png"))
    if runs:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, run in runs.items():
            done = [t for t in run.traces if t.token_times]
            _cdf(axes[0], [t.token_times[0] - t.arrival for t in done], name)
            _cdf(axes[1], [t.token_times[-1] - t.arrival for t in done], name)
        axes[0].set_xlabel("TTFT (s)")
        axes[1].set_xlabel("end-to-end latency (s)")
        for ax in axes:
            ax.set_ylabel("fraction of requests")
            ax.legend()
        fig.suptitle("Offline workload: latency CDFs")
        files.append(_save(fig, out_dir / "latency_cdf.png"))
    online = report.get("online", {}).get("runs", {})
    if online:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, run in online.items():
            _cdf(ax, [t.token_times[0] - t.arrival for t in run.traces
                      if t.kind in SHORT_KINDS and t.token_times], name)
        ax.set_xlabel("TTFT of short requests (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"Online, {report['args']['request_rate']} req/s, long prompts among them")
        ax.legend()
        files.append(_save(fig, out_dir / "online_ttft_cdf.png"))
    return files


def _cdf(ax, values, label):
    values = np.sort(values)
    ax.step(values, np.arange(1, len(values) + 1) / max(1, len(values)), where="post", label=label)


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path.name


def to_json(obj):
    """Reports hold RunResults (serialised with traces and step logs) and numpy scalars."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, RunResult):
        return {"engine": obj.engine, "info": obj.info, "steps": obj.steps,
                "step_seconds": obj.step_seconds,
                "traces": [{**dataclasses.asdict(t), "arrival": t.arrival - obj.start,
                            "token_times": [x - obj.start for x in t.token_times]}
                           for t in obj.traces]}
    return str(obj)


# ==== main ========================================================================================

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--workloads", nargs="+", choices=("offline", "online", "prefix"),
                    default=["offline", "online"])
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="slots (HF: batch size); default 16, 64 with --device gpu")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="offline requests; default 32, 4 x slots with --device gpu")
    ap.add_argument("--output-median", type=float, default=24)
    ap.add_argument("--output-sigma", type=float, default=1.0)
    ap.add_argument("--output-min", type=int, default=4)
    ap.add_argument("--output-max", type=int, default=192)
    ap.add_argument("--request-rate", type=float, default=1.0, help="online arrivals per second")
    ap.add_argument("--online-short", type=int, default=20, help="online short requests")
    ap.add_argument("--online-long", type=int, default=3, help="online long prompts among them")
    ap.add_argument("--online-output-median", type=float, default=12)
    ap.add_argument("--online-output-max", type=int, default=48)
    ap.add_argument("--online-chunk", type=int, default=64, help="chunked variant's chunk size")
    ap.add_argument("--online-budget-chunks", type=int, default=4,
                    help="chunked variant's budget: max_num_seqs + this many chunks")
    ap.add_argument("--max-prompt-len", type=int, default=None,
                    help="truncate prompts to their last N tokens")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--warmup", choices=("buckets", "workload"), default=None,
                    help="jaxbatch warm-up: every bucket (CPU default) or an untimed run of "
                         "the same offline workload (GPU default)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--gpu-models", nargs="+", default=None,
                    help="--device gpu: shapes from gpu_e2e.MODEL_SHAPES (1B 8B)")
    ap.add_argument("--dry-run", action="store_true",
                    help="--device gpu on CPU with a tiny random model and short prompts")
    ap.add_argument("--xla-cache", default=None,
                    help="persistent XLA compilation cache dir ('' disables; default "
                         "<jaxbatch cache>/xla): reruns skip the compile time of warm-up")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                    help="jaxbatch engines: int8 KV cache (scales per token and KV head)")
    ap.add_argument("--quantization", choices=("int8",), default=None,
                    help="jaxbatch engines: int8 weight-only layer matrices")
    ap.add_argument("--out", default="bench_out")
    from bench_prefix import add_arguments as add_prefix_arguments
    add_prefix_arguments(ap)
    args = ap.parse_args(argv)
    args.lengths = (args.output_median, args.output_sigma, args.output_min, args.output_max)
    args.online_lengths = (args.online_output_median, args.output_sigma, args.output_min,
                           args.online_output_max)
    args.warmup = args.warmup or ("workload" if args.device == "gpu" else "buckets")
    args.engine_kwargs = {}
    gpu = args.device == "gpu"
    if args.dry_run:
        if not gpu:
            ap.error("--dry-run goes with --device gpu")
        # Tiny everything: checks the GPU path's code on CPU, Pallas in interpret mode.
        args.max_num_seqs = min(args.max_num_seqs or 4, 4)
        args.num_requests = min(args.num_requests or 12, 12)
        args.max_prompt_len = args.max_prompt_len or 40
        args.lengths = (8, args.output_sigma, 2, 24)
        args.engine_kwargs = {"attention_backend": "pallas_interpret"}
    args.engine_kwargs.update(kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    args.max_num_seqs = args.max_num_seqs or (64 if gpu else 16)
    args.num_requests = args.num_requests or (4 * args.max_num_seqs if gpu else 32)
    return args


def enable_xla_cache(path):
    import jax
    from jaxbatch.model.loader import cache_root
    path = os.path.join(cache_root(), "xla") if path is None else path
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
    return path or None


def run_cpu(args, report):
    from jaxbatch.model.loader import load_model
    entries = load_prompts(args.prompts)
    kinds = [e["kind"] for e in entries]
    loaded = load_model(dtype="float32")
    prompts = encode_prompts(entries, loaded.tokenizer)
    hf_model = None
    if {"hf_generate", "hf_generate_batch"} & set(args.engines) and "offline" in args.workloads:
        hf_model = load_hf_model(args.threads)
    if "offline" in args.workloads:
        requests = offline_requests(prompts, kinds, args.num_requests, args.lengths, args.seed,
                                    args.max_prompt_len)
        if hf_model is not None:
            warm_hf(hf_model, requests, args.max_num_seqs, args.engines)
        report["offline"] = bench_offline(args, loaded, hf_model, requests)
    if "online" in args.workloads:
        requests = online_requests(prompts, kinds, args.online_short, args.online_long,
                                   args.request_rate, args.online_lengths, args.seed,
                                   args.max_prompt_len)
        report["online"] = bench_online(args, loaded, requests)
    if "prefix" in args.workloads:
        from bench_prefix import bench_prefix
        args.slots, args.max_model_len = args.max_num_seqs, 2048
        report["prefix"] = bench_prefix(loaded, args)
    floor = Path(args.out) / "decode_floor.json"
    if floor.exists():      # written by scripts/decode_floor.py; shown among the targets
        report["decode_floor"] = json.loads(floor.read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(), "xla_cache": enable_xla_cache(args.xla_cache),
              "args": {k: v for k, v in vars(args).items() if k != "engine_kwargs"}}
    start = time.perf_counter()
    if args.device == "gpu":
        report["gpu"] = bench_gpu(args, load_prompts(args.prompts))
    else:
        run_cpu(args, report)
    report["bench_seconds"] = time.perf_counter() - start
    report["machine"]["loadavg_at_end"] = os.getloadavg()   # other jobs share this machine
    report["targets"] = targets(report) if args.device == "cpu" else []
    report["plots"] = plot_all(report, out_dir) if args.device == "cpu" else []
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1, default=to_json))
    print(f"\nwrote {out_dir / 'bench.json'} and {', '.join(report['plots']) or 'no plots'} "
          f"in {report['bench_seconds']:.0f} s\n")
    print(markdown(report))
    return report


def markdown(report) -> str:
    parts = []
    if "offline" in report:
        ideal = report["offline"]["ideal"]
        parts.append(f"Offline: {report['args']['num_requests']} requests, "
                     f"{report['args']['max_num_seqs']} slots; ideal continuous/static ratio "
                     f"{ideal['ideal_ratio']:.2f} ({ideal['static_steps']} vs "
                     f"{ideal['continuous_steps']} decode steps)\n")
        parts.append(engine_table(report["offline"]["summaries"]))
    if "online" in report:
        parts.append(f"\nOnline: {report['args']['request_rate']} req/s\n")
        parts.append(online_table(report["online"]))
    for name, m in report.get("gpu", {}).get("models", {}).items():
        parts.append(f"\nGPU {name} (bf16 random weights), copy bandwidth "
                     f"{report['gpu']['copy_GBps']:.0f} GB/s, ideal ratio "
                     f"{m['ideal']['ideal_ratio']:.2f}\n")
        parts.append(engine_table(m["summaries"]))
        parts.append("\n| engine | MBU median | MBU aggregate | decode step ms |\n|---|---|---|---|")
        for b, s in m["summaries"].items():
            parts.append(f"| {b} | {_fmt(s['mbu_median'], 2)} | {_fmt(s['mbu_aggregate'], 2)} | "
                         f"{_fmt(s['decode_step_ms_median'], 2)} |")
    if "prefix" in report:
        from bench_prefix import markdown as prefix_markdown
        parts.append("\nPrefix caching\n")
        parts.append(prefix_markdown(report["prefix"]))
    if report.get("targets"):
        parts.append("\nTargets\n")
        parts.append(targets_table(report["targets"]))
    return "\n".join(parts)


if __name__ == "__main__":
    main()
