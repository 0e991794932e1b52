"""Speculative decoding (n-gram prompt lookup), on vs off in one run, warm, on the embedded model:
output tokens/s and TPOT at 1, 4 and 16 concurrent requests (a closed loop: each finished
request is replaced at once) on two workloads:

  repetitive  "correct this paragraph" requests over paragraphs of benchmarks/data/system_prompt.txt
              with a few typos: the answer mostly copies the prompt, as edits and summaries do
  default     the bundled prompts (benchmarks/data/bench_prompts.json), chat template applied

Both engines share one runner; on/off alternate --repeats times, medians reported; the greedy
tokens of every request must be equal with speculation on and off (checked, reported). What one
more row costs a decode step, which sets `max_batch_size`, is in `jaxbatch bench throughput`'s
report (`decode_step_ms_by_rows`).

    jaxbatch bench spec [--repeats 2] [--k 3] [--out bench_out] [--price-per-hour USD]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxbatch.benchmarks.harness import run_on_embedded_model
from jaxbatch.benchmarks.machine import add_price_argument
from jaxbatch.benchmarks.report import cost_cell, price_line, stats_ms, table
from jaxbatch.benchmarks.workloads import (DEFAULT_PROMPTS, SYSTEM_PROMPT, chat_ids,
                                           lognormal_lengths, load_prompts)

TYPOS = [("the ", "teh "), ("and ", "adn "), ("with ", "wiht "), ("for ", "fro ")]


def repetitive_prompts(tokenizer) -> list[list[int]]:
    paragraphs = [p for p in SYSTEM_PROMPT.read_text().split("\n\n") if len(p) > 300]
    prompts = []
    for text in paragraphs:
        for good, bad in TYPOS:
            text = text.replace(good, bad, 1)
        prompts.append(chat_ids(tokenizer, [{"role": "user", "content":
                       "Correct the spelling mistakes in this paragraph and return the whole "
                       f"paragraph, nothing else:\n\n{text}"}]))
    return prompts


def closed_loop(engine, prompts, output_lens, concurrency) -> dict:
    """Keeps `concurrency` requests in flight until all are done; greedy, ignore_eos."""
    from jaxbatch import SamplingParams
    engine.reset_prefix_cache()
    before = engine.stats()
    queue = list(range(len(prompts)))
    times: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    start = time.monotonic()
    while queue or engine.has_unfinished_requests():
        while queue and engine.get_num_unfinished_requests() < concurrency:
            i = queue.pop(0)
            times[i] = []
            engine.add_request(str(i), prompts[i], SamplingParams(
                temperature=0, max_tokens=output_lens[i], ignore_eos=True))
        for out in engine.step():
            i, now = int(out.request_id), time.monotonic()
            times[i] += [now] * (len(out.outputs[0].token_ids) - len(times[i]))
            if out.finished:
                tokens[i] = out.outputs[0].token_ids
    duration = time.monotonic() - start
    after = engine.stats()
    out_tokens = sum(len(t) for t in tokens.values())
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    return {"output_tokens_per_s": out_tokens / duration, "duration_s": duration,
            "tpot": stats_ms(tpot), "steps": after["num_steps"] - before["num_steps"],
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "compilations_after_warmup": after["num_compilations_after_warmup"],
            "tokens": [tokens[i] for i in range(len(prompts))]}


def bench_spec(loaded, args) -> dict:
    from jaxbatch.engine.llm_engine import LLMEngine
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "max_batch_size": args.max_batch_size}
    on = LLMEngine(loaded=loaded, max_num_seqs=16, max_model_len=2048, speculative_config=spec)
    off = LLMEngine(loaded=loaded, runner=on.runner, max_num_seqs=16, max_model_len=2048)
    engines = {"on": on, "off": off}
    tokenizer = loaded.tokenizer
    entries = load_prompts(args.prompts)
    default = [chat_ids(tokenizer, [{"role": "user", "content": e["text"]}]) for e in entries]
    rng = np.random.default_rng(0)
    workloads = {
        "repetitive": (repetitive_prompts(tokenizer), None),
        "default": (default, lognormal_lengths(rng, len(default), 48, 0.7, 8, 160)),
    }
    report = {"speculative_config": spec, "repeats": args.repeats}
    for name, (prompts, lens) in workloads.items():
        for conc in args.concurrency:
            n = max(conc, args.requests_per_slot * conc)
            chosen = [prompts[i % len(prompts)] for i in range(n)]
            out_lens = [args.repetitive_output if lens is None else lens[i % len(lens)]
                        for i in range(n)]
            runs = {"on": [], "off": []}
            for r in range(args.repeats):
                for which in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    runs[which].append(closed_loop(engines[which], chosen, out_lens, conc))
            med = lambda w, f: statistics.median(f(x) for x in runs[w])  # noqa: E731
            entry = {w: {"output_tokens_per_s": med(w, lambda x: x["output_tokens_per_s"]),
                         "tpot_median_ms": med(w, lambda x: x["tpot"]["median_ms"]),
                         "steps": runs[w][0]["steps"], "acceptance": runs[w][0]["acceptance"],
                         "compilations_after_warmup": runs[w][-1]["compilations_after_warmup"]}
                     for w in runs}
            entry["speedup"] = entry["on"]["output_tokens_per_s"] / entry["off"]["output_tokens_per_s"]
            entry["outputs_equal"] = all(a["tokens"] == b["tokens"]
                                         for a, b in zip(runs["on"], runs["off"]))
            entry["requests"] = n
            report[f"{name}@{conc}"] = entry
            print(f"{name}@{conc}: {json.dumps({k: v for k, v in entry.items()}, default=str)}",
                  flush=True)
    return report


def markdown(report) -> str:
    price, rows = report.get("price") or {}, []
    for key, e in report.items():
        if "@" not in key:
            continue
        acc = e["on"]["acceptance"]
        off_tok, on_tok = e["off"]["output_tokens_per_s"], e["on"]["output_tokens_per_s"]
        rows.append([key, f"{off_tok:.1f}", f"{on_tok:.1f}", f"{e['speedup']:.2f}",
                     cost_cell(off_tok, price), cost_cell(on_tok, price),
                     f"{e['off']['tpot_median_ms']:.0f}", f"{e['on']['tpot_median_ms']:.0f}",
                     "-" if acc is None else f"{acc:.2f}",
                     f"{e['off']['steps']}/{e['on']['steps']}", e["outputs_equal"]])
    return table(["workload @ concurrency", "tok/s off", "tok/s on", "speedup",
                  "$ / M out tok off", "$ / M out tok on", "TPOT off ms", "TPOT on ms",
                  "acceptance", "steps off/on", "equal"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="jaxbatch bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--repetitive-output", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--out", default="bench_out")
    add_price_argument(ap)
    report = run_on_embedded_model(bench_spec, ap.parse_args(argv), "bench_spec.json")
    print(markdown(report))
    print(price_line(report["price"]))
    return report


if __name__ == "__main__":
    main()
