"""Structured outputs' cost in the continuous batch: `bench throughput`'s offline workload with
0 %, 50 % and 100 % of the requests constrained to a JSON schema, on one warmed engine, in
turns --rounds times: output tokens/s, steps, the grammar's host time per masked step, masks
filled while the forward ran. JSON requests stop where their schema ends: compare tokens/s."""
from __future__ import annotations

from jaxbatch.benchmarks import harness, workloads
from jaxbatch.benchmarks.ab import ABBenchmark, compare
from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.report import table

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


def run(engine, requests, fraction) -> dict:
    from jaxbatch import SamplingParams, StructuredOutputsParams
    n, n_json = len(requests), round(fraction * len(requests))
    schema = StructuredOutputsParams(json=SCHEMA)
    batch = []
    for k, r in enumerate(requests):
        if (k * n_json) // n != ((k + 1) * n_json) // n:    # spread evenly: both kinds share steps
            params = SamplingParams(temperature=0.0, max_tokens=max(r.output_len, 64),
                                    structured_outputs=schema)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        batch.append((r.prompt_ids, params))
    out = harness.drive(engine, batch)
    d = out["stats"]
    fills = d["structured_num_mask_fills"]
    return {"json_fraction": fraction, "json_requests": n_json,
            "output_tokens_per_s": out["output_tokens_per_s"], "steps": d["num_steps"],
            "mask_ms_per_fill": 1e3 * d["structured_mask_seconds"] / fills if fills else 0.0,
            "overlapped_fills": d["structured_num_overlapped_fills"], "mask_fills": fills,
            "compile_s": d["structured_compile_seconds"],
            "compilations_after_warmup": engine.stats()["num_compilations_after_warmup"]}


class Structured(ABBenchmark):
    name = "structured"
    rounds = 1

    def add_arguments(self, ap) -> None:
        ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
        add_flags(ap, num_requests=64, max_num_seqs=32, output_median=24.0, output_max=96,
                  max_prompt_len=512, dtype="auto")

    def bench(self, loaded, args) -> dict:
        entries = workloads.load_prompts()
        requests = workloads.offline_requests(
            workloads.encode_prompts(entries, loaded.tokenizer), [e["kind"] for e in entries],
            args.num_requests, (args.output_median, 1.0, 4, args.output_max), args.seed,
            args.max_prompt_len)
        engine = harness.warmed_engine(loaded, "continuous", args.max_num_seqs,
                                       harness.pow2_model_len(requests) + 128, requests, "buckets")
        run(engine, requests[:4], 1.0)                # builds the grammar tokenizer, untimed
        fractions = {f"{100 * f:.0f} %": f for f in args.fractions}
        return {"runs": compare(fractions, args.rounds,
                                lambda name, _: run(engine, requests, fractions[name]))}

    def markdown(self, report) -> str:
        return table(["JSON %", "output tok/s", "steps", "mask ms / fill", "overlapped fills",
                      "compilations after warm-up"],
                     [[name, f"{r['output_tokens_per_s']:.1f}", f"{r['steps']:.0f}",
                       f"{r['mask_ms_per_fill']:.3f}",
                       f"{r['overlapped_fills']:.0f}/{r['mask_fills']:.0f}",
                       r["compilations_after_warmup"]]
                      for name, r in report["runs"].items() if name != "ratio"])


main = Structured().main
