"""Prefix caching, on vs off, on one runner warmed on every bucket (the embedded model):
shared_system (Poisson arrivals at --prefix-rate sharing one ~850-token system prompt),
multi_turn (every turn resends the conversation) and no_sharing (the bundled prompts once, at
t=0: hashing is all the cache adds). Each run starts from an empty cache; on and off take turns
--repeats times, medians reported; greedy outputs must be equal (reported)."""
from __future__ import annotations

import argparse

import numpy as np

from jaxbatch.benchmarks.ab import ABBenchmark, compare, tok_s_cells
from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.harness import drive, run_jaxbatch, summarize
from jaxbatch.benchmarks.report import fmt, table
from jaxbatch.benchmarks.workloads import (DEFAULT_PROMPTS, SYSTEM_PROMPT, Request, chat_ids,
                                           encode_prompts, lognormal_lengths, load_prompts,
                                           poisson_arrivals)

FOLLOW_UPS = ["Can you say that in fewer words?", "What would you pick for a beginner?",
              "And if the weather turns bad?", "How much would that cost roughly?",
              "Is there anything I should avoid?"]
WORKLOADS = ("shared_system", "multi_turn", "no_sharing")
RATIOS = ("ttft_mean_ms", "ttft_median_ms", "output_tokens_per_s")     # on / off, per workload


def shared_system_requests(tokenizer, questions, n, rate, output_len, seed) -> list[Request]:
    system, rng = SYSTEM_PROMPT.read_text(), np.random.default_rng(seed)
    arrivals, picks = poisson_arrivals(rng, n, rate), rng.integers(0, len(questions), n)
    return [Request(f"sys-{i}", chat_ids(tokenizer, [{"role": "system", "content": system},
                                                     {"role": "user", "content": questions[p]}]),
                    output_len, float(arrivals[i]), "shared_system")
            for i, p in enumerate(picks)]


def arrivals_run(engine, requests) -> dict:
    """The requests at their arrival times (harness.py); TTFT counts from the arrival."""
    run = run_jaxbatch(engine, requests, "prefix", progress=False)
    s = summarize(run)
    return {"output_tokens_per_s": s["output_tokens_per_s"], "duration_s": s["duration_s"],
            "ttft_mean_ms": s["ttft"]["mean_ms"], "ttft_median_ms": s["ttft"]["median_ms"],
            "compilations": run.info["compilations_during_timed_run"]}


def multi_turn_run(engine, tokenizer, questions, conversations, turns, output_len) -> dict:
    """Turn t of every conversation is sent at once when turn t - 1 has been answered; a
    turn's answer (the model's own text) joins the history the next turn resends."""
    from jaxbatch import SamplingParams
    histories = [[{"role": "system", "content": SYSTEM_PROMPT.read_text()},
                  {"role": "user", "content": questions[i % len(questions)]}]
                 for i in range(conversations)]
    params, turns_run = SamplingParams(temperature=0, max_tokens=output_len), []
    for turn in range(turns):
        turns_run.append(run := drive(engine, [(chat_ids(tokenizer, h), params)
                                               for h in histories]))
        for history, text in zip(histories, run["texts"]):
            history += [{"role": "assistant", "content": text},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    duration, ttft = sum(r["duration_s"] for r in turns_run), [r["ttft"] for r in turns_run]
    return {"output_tokens_per_s": sum(r["output_tokens"] for r in turns_run) / duration,
            "duration_s": duration, "ttft_mean_ms": float(np.mean([t["mean_ms"] for t in ttft])),
            "ttft_median_ms": float(np.median([t["median_ms"] for t in ttft])),
            "compilations": sum(r["stats"]["num_compilations"] for r in turns_run),
            "tokens": [t for r in turns_run for t in r["tokens"]]}


class Prefix(ABBenchmark):
    name = "prefix"

    def add_arguments(self, ap) -> None:
        add_flags(ap, prefix_requests=24, prefix_rate=(1.0, "shared_system arrivals/s"),
                  conversations=8, turns=4, output_len=32, slots=16, max_model_len=2048,
                  prompts=str(DEFAULT_PROMPTS))
        ap.add_argument("--distinct-requests", type=int, default=None,
                        help="no_sharing: the first N bundled prompts (default all)")
        ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (engine default)")
        ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every bucket first (--no-warmup: a quick smoke run)")

    def bench(self, loaded, args) -> dict:
        from jaxbatch import LLMEngine
        tokenizer, entries = loaded.tokenizer, load_prompts(args.prompts)
        questions = [e["text"] for e in entries if e["kind"] == "short"]
        common = dict(loaded=loaded, max_num_seqs=args.slots, max_model_len=args.max_model_len,
                      prefill_chunk_size=args.chunk)
        on = LLMEngine(**common, enable_prefix_caching=True, warmup=args.warmup)
        engines = {"on": on, "off": LLMEngine(**common, runner=on.runner,
                                              enable_prefix_caching=False)}
        shared = shared_system_requests(tokenizer, questions, args.prefix_requests,
                                        args.prefix_rate, args.output_len, args.seed)
        outs = lognormal_lengths(np.random.default_rng(args.seed), len(entries), 24, 1.0, 4, 96)
        distinct = [Request(f"u-{i}", p, outs[i], 0.0, e["kind"]) for i, (p, e) in
                    enumerate(zip(encode_prompts(entries, tokenizer), entries))]
        runs = {"shared_system": lambda e: arrivals_run(e, shared),
                "multi_turn": lambda e: multi_turn_run(e, tokenizer, questions, args.conversations,
                                                       args.turns, args.output_len),
                "no_sharing": lambda e: arrivals_run(e, distinct[:args.distinct_requests])}

        def measure(workload, name):
            engine = engines[name]
            engine.reset_prefix_cache()
            before = engine.stats()
            figures, after = runs[workload](engine), engine.stats()
            queried, hits = (after[k] - before[k] for k in ("prefix_cache_queries",
                                                            "prefix_cache_hits"))
            return {**figures, "queried_tokens": queried, "hit_tokens": hits,
                    "hit_rate": hits / queried if queried else 0.0}
        report = {"settings": {"prefill_chunk_size": on.config.prefill_chunk_size},
                  "warmup_seconds": on.warmup_seconds}
        for w in WORKLOADS:
            report[w] = compare(engines, args.rounds, lambda name, _, w=w: measure(w, name),
                                same_outputs=w == "multi_turn", base="off", keep=RATIOS)
        report["shared_system"]["prompt_tokens_mean"] = float(np.mean(
            [len(r.prompt_ids) for r in shared]))
        return report

    def markdown(self, report) -> str:
        price, rows = report["price"], []
        for w in WORKLOADS:
            for name in ("off", "on"):
                r = report[w][name]
                rows.append([w, name, f"{r['ttft_mean_ms']:.0f}", f"{r['ttft_median_ms']:.0f}",
                             *tok_s_cells(r["output_tokens_per_s"], price), f"{r['hit_rate']:.2f}"])
            ratio = report[w]["ratio"]["on"]
            rows.append([w, "on/off", *(fmt(ratio[k], 2) for k in RATIOS), "", ""])
        return (table(["workload", "cache", "TTFT mean ms", "TTFT median ms", "output tok/s",
                       "$ / M out tok", "hit rate"], rows)
                + f"\n\nmulti_turn outputs equal on/off: {report['multi_turn']['outputs_equal']}")


main = Prefix().main
