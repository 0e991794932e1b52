"""Load generator for any OpenAI-compatible server (jaxbatch, vLLM, llama.cpp, ...): streaming
chat or completions requests with Poisson arrivals, reporting what `vllm bench serve` reports,
plus /health latency measured while the server is under that load.

    # servers already running: one line per target in the table and the plot
    jaxbatch bench serve --target continuous=http://127.0.0.1:8000 \\
        --target static=http://127.0.0.1:8001 --target vllm=http://127.0.0.1:8100 \\
        --request-rate 1 2 4 inf --goodput ttft:2000 tpot:500
    # or let it start `python -m jaxbatch serve` itself, one server at a time
    jaxbatch bench serve --launch jaxbatch-continuous jaxbatch-static --request-rate 1 inf
    # a vLLM peer (bash scripts/setup_vllm_cpu.sh; scripts/export_safetensors.py --out DIR)
    jaxbatch bench serve --launch vllm --vllm-model hf_export/SmolLM2-135M-Instruct
    # served throughput at saturation vs offline LLM.generate on the same workload
    jaxbatch bench serve --launch jaxbatch-continuous --request-rate inf --offline-baseline
    # a bounded-concurrency sweep instead of Poisson arrivals
    jaxbatch bench serve --target x=http://127.0.0.1:8000 --request-rate inf \\
        --max-concurrency 1 4 16

Workload (fixed seed, the same for every target and every rate): --num-prompts requests, each
a prompt drawn uniformly from benchmarks/data/bench_prompts.json (chat: one user message, the server
applies its chat template; completions: the raw text) and a max_tokens drawn as
round(lognormal(median, sigma)) clipped to [min, max]; greedy (temperature 0) with
ignore_eos, so every request generates exactly max_tokens tokens. Arrival gaps are one draw of
standard exponentials scaled by 1 / rate (rate inf: all at t=0); --max-concurrency caps the
requests in flight (a request waiting for a slot is not timed, as in vLLM).

Metrics, as `vllm bench serve` computes them: TTFT = first chunk carrying text - request sent;
E2EL = last byte - request sent; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = every gap
between chunks carrying text, pooled; token counts from the server's `usage`
(`stream_options.include_usage`), never from chunk counts (a chunk may carry several tokens);
throughputs over the wall time from the first request sent to the last finished; goodput =
requests meeting every SLO given with --goodput, per second. A side task GETs /health every
--health-interval seconds during the timed run (its p99 is a serving target: the event loop
must stay responsive under load). Output: <out>/bench_serve.json (every request's timings),
bench_serve.md (the table, also printed) and bench_serve.png (TTFT and TPOT against rate).

Warm-up (untimed, per target, before its runs): by default the whole workload at once, so a
server that compiles shapes lazily does it there. Servers with prefix caching (vLLM by default)
then hold every prompt for the timed runs; pass their flag to turn it off to measure cold
prompts (vLLM: --vllm-args '--max-model-len 2048 --no-enable-prefix-caching').

--offline-baseline runs jaxbatch `LLM.generate` in a subprocess after the servers, with the
engine settings a launched `jaxbatch serve` gets (--max-num-seqs, --serve-args as keyword
arguments), the same prompts with the chat template applied, the same max_tokens, greedy,
ignore_eos; one untimed pass, then --offline-passes timed ones. Every run at rate inf is then
reported as served / offline output tokens per second (the serving target: >= 0.9).

--rounds N repeats each target's runs N times; with --offline-baseline the offline subprocess
runs after each round, while the server waits idle, so served and offline passes alternate and
a slow minute of a shared machine hits both. The ratio is then median served / median offline.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from jaxbatch.benchmarks.machine import add_price_argument, machine_info, resolve_price
from jaxbatch.benchmarks.report import (cost_cell, fmt, price_line, pyplot, table, trio,
                                        write_json)
from jaxbatch.benchmarks.serve_client import normalize_base, run_load, warm_up
from jaxbatch.benchmarks.serve_launch import (DEFAULT_VLLM_PYTHON, LAUNCHABLE, LaunchedServer,
                                              offline_worker, run_offline_baseline)
from jaxbatch.benchmarks.workloads import DEFAULT_PROMPTS, make_workload


# ---- report --------------------------------------------------------------------------------------

def rate_label(rate: float, conc) -> str:
    label = "inf" if math.isinf(rate) else f"{rate:g}"
    return label + (f" (c={conc})" if conc else "")


def markdown(report: dict) -> str:
    price = report.get("price") or {}
    goodput = any("goodput" in r["summary"] for r in report["runs"])
    rows = []
    for run in report["runs"]:
        s, h = run["summary"], run["summary"]["health"]
        health = "/".join(fmt(h[k], 1) for k in ("p50_ms", "p99_ms", "max_ms"))
        if h["non_200"]:
            health += f" ({h['non_200']} non-200)"
        rows.append([run["target"], rate_label(s["request_rate"], s["max_concurrency"]),
                     f"{s['completed']}/{s['failed']}", fmt(s["request_throughput"], 2),
                     fmt(s["output_tokens_per_s"]), cost_cell(s["output_tokens_per_s"], price),
                     fmt(s["total_tokens_per_s"]), trio(s["ttft"]), trio(s["tpot"]),
                     trio(s["itl"]), trio(s["e2el"])]
                    + ([fmt(s.get("goodput"), 2)] if goodput else []) + [health])
    head = (["target", "rate req/s", "done/failed", "req/s", "out tok/s", "$ / M out tok",
             "total tok/s", "TTFT mean/med/p99 ms", "TPOT mean/med/p99 ms",
             "ITL mean/med/p99 ms", "E2EL mean/med/p99 ms"]
            + (["goodput req/s"] if goodput else []) + ["/health p50/p99/max ms"])
    parts = [table(head, rows), "", price_line(price)]
    if report.get("offline_baseline"):
        ob = report["offline_baseline"]
        rounds = ob.get("rounds", [ob["output_tokens_per_s"]])
        parts.append(f"\nOffline jaxbatch LLM.generate on the same workload: "
                     f"{ob['output_tokens_per_s']:.1f} out tok/s"
                     + (f" (median of {len(rounds)} rounds: "
                        f"{' / '.join(f'{x:.1f}' for x in rounds)})" if len(rounds) > 1
                        else f" ({ob['output_tokens']} tokens in {ob['seconds']:.1f} s)"))
        for row in ob.get("served_vs_offline", []):
            served = row.get("served_rounds", [])
            parts.append(f"- {row['target']} served at rate {row['rate']}: "
                         f"{row['served_output_tokens_per_s']:.1f} out tok/s"
                         + (f" (median of {' / '.join(f'{x:.1f}' for x in served)})"
                            if len(served) > 1 else "")
                         + f" = **{row['ratio']:.2f} x** jaxbatch offline")
    for name, info in report.get("servers", {}).items():
        if info.get("error"):
            parts.append(f"\n{name}: {info['error']}")
    return "\n".join(parts)


def served_vs_offline(runs: list[dict], offline: list[dict]) -> dict:
    """Each target's runs at rate inf (per concurrency) against the offline passes: median
    served / median offline output tok/s, with every round's numbers."""
    off = [o["output_tokens_per_s"] for o in offline]
    ob = {**offline[-1], "rounds": off, "output_tokens_per_s": statistics.median(off)}
    groups: dict = {}
    for r in runs:
        s = r["summary"]
        if s["request_rate"] == math.inf:
            key = (r["target"], rate_label(s["request_rate"], s["max_concurrency"]))
            groups.setdefault(key, []).append(s["output_tokens_per_s"])
    ob["served_vs_offline"] = [
        {"target": target, "rate": rate, "served_rounds": served,
         "served_output_tokens_per_s": statistics.median(served),
         "ratio": statistics.median(served) / ob["output_tokens_per_s"]}
        for (target, rate), served in groups.items()]
    return ob


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rates = sorted({r["summary"]["request_rate"] for r in report["runs"]})
    finite = [r for r in rates if not math.isinf(r)]
    inf_x = (max(finite) * 1.5 if finite else 1.0)
    xpos = lambda r: inf_x if math.isinf(r) else r
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = {}
    for run in report["runs"]:
        s = run["summary"]
        key = run["target"] + (f" c={s['max_concurrency']}" if s["max_concurrency"] else "")
        lines.setdefault(key, []).append(s)
    for i, (key, rows) in enumerate(sorted(lines.items())):
        rows.sort(key=lambda s: xpos(s["request_rate"]))
        xs = [xpos(s["request_rate"]) for s in rows]
        color = f"C{i}"
        for ax, metric in zip(axes, ("ttft", "tpot")):
            med = [s[metric]["median_ms"] for s in rows]
            p99 = [s[metric]["p99_ms"] for s in rows]
            ax.plot(xs, med, "o-", color=color, label=f"{key} median")
            ax.plot(xs, p99, "x--", color=color, alpha=0.6, label=f"{key} p99")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.set_xticks([xpos(r) for r in rates])
        ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{report['args']['num_prompts']} requests, {report['args']['api']} streaming")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ---- main ----------------------------------------------------------------------------------------

