"""Throughput (`jaxbatch bench throughput`) and latency under arrivals (`jaxbatch bench latency`):
continuous against static batching on the same compiled steps and requests, with `vllm bench
serve`'s metrics and the cost per million output tokens. (Peers and the GPU, in a checkout:
`python -m benchmarks throughput-hf`, `throughput-gpu`.)

Workloads (seeded; greedy with ignore_eos, so lengths are controlled):
  offline  --num-requests requests at t=0, bundled prompts (chat template applied) drawn
           uniformly, output lengths round(lognormal(median, sigma)) clipped to [min, max]
  online   Poisson arrivals at --request-rate: short prompts with long ones among them; the
           short ones' TTFT with chunked prefill vs chunking disabled (the default of `latency`)
Every engine is warmed up first (jaxbatch: every bucket) and every timed jaxbatch run starts
from an empty prefix cache; timing is wall clock around the timed part only."""
from __future__ import annotations

from jaxbatch.benchmarks.harness import (enable_xla_cache, ideal_ratio, pow2_model_len,
                                         run_jaxbatch, step_stats, summarize, warmed_engine)
from jaxbatch.benchmarks.base import Benchmark, add_flags
from jaxbatch.benchmarks.report import cdf, cost_cell, fmt, pyplot, save_png, stats_ms, table, trio
from jaxbatch.benchmarks.workloads import (DEFAULT_PROMPTS, SHORT_KINDS, encode_prompts,
                                           load_prompts, offline_requests, online_requests)

ENGINES = ("continuous", "static")


def bench_offline(args, loaded, requests, peer_runs=None) -> dict:
    """Every selected engine on the same requests; returns summaries and raw runs. Static
    reuses continuous's runner: both time the same compiled steps."""
    slots, model_len = args.max_num_seqs, pow2_model_len(requests)
    runs, first = {}, None
    for name in args.engines:
        if name in ENGINES:
            engine = warmed_engine(loaded, name, slots, model_len, requests, args.warmup,
                                   shared=first, **args.engine_kwargs)
            runs[name] = run_jaxbatch(engine, requests, name)
            runs[name].info["runner_shared_with"] = first and first.config.batching
            first = first or engine
        else:
            runs[name] = peer_runs[name](requests, slots)
    # The requests are in each run's traces (RunResult.to_json).
    return {"max_model_len": model_len,
            "ideal": ideal_ratio([r.output_len for r in requests], slots),
            "summaries": {n: {**summarize(run), **step_stats(run, slots), **run.info}
                          for n, run in runs.items()},
            "runs": runs}


def bench_online(args, loaded, requests) -> dict:
    """jaxbatch continuous with chunked prefill vs chunking disabled, same arrivals."""
    slots, model_len = args.max_num_seqs, pow2_model_len(requests)
    whole = 1 << (max(len(r.prompt_ids) for r in requests) - 1).bit_length()
    # (chunk, budget). Chunked: a long prompt takes at most `chunk` tokens a step and the rest
    # of the budget admits short prompts beside it; unchunked: one chunk holds any prompt.
    variants = {"chunked": (args.online_chunk,
                            slots + args.online_budget_chunks * args.online_chunk),
                "unchunked": (whole, slots + whole)}
    runs, summaries = {}, {}
    for name, (chunk, budget) in variants.items():
        # Arrivals vary run to run: every bucket compiled.
        engine = warmed_engine(loaded, "continuous", slots, model_len, requests, "buckets",
                               chunk=chunk, budget=budget, **args.engine_kwargs)
        run = runs[name] = run_jaxbatch(engine, requests, f"online {name}")
        del engine
        short = [t for t in run.traces if t.kind in SHORT_KINDS]
        summaries[name] = {**summarize(run), **step_stats(run, slots), **run.info,
                           "prefill_chunk_size": chunk, "max_num_batched_tokens": budget,
                           "short_ttft": stats_ms([t.token_times[0] - t.arrival for t in short]),
                           "max_step_ms": 1e3 * max(run.step_seconds)}
    return {"request_rate": args.request_rate, "summaries": summaries, "runs": runs}


def engine_table(summaries, price: dict) -> str:
    rows = [[name, fmt(s["request_throughput"], 2), fmt(s["output_tokens_per_s"]),
             cost_cell(s["output_tokens_per_s"], price), trio(s["ttft"]), trio(s["tpot"]),
             trio(s["itl"]), trio(s["e2el"]), s.get("num_steps", "-"),
             fmt(s.get("mean_slot_occupancy"), 2), s.get("compilations_during_timed_run", "-")]
            for name, s in summaries.items()]
    return table(["engine", "req/s", "out tok/s", "$ / M out tok", "TTFT mean/med/p99 ms",
                  "TPOT mean/med/p99 ms", "ITL mean/med/p99 ms", "E2EL mean/med/p99 ms",
                  "steps", "slot occ.", "compiles timed"], rows)


