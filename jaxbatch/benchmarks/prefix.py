"""Prefix caching, on vs off in one run, warm, on the embedded model (`jaxbatch bench
throughput --workloads prefix` runs this too):

  shared_system  chat requests arriving at --prefix-rate (Poisson), all with one long system
                 prompt (benchmarks/data/system_prompt.txt, ~850 tokens) and their own question
  multi_turn     conversations whose every turn resends the whole history (system prompt,
                 earlier questions and the model's own answers) plus a new question
  no_sharing     the bundled prompts, each once, at t=0: hashing is all the cache adds here

Both engines share one runner (the same executables and KV pool), are warmed on every bucket,
and each run starts from an empty cache, so a hit is only ever one request helping a later one.
On/off runs alternate --repeats times and each figure is the median (this machine is shared).
Every request is greedy, so the outputs must also be equal: any difference is reported.

    jaxbatch bench prefix [--repeats 2] [--out bench_out] [--price-per-hour USD]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxbatch.benchmarks.harness import run_jaxbatch, run_on_embedded_model, summarize
from jaxbatch.benchmarks.machine import add_price_argument
from jaxbatch.benchmarks.report import cost_cell, price_line, stats_ms, table
from jaxbatch.benchmarks.workloads import (DEFAULT_PROMPTS, SYSTEM_PROMPT, Request, chat_ids,
                                           encode_prompts, lognormal_lengths, load_prompts)

FOLLOW_UPS = ["Can you say that in fewer words?", "What would you pick for a beginner?",
              "And if the weather turns bad?", "How much would that cost roughly?",
              "Is there anything I should avoid?"]


def shared_system_requests(tokenizer, questions, n, rate, output_len, seed) -> list[Request]:
    system = SYSTEM_PROMPT.read_text()
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    picks = rng.integers(0, len(questions), n)
    return [Request(f"sys-{i}", chat_ids(tokenizer, [{"role": "system", "content": system},
                                                     {"role": "user", "content": questions[p]}]),
                    output_len, float(arrivals[i]), "shared_system")
            for i, p in enumerate(picks)]


def run_single(engine, requests, label) -> dict:
    before = engine.stats()
    run = run_jaxbatch(engine, requests, label, progress=False)
    after = engine.stats()
    return {"summary": summarize(run), **hit_rate(before, after),
            "compilations": run.info["compilations_during_timed_run"]}


def hit_rate(before, after) -> dict:
    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    h = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else 0.0}


def run_multi_turn(engine, tokenizer, questions, conversations, turns, output_len) -> dict:
    """Turn t of every conversation is sent at once when turn t - 1 has been answered; a
    turn's answer (the model's own text) joins the history the next turn resends."""
    from jaxbatch import SamplingParams
    system = SYSTEM_PROMPT.read_text()
    histories = [[{"role": "system", "content": system},
                  {"role": "user", "content": questions[i % len(questions)]}]
                 for i in range(conversations)]
    before, ttfts, texts, out_tokens, prompt_tokens = engine.stats(), [], [], 0, 0
    start = time.monotonic()
    for turn in range(turns):
        sent = time.monotonic()
        first: dict[str, float] = {}
        ids = {}
        for c, history in enumerate(histories):
            ids[f"t{turn}-c{c}"] = chat_ids(tokenizer, history)
            prompt_tokens += len(ids[f"t{turn}-c{c}"])
            engine.add_request(f"t{turn}-c{c}", ids[f"t{turn}-c{c}"],
                               SamplingParams(temperature=0, max_tokens=output_len))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.monotonic()
                if out.finished:
                    finals[out.request_id] = out
        ttfts += [first[r] - sent for r in finals]
        for c, history in enumerate(histories):
            out = finals[f"t{turn}-c{c}"].outputs[0]
            out_tokens += len(out.token_ids)
            texts.append(out.token_ids)
            history += [{"role": "assistant", "content": out.text},
                        {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    duration = time.monotonic() - start
    return {"summary": {"duration_s": duration, "output_tokens": out_tokens,
                        "input_tokens": prompt_tokens, "output_tokens_per_s": out_tokens / duration,
                        "ttft": stats_ms(ttfts)},
            **hit_rate(before, engine.stats()), "tokens": texts}


def build_engines(loaded, slots, max_model_len, chunk, warmup=True):
    from jaxbatch.engine.llm_engine import LLMEngine
    on = LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=max_model_len,
                   prefill_chunk_size=chunk, enable_prefix_caching=True, warmup=warmup)
    off = LLMEngine(loaded=loaded, runner=on.runner, max_num_seqs=slots,
                    max_model_len=max_model_len, prefill_chunk_size=chunk,
                    enable_prefix_caching=False)
    return on, off


def alternate(engines, repeats, run) -> dict:
    """`run(engine, label)` for on/off alternately, `repeats` times; the median figures."""
    results = {"on": [], "off": []}
    for i in range(repeats):
        for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
            engines[name].reset_prefix_cache()
            results[name].append(run(engines[name], f"{name} #{i}"))
    return {name: median_of(runs) for name, runs in results.items()}


def median_of(runs) -> dict:
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    s = runs[0]
    return {"runs": len(runs), "hit_rate": s["hit_rate"], "hit_tokens": s["hit_tokens"],
            "queried_tokens": s["queried_tokens"],
            "output_tokens_per_s": med(lambda r: r["summary"]["output_tokens_per_s"]),
            "duration_s": med(lambda r: r["summary"]["duration_s"]),
            "ttft_mean_ms": med(lambda r: r["summary"]["ttft"]["mean_ms"]),
            "ttft_median_ms": med(lambda r: r["summary"]["ttft"]["median_ms"]),
            "compilations": sum(r.get("compilations", 0) for r in runs),
            "tokens": runs[0].get("tokens")}


def bench_prefix(loaded, args) -> dict:
    tokenizer = loaded.tokenizer
    entries = load_prompts(args.prompts)
    questions = [e["text"] for e in entries if e["kind"] == "short"]
    on, off = build_engines(loaded, args.slots, args.max_model_len, args.chunk,
                            getattr(args, "warmup", True) is not False)
    engines = {"on": on, "off": off}
    report = {"settings": {"slots": args.slots, "max_model_len": args.max_model_len,
                           "prefill_chunk_size": on.config.prefill_chunk_size,
                           "repeats": args.repeats, "rate": args.prefix_rate},
              "warmup_seconds": on.warmup_seconds}

    shared = shared_system_requests(tokenizer, questions, args.prefix_requests, args.prefix_rate,
                                    args.output_len, args.seed)
    report["shared_system"] = alternate(engines, args.repeats,
                                        lambda e, label: run_single(e, shared, label))
    report["shared_system"]["prompt_tokens_mean"] = float(np.mean([len(r.prompt_ids) for r in shared]))

    report["multi_turn"] = alternate(engines, args.repeats, lambda e, label: run_multi_turn(
        e, tokenizer, questions, args.conversations, args.turns, args.output_len))
    mt = report["multi_turn"]
    mt["outputs_equal"] = mt["on"].pop("tokens") == mt["off"].pop("tokens")

    prompts = encode_prompts(entries, tokenizer)
    rng = np.random.default_rng(args.seed)
    outs = lognormal_lengths(rng, len(prompts), 24, 1.0, 4, 96)
    distinct = [Request(f"u-{i}", p, outs[i], 0.0, e["kind"])
                for i, (p, e) in enumerate(zip(prompts, entries))][:args.distinct_requests]
    report["no_sharing"] = alternate(engines, args.repeats,
                                     lambda e, label: run_single(e, distinct, label))
    return report


def markdown(report, price: dict | None = None) -> str:
    price = price or report.get("price") or {}
    rows = []
    for w in ("shared_system", "multi_turn", "no_sharing"):
        for name in ("off", "on"):
            r = report[w][name]
            rows.append([w, name, f"{r['ttft_mean_ms']:.0f}", f"{r['ttft_median_ms']:.0f}",
                         f"{r['output_tokens_per_s']:.1f}",
                         cost_cell(r["output_tokens_per_s"], price), f"{r['hit_rate']:.2f}"])
        on, off = report[w]["on"], report[w]["off"]
        rows.append([w, "on/off", f"{on['ttft_mean_ms'] / off['ttft_mean_ms']:.2f}",
                     f"{on['ttft_median_ms'] / off['ttft_median_ms']:.2f}",
                     f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}", "", ""])
    return table(["workload", "cache", "TTFT mean ms", "TTFT median ms", "output tok/s",
                  "$ / M out tok", "hit rate"], rows)


def add_arguments(ap) -> None:
    ap.add_argument("--prefix-requests", type=int, default=24)
    ap.add_argument("--prefix-rate", type=float, default=1.0, help="shared_system arrivals/s")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--distinct-requests", type=int, default=None,
                    help="no_sharing: the first N bundled prompts (default all)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (engine default)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="jaxbatch bench prefix",
                                 description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out")
    add_price_argument(ap)
    args = ap.parse_args(argv)
    report = run_on_embedded_model(bench_prefix, args, "bench_prefix.json")
    print(markdown(report))
    print(price_line(report["price"]))
    print(f"multi_turn outputs equal on/off: {report['multi_turn']['outputs_equal']}")
    return report


if __name__ == "__main__":
    main()