def parse_goodput(items) -> dict | None:
    if not items:
        return None
    slo = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise SystemExit(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slo[key] = float(val)
    return slo


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="jaxbatch bench serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--target", action="append", default=[], metavar="NAME=BASE_URL",
                    help="a running server, e.g. vllm=http://127.0.0.1:8100 (repeatable)")
    ap.add_argument("--launch", nargs="+", default=[], choices=LAUNCHABLE,
                    help="start these servers here, one at a time, on free 127.0.0.1 ports")
    ap.add_argument("--request-rate", nargs="+", type=float, default=[math.inf],
                    help="Poisson arrival rates (req/s); inf sends everything at t=0")
    ap.add_argument("--max-concurrency", nargs="+", type=int, default=[None],
                    help="cap on requests in flight (one run per value)")
    ap.add_argument("--api", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="model name in requests (default: /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-median", type=float, default=32)
    ap.add_argument("--output-sigma", type=float, default=1.0)
    ap.add_argument("--output-min", type=int, default=8)
    ap.add_argument("--output-max", type=int, default=256)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:2000 tpot:500 (also e2el:MS)")
    ap.add_argument("--health-interval", type=float, default=0.1,
                    help="seconds between /health polls during a timed run (0: off)")
    ap.add_argument("--warmup", choices=("none", "requests", "workload"), default="workload",
                    help="untimed, per target, before its runs: nothing, --num-warmups "
                         "requests, or the whole workload at once (default)")
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--max-tokens-field", default=None,
                    help="request field for the output length (default: chat "
                         "max_completion_tokens, completions max_tokens)")
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="launched servers and offline")
    ap.add_argument("--serve-args", default="",
                    help="extra flags for launched jaxbatch servers (and, as LLM kwargs, for "
                         "--offline-baseline), e.g. '--max-model-len 1024'")
    ap.add_argument("--jaxbatch-python", default=sys.executable)
    ap.add_argument("--jaxbatch-model", default=None, help="MODEL for jaxbatch (default embedded)")
    ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    ap.add_argument("--vllm-model", default=None, help="HF directory for --launch vllm")
    ap.add_argument("--vllm-args", default="--max-model-len 2048",
                    help="extra flags for a launched vLLM server")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--offline-baseline", action="store_true",
                    help="also run jaxbatch LLM.generate on the same workload (a subprocess, "
                         "after the servers) and report served / offline output tok/s")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat each target's runs; with --offline-baseline the offline pass "
                         "runs after each round (served and offline interleaved)")
    ap.add_argument("--offline-passes", type=int, default=1,
                    help="timed offline passes after the untimed one (best is reported)")
    ap.add_argument("--out", default="bench_out/serve")
    add_price_argument(ap)
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.goodput = parse_goodput(args.goodput)
    args.extra_body = json.loads(args.extra_body)
    args.lengths = (args.output_median, args.output_sigma, args.output_min, args.output_max)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if not (args.offline_worker or args.target or args.launch or args.offline_baseline):
        ap.error("give at least one --target NAME=URL, --launch KIND or --offline-baseline")
    targets = []
    for t in args.target:
        name, sep, url = t.partition("=")
        if not sep or not url:
            ap.error(f"--target {t!r}: use NAME=BASE_URL")
        targets.append((name, url))
    args.targets = targets
    return args