def online_table(online, price: dict) -> str:
    rows = [[name, s["prefill_chunk_size"], s["max_num_batched_tokens"], trio(s["short_ttft"]),
             fmt(s["ttft"]["p99_ms"], 0), fmt(s["max_step_ms"], 0), fmt(s["output_tokens_per_s"]),
             cost_cell(s["output_tokens_per_s"], price), s["compilations_during_timed_run"]]
            for name, s in online["summaries"].items()]
    return table(["online variant", "chunk", "budget", "short TTFT mean/med/p99 ms",
                  "all TTFT p99 ms", "max step ms", "out tok/s", "$ / M out tok",
                  "compiles timed"], rows)


def targets(report, goals=None) -> list[dict]:
    """The issue's targets, each with the measured figure and met or missed."""
    rows = []       # (target, measured, goal, met)
    off = report.get("offline", {})
    s = off.get("summaries", {})
    tps = {k: v["output_tokens_per_s"] for k, v in s.items()}
    if "continuous" in tps and "static" in tps:
        ratio, ideal = tps["continuous"] / tps["static"], off["ideal"]["ideal_ratio"]
        steps = s["static"]["num_steps"] / s["continuous"]["num_steps"]
        rows.append(("continuous / static output tok/s", f"{ratio:.2f} (ideal {ideal:.2f}, 0.9 x "
                     f"ideal = {0.9 * ideal:.2f}; measured step ratio {steps:.2f})",
                     ">= 0.9 x ideal and >= 2.0", ratio >= 0.9 * ideal and ratio >= 2.0))
    for peer, goal in (goals or {}).items():
        if "continuous" in tps and peer in tps:
            r = tps["continuous"] / tps[peer]
            rows.append((f"continuous / {peer} output tok/s", f"{r:.2f}", f">= {goal}", r >= goal))
    on = report.get("online", {}).get("summaries", {})
    if "chunked" in on and "unchunked" in on:
        c, u = on["chunked"]["short_ttft"]["p99_ms"], on["unchunked"]["short_ttft"]["p99_ms"]
        rows.append(("online p99 TTFT of short requests, chunked vs unchunked",
                     f"{c:.0f} ms vs {u:.0f} ms (max step {on['chunked']['max_step_ms']:.0f} vs "
                     f"{on['unchunked']['max_step_ms']:.0f} ms)", "chunked below unchunked", c < u))
    compiles = {f"{part} {k}": v["compilations_during_timed_run"] for part in ("offline", "online")
                for k, v in report.get(part, {}).get("summaries", {}).items()
                if "compilations_during_timed_run" in v}
    if compiles:
        measured = ", ".join(f"{k}: {v}" for k, v in compiles.items())
        rows.append(("compilations after warm-up", measured, "0 everywhere",
                     not any(compiles.values())))
    return [{"target": t, "measured": m, "goal": g, "status": "met" if met else "missed"}
            for t, m, g, met in rows]


