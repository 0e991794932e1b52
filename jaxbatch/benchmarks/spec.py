"""Speculative decoding (n-gram prompt lookup), on vs off on one runner (the embedded model):
output tokens/s and TPOT at 1, 4 and 16 concurrent requests (a closed loop) on `repetitive`
("correct this paragraph" prompts: the answer mostly copies) and `default` (the bundled
prompts). On and off take turns --repeats times, medians reported; greedy tokens must be equal
(reported). What a row costs a decode step is `bench throughput`'s `decode_step_ms_by_rows`."""
from __future__ import annotations

import numpy as np

from jaxbatch.benchmarks.ab import ABBenchmark, compare, tok_s_cells
from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.harness import drive
from jaxbatch.benchmarks.report import table
from jaxbatch.benchmarks.workloads import (DEFAULT_PROMPTS, SYSTEM_PROMPT, chat_ids,
                                           encode_prompts, lognormal_lengths, load_prompts)

TYPOS = [("the ", "teh "), ("and ", "adn "), ("with ", "wiht "), ("for ", "fro ")]


def repetitive_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for text in [p for p in SYSTEM_PROMPT.read_text().split("\n\n") if len(p) > 300]:
        for good, bad in TYPOS:
            text = text.replace(good, bad, 1)
        prompts.append(chat_ids(tokenizer, [{"role": "user", "content":
                       "Correct the spelling mistakes in this paragraph and return the whole "
                       f"paragraph, nothing else:\n\n{text}"}]))
    return prompts


def closed_loop(engine, requests, concurrency) -> dict:
    engine.reset_prefix_cache()
    run = drive(engine, requests, concurrency)
    drafted, accepted = (run["stats"][f"spec_num_{k}_tokens"] for k in ("draft", "accepted"))
    return {"output_tokens_per_s": run["output_tokens_per_s"],
            "tpot_median_ms": run["tpot"]["median_ms"], "steps": len(run["steps"]),
            "acceptance": accepted / drafted if drafted else None,
            "compilations": run["stats"]["num_compilations"], "tokens": run["tokens"]}


class Spec(ABBenchmark):
    name = "spec"

    def add_arguments(self, ap) -> None:
        add_flags(ap, k=(3, "num_speculative_tokens"), max_batch_size=4, requests_per_slot=2,
                  repetitive_output=96, prompts=str(DEFAULT_PROMPTS))
        ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])

    def bench(self, loaded, args) -> dict:
        from jaxbatch import LLMEngine, SamplingParams
        spec = {"method": "ngram", "num_speculative_tokens": args.k,
                "max_batch_size": args.max_batch_size}
        on = LLMEngine(loaded=loaded, max_num_seqs=16, max_model_len=2048, speculative_config=spec)
        engines = {"off": LLMEngine(loaded=loaded, runner=on.runner, max_num_seqs=16,
                                    max_model_len=2048), "on": on}
        default = encode_prompts(load_prompts(args.prompts), loaded.tokenizer)
        lens = lognormal_lengths(np.random.default_rng(args.seed), len(default), 48, 0.7, 8, 160)
        workloads = {"repetitive": (repetitive_prompts(loaded.tokenizer), [args.repetitive_output]),
                     "default": (default, lens)}
        report = {"speculative_config": spec}
        for name, (prompts, lens) in workloads.items():
            params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in lens]
            for conc in args.concurrency:
                n = max(conc, args.requests_per_slot * conc)
                requests = [(prompts[i % len(prompts)], params[i % len(params)]) for i in range(n)]
                entry = compare(engines, args.rounds, same_outputs=True,
                                measure=lambda v, _: closed_loop(engines[v], requests, conc))
                entry["speedup"] = entry["ratio"]["on"]["output_tokens_per_s"]
                report[f"{name}@{conc}"] = {**entry, "requests": n}
                print(f"{name}@{conc}: {entry['speedup']:.2f}x", flush=True)
        return report

    def markdown(self, report) -> str:
        price, rows = report["price"], []
        for key, e in ((k, e) for k, e in report.items() if "@" in k):
            off, on = e["off"], e["on"]
            rows.append([key, *tok_s_cells(off["output_tokens_per_s"], price),
                         *tok_s_cells(on["output_tokens_per_s"], price), f"{e['speedup']:.2f}",
                         f"{off['tpot_median_ms']:.0f}", f"{on['tpot_median_ms']:.0f}",
                         "-" if on["acceptance"] is None else f"{on['acceptance']:.2f}",
                         f"{off['steps']:.0f}/{on['steps']:.0f}", e["outputs_equal"]])
        return table(["workload @ concurrency", "tok/s off", "$ / M out tok off", "tok/s on",
                      "$ / M out tok on", "speedup", "TPOT off ms", "TPOT on ms", "acceptance",
                      "steps off/on", "equal"], rows)


main = Spec().main