def bench_target(name, base, args, workload, report, between=None):
    """Warm-up, then every (rate, concurrency) run against one server, --rounds times;
    `between()` after each round (the interleaved offline pass)."""
    print(f"[{name}] warm-up: {args.warmup}", flush=True)
    warm = asyncio.run(warm_up(base, workload, args.api, args.model, args.warmup,
                               args.num_warmups, args.max_tokens_field, args.extra_body,
                               args.api_key))
    report["servers"].setdefault(name, {})["warmup"] = warm
    for round_ in range(args.rounds):
        _one_round(name, base, args, workload, report, round_)
        if between is not None:
            between()


def _one_round(name, base, args, workload, report, round_):
    for conc in args.max_concurrency:
        for rate in args.request_rate:
            print(f"[{name}] rate {rate_label(rate, conc)} ...", flush=True)
            out = asyncio.run(run_load(
                base, workload, rate=rate, max_concurrency=conc, api=args.api, model=args.model,
                goodput=args.goodput, health_interval=args.health_interval or None,
                max_tokens_field=args.max_tokens_field, extra_body=args.extra_body,
                api_key=args.api_key))
            s = out["summary"]
            print(f"[{name}] rate {rate_label(rate, conc)}: {s['completed']}/{s['num_requests']} "
                  f"done, {fmt(s['output_tokens_per_s'])} out tok/s, TTFT median "
                  f"{fmt(s['ttft']['median_ms'], 0)} ms, TPOT median "
                  f"{fmt(s['tpot']['median_ms'], 0)} ms, /health p99 "
                  f"{fmt(s['health']['p99_ms'])} ms", flush=True)
            if s["failed"]:
                print(f"[{name}]   errors: {s['errors']}", flush=True)
            report["runs"].append({"target": name, "base_url": base, "round": round_, **out})


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.offline_worker:
        offline_worker(args.offline_worker)
        return {}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.num_prompts, args.lengths, args.seed, args.prompts)
    # The client's machine (no JAX needed here); the price defaults to it, so a server on
    # another machine (or a GPU) needs --price-per-hour.
    report = {"machine": machine_info(with_jax=False),
              "args": {k: v for k, v in vars(args).items() if k != "targets"},
              "workload": [dataclasses.asdict(r) for r in workload],
              "servers": {}, "runs": []}
    start = time.perf_counter()
    offline = []            # one offline run per round (after each round of each target)
    between = ((lambda: offline.append(run_offline_baseline(args, workload, out_dir)))
               if args.offline_baseline else None)
    for name, url in args.targets:
        bench_target(name, normalize_base(url), args, workload, report, between)
    for kind in args.launch:
        server = LaunchedServer(kind, args, out_dir)
        info = report["servers"].setdefault(kind, {"command": shlex.join(server.cmd)})
        try:
            info["startup_s"] = server.wait_ready(args.startup_timeout)
            bench_target(kind, server.base, args, workload, report, between)
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
            print(f"[{kind}] failed: {info['error']}", flush=True)
        finally:
            server.stop()
    if args.offline_baseline:
        while len(offline) < args.rounds:          # no server ran: the offline rounds alone
            between()
        report["offline_baseline"] = served_vs_offline(report["runs"], offline)
    report["bench_seconds"] = time.perf_counter() - start
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    report["price"] = resolve_price(args.price_per_hour, report["machine"])
    report["plot"] = plot(report, out_dir / "bench_serve.png") if report["runs"] else None
    md = markdown(report)
    (out_dir / "bench_serve.md").write_text(md + "\n")
    write_json(out_dir / "bench_serve.json", report, default=str)
    print(f"\nwrote {out_dir}/bench_serve.json, bench_serve.md"
          f"{', ' + report['plot'] if report['plot'] else ''} "
          f"in {report['bench_seconds']:.0f} s\n")
    print(md)
    return report


if __name__ == "__main__":
    main()