class Throughput(Benchmark):
    name, report_name = "throughput", "bench"
    workloads = ("offline", "online")       # --workloads' default
    # Other engines on the same requests (the lab's HF baselines): name -> the continuous /
    # peer output tok/s ratio it is to reach; `peer_runs` runs them.
    peer_goals: dict[str, float] = {}

    def add_arguments(self, ap) -> None:
        names = ENGINES + tuple(self.peer_goals)
        ap.add_argument("--engines", nargs="+", choices=names, default=list(names))
        ap.add_argument("--workloads", nargs="+", choices=("offline", "online"),
                        default=list(self.workloads))
        ap.add_argument("--max-prompt-len", type=int, default=None,
                        help="truncate prompts to their last N tokens")
        add_flags(ap, max_num_seqs=(16, "slots (a peer's batch size); default 16"),
                  num_requests=(32, "offline requests; default 32"), prompts=str(DEFAULT_PROMPTS),
                  output_median=24.0, output_sigma=1.0, output_min=4, output_max=192, seed=0,
                  request_rate=(1.0, "online arrivals per second"),
                  online_short=(20, "online short requests"),
                  online_long=(3, "online long prompts among them"), online_output_median=12.0,
                  online_output_max=48, online_chunk=(64, "chunked variant's chunk size"),
                  online_budget_chunks=(4, "chunked variant's budget: max_num_seqs + this many "
                                           "chunks"))
        ap.add_argument("--warmup", choices=("buckets", "workload"), default="buckets",
                        help="jaxbatch warm-up: every bucket (default) or an untimed run of "
                             "the same offline workload")
        ap.add_argument("--xla-cache", default=None,
                        help="persistent XLA compilation cache dir ('' disables; default "
                             "<jaxbatch cache>/xla): reruns skip the compile time of warm-up")
        ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="jaxbatch engines: int8 KV cache (scales per token and KV head)")
        ap.add_argument("--quantization", choices=("int8",), default=None,
                        help="jaxbatch engines: int8 weight-only layer matrices")

    def resolve(self, args):
        """The settings the flags imply."""
        args.lengths = (args.output_median, args.output_sigma, args.output_min, args.output_max)
        args.online_lengths = (args.online_output_median, args.output_sigma, args.output_min,
                               args.online_output_max)
        args.engine_kwargs = dict(kv_cache_dtype=args.kv_cache_dtype,
                                  quantization=args.quantization)
        return args

    def bench(self, loaded, args) -> dict:
        args = self.resolve(args)
        report = {"xla_cache": enable_xla_cache(args.xla_cache)}
        entries = load_prompts(args.prompts)
        kinds, prompts = [e["kind"] for e in entries], encode_prompts(entries, loaded.tokenizer)
        if "offline" in args.workloads:
            requests = offline_requests(prompts, kinds, args.num_requests, args.lengths,
                                        args.seed, args.max_prompt_len)
            peers = self.peer_runs(args, requests) if set(args.engines) - set(ENGINES) else {}
            report["offline"] = bench_offline(args, loaded, requests, peers)
        if "online" in args.workloads:
            requests = online_requests(prompts, kinds, args.online_short, args.online_long,
                                       args.request_rate, args.online_lengths, args.seed,
                                       args.max_prompt_len)
            report["online"] = bench_online(args, loaded, requests)
        report["targets"] = targets(report, self.peer_goals)
        return report

    def peer_runs(self, args, requests) -> dict:
        """{peer name: run(requests, slots) -> RunResult}, ready to time."""
        return {}

    def plots(self, report, out_dir):
        """Slot occupancy and KV blocks per step, latency CDFs."""
        plt = pyplot()
        if plt is None:
            return []
        files, runs = [], report.get("offline", {}).get("runs", {})
        slots = report["args"]["max_num_seqs"]
        if stepped := {k: r for k, r in runs.items() if r.steps}:
            fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
            for name, run in stepped.items():
                t = [s[0] for s in run.steps]
                ax1.step(t, [s[1] / slots for s in run.steps], where="post", label=name)
                ax2.step(t, [s[2] for s in run.steps], where="post", label=name)
            ax1.set(ylabel="slot occupancy",
                    title=f"Offline workload, {slots} slots: sequences computed per step")
            ax2.set(ylabel="KV blocks in use", xlabel="seconds since start")
            ax1.legend()
            files.append(save_png(fig, out_dir / "occupancy.png"))
        if runs:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for name, run in runs.items():
                done = [t for t in run.traces if t.token_times]
                cdf(axes[0], [t.token_times[0] - t.arrival for t in done], name)
                cdf(axes[1], [t.token_times[-1] - t.arrival for t in done], name)
            for ax, what in zip(axes, ("TTFT (s)", "end-to-end latency (s)")):
                ax.set(xlabel=what, ylabel="fraction of requests")
                ax.legend()
            fig.suptitle("Offline workload: latency CDFs")
            files.append(save_png(fig, out_dir / "latency_cdf.png"))
        if online := report.get("online", {}).get("runs", {}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for name, run in online.items():
                cdf(ax, [t.token_times[0] - t.arrival for t in run.traces
                          if t.kind in SHORT_KINDS and t.token_times], name)
            ax.set(xlabel="TTFT of short requests (s)", ylabel="fraction of requests",
                   title=f"Online, {report['args']['request_rate']} req/s, long prompts among them")
            ax.legend()
            files.append(save_png(fig, out_dir / "online_ttft_cdf.png"))
        return files

    def markdown(self, report) -> str:
        parts, price = [], report["price"]
        if "offline" in report:
            ideal = report["offline"]["ideal"]
            parts += [f"Offline: {report['args']['num_requests']} requests, "
                      f"{report['args']['max_num_seqs']} slots; ideal continuous/static ratio "
                      f"{ideal['ideal_ratio']:.2f} ({ideal['static_steps']} vs "
                      f"{ideal['continuous_steps']} decode steps)\n",
                      engine_table(report["offline"]["summaries"], price)]
        if "online" in report:
            parts += [f"\nOnline: {report['args']['request_rate']} req/s\n",
                      online_table(report["online"], price)]
        if report.get("targets"):
            parts += ["\nTargets\n", table(["target", "measured", "goal", "status"],
                                            [list(r.values()) for r in report["targets"]])]
        return "\n".join(parts)


main = Throughput().main
