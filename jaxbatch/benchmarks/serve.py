"""Load generator for any OpenAI-compatible server (jaxbatch, vLLM, llama.cpp, ...): streaming
requests with Poisson arrivals, `vllm bench serve`'s figures, and /health latency under load.

    jaxbatch bench serve --target continuous=http://127.0.0.1:8000 \\
        --target vllm=http://127.0.0.1:8100 --request-rate 1 2 4 inf --goodput ttft:2000 tpot:500
    jaxbatch bench serve --target x=http://127.0.0.1:8000 --request-rate inf --max-concurrency 1 4 16

Workload (seeded, the same for every target and rate): --num-prompts bundled prompts drawn
uniformly, max_tokens round(lognormal(median, sigma)) clipped to [min, max], greedy with
ignore_eos; arrival gaps one draw of exponentials scaled by 1 / rate (inf: all at t=0);
--max-concurrency caps the requests in flight (waiting for a slot is not timed, as in vLLM).
Metrics as vLLM's: TTFT = first chunk with text - sent; E2EL = last byte - sent; TPOT = (E2EL
- TTFT) / (output tokens - 1); ITL = gaps between chunks with text; token counts from `usage`;
goodput = requests meeting every --goodput SLO per second. Output: <out>/bench_serve.json, .md
and .png (TTFT and TPOT against rate). Warm-up (untimed, per target): by default the whole
workload at once, so a lazily compiling server compiles there (and a prefix cache holds every
prompt for the timed runs: turn it off on the server to measure cold prompts)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
from pathlib import Path

from jaxbatch.benchmarks.base import Benchmark, add_flags
from jaxbatch.benchmarks.report import cost_cell, fmt, pyplot, save_png, table, trio
from jaxbatch.benchmarks.serve_client import normalize_base, run_load, warm_up
from jaxbatch.benchmarks.workloads import add_workload_flags, serve_workload


def rate_label(rate: float, conc) -> str:
    return f"{rate:g}" + (f" (c={conc})" if conc else "")       # inf is "inf"


def markdown(report: dict, notes=()) -> str:
    """The table, then `notes` (a subclass's lines) and any server's error (the base adds the
    price)."""
    price = report.get("price") or {}
    goodput = any("goodput" in r["summary"] for r in report["runs"])
    rows = []
    for run in report["runs"]:
        s, h = run["summary"], run["summary"]["health"]
        health = "/".join(fmt(h[k], 1) for k in ("p50_ms", "p99_ms", "max_ms")) + (
            f" ({h['non_200']} non-200)" if h["non_200"] else "")
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
    return "\n".join([table(head, rows), *notes] + [
        f"\n{name}: {info['error']}" for name, info in report.get("servers", {}).items()
        if info.get("error")])


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rates = sorted({r["summary"]["request_rate"] for r in report["runs"]})
    inf_x = 1.5 * max([r for r in rates if not math.isinf(r)], default=2 / 3)
    xpos = lambda r: inf_x if math.isinf(r) else r      # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = {}
    for run in report["runs"]:
        s = run["summary"]
        lines.setdefault(run["target"] + (f" c={s['max_concurrency']}" if s["max_concurrency"]
                                          else ""), []).append(s)
    for i, (key, rows) in enumerate(sorted(lines.items())):
        rows.sort(key=lambda s: xpos(s["request_rate"]))
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for stat, style in (("median", "o-"), ("p99", "x--")):
                ax.plot([xpos(s["request_rate"]) for s in rows],
                        [s[metric][f"{stat}_ms"] for s in rows], style, color=f"C{i}",
                        alpha=1.0 if stat == "median" else 0.6, label=f"{key} {stat}")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set(xlabel="request rate (req/s)", ylabel=name, xticks=[xpos(r) for r in rates],
               xticklabels=[rate_label(r, None) for r in rates])
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{report['args']['num_prompts']} requests, {report['args']['api']} streaming")
    return save_png(fig, path)


def goodput_slo(item: str) -> tuple[str, float]:
    """One --goodput value, KEY:MS."""
    key, _, ms = item.partition(":")
    with contextlib.suppress(ValueError):
        if key in ("ttft", "tpot", "e2el"):
            return key, float(ms)
    raise argparse.ArgumentTypeError(f"{item!r}: use ttft:MS, tpot:MS or e2el:MS")


def bench_target(name, base, args, workload, report, between=None):
    """Warm-up, then every (rate, concurrency) run against one server, --rounds times;
    `between()` after each round (the interleaved offline pass)."""
    print(f"[{name}] warm-up: {args.warmup}", flush=True)
    options = dict(api=args.api, model=args.model, max_tokens_field=args.max_tokens_field,
                   extra_body=args.extra_body, api_key=args.api_key)
    report["servers"].setdefault(name, {})["warmup"] = asyncio.run(
        warm_up(base, workload, args.warmup, args.num_warmups, **options))
    for round_ in range(args.rounds):
        for conc, rate in itertools.product(args.max_concurrency, args.request_rate):
            label = f"[{name}] rate {rate_label(rate, conc)}"
            print(f"{label} ...", flush=True)
            out = asyncio.run(run_load(base, workload, rate=rate, max_concurrency=conc,
                                       goodput=args.goodput, **options,
                                       health_interval=args.health_interval or None))
            s = out["summary"]
            errors = f"; errors: {s['errors']}" if s["failed"] else ""
            print(f"{label}: {s['completed']}/{s['num_requests']} done, "
                  f"{fmt(s['output_tokens_per_s'])} out tok/s, TTFT median "
                  f"{fmt(s['ttft']['median_ms'], 0)} ms, TPOT median "
                  f"{fmt(s['tpot']['median_ms'], 0)} ms, /health p99 "
                  f"{fmt(s['health']['p99_ms'])} ms{errors}", flush=True)
            report["runs"].append({"target": name, "base_url": base, "round": round_, **out})
        if between is not None:
            between()


class Serve(Benchmark):
    """The servers given with --target; a subclass (the lab's serve-launch) may start its own
    (`servers`), run something after each round (`between`) and add report lines (`notes`)."""
    name, model_free, out = "serve", True, "bench_out/serve"
    need_target = True

    def add_arguments(self, ap) -> None:
        ap.add_argument("--target", action="append", default=[], metavar="NAME=BASE_URL",
                        help="a running server, e.g. vllm=http://127.0.0.1:8100 (repeatable)")
        ap.add_argument("--request-rate", nargs="+", type=float, default=[math.inf],
                        help="Poisson arrival rates (req/s); inf sends everything at t=0")
        ap.add_argument("--max-concurrency", nargs="+", type=int, default=[None],
                        help="cap on requests in flight (one run per value)")
        ap.add_argument("--api", choices=("chat", "completions"), default="chat")
        ap.add_argument("--model", default=None, help="model name in requests (default: /v1/models)")
        add_workload_flags(ap)
        ap.add_argument("--goodput", nargs="+", type=goodput_slo, default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:2000 tpot:500 (also e2el:MS)")
        ap.add_argument("--warmup", choices=("none", "requests", "workload"), default="workload",
                        help="untimed, per target, before its runs: nothing, --num-warmups "
                             "requests, or the whole workload at once (default)")
        ap.add_argument("--max-tokens-field", default=None,
                        help="request field for the output length (default: chat "
                             "max_completion_tokens, completions max_tokens)")
        ap.add_argument("--extra-body", type=json.loads, default="{}",
                        help="JSON merged into every request body")
        ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
        add_flags(ap, num_warmups=2, rounds=(1, "repeat each target's runs"), health_interval=(
            0.1, "seconds between /health polls during a timed run (0: off)"))

    def check(self, args):
        if args.rounds < 1:
            return "--rounds: at least 1"
        if self.need_target and not args.target:
            return "give at least one --target NAME=BASE_URL"
        bad = [t for t in args.target if not all(t.partition("=")[1:])]
        return f"--target {bad[0]!r}: use NAME=BASE_URL" if bad else None

    def servers(self, args, report):
        """(name, base URL) of each server this benchmark starts itself, stopped after."""
        return ()

    def between(self, args, workload) -> None:
        """After every round of every server."""

    def notes(self, args, report, workload) -> list[str]:
        return []

    def bench(self, _, args) -> dict:
        args.goodput = dict(args.goodput) if args.goodput else None
        workload = serve_workload(args)
        # The price defaults to the client's machine: a server elsewhere needs --price-per-hour.
        report = {"workload": [dataclasses.asdict(r) for r in workload], "servers": {}, "runs": []}
        given = [(t.partition("=")[0], normalize_base(t.partition("=")[2])) for t in args.target]
        for name, base in itertools.chain(given, self.servers(args, report)):
            bench_target(name, base, args, workload, report, lambda: self.between(args, workload))
        report["notes"] = self.notes(args, report, workload)
        return report

    def plots(self, report, out_dir):
        name = plot(report, out_dir / "bench_serve.png") if report["runs"] else None
        return [name] if name else []

    def markdown(self, report) -> str:
        return markdown(report, report["notes"])


main = Serve().main
