"""Structured outputs' cost in the continuous batch: the offline mixed workload of `bench throughput`
(same prompts, lognormal output lengths, greedy) with 0 %, 50 % and 100 % of the requests
constrained to a JSON schema, on one warmed engine (same executables for every run).

Reports per run: wall time, output tokens/s, steps, the grammar's host time per step that
carried a mask (advance + fill), and how many of those masks were filled while the forward ran
(host/device overlap). Free requests run to their length (ignore_eos, as `bench throughput`); JSON ones
stop where their schema ends, so compare tokens/s, not wall time.

    python -m jaxbatch bench structured --fractions 0 0.5 1 --num-requests 64 --max-num-seqs 32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from jaxbatch.benchmarks import harness, workloads

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


def run(engine, requests, fraction):
    from jaxbatch import SamplingParams, StructuredOutputsParams
    so = StructuredOutputsParams(json=SCHEMA)
    n_json = round(fraction * len(requests))
    before = engine.stats()
    engine.reset_prefix_cache()
    start = time.perf_counter()
    for k, r in enumerate(requests):
        # spread evenly, so both kinds share steps
        constrained = (k * n_json) // len(requests) != ((k + 1) * n_json) // len(requests)
        params = (SamplingParams(temperature=0.0, max_tokens=max(r.output_len, 64),
                                 structured_outputs=so) if constrained else
                  SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        engine.add_request(r.rid, r.prompt_ids, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("num_steps", "structured_mask_seconds",
                                           "structured_num_mask_fills",
                                           "structured_num_overlapped_fills",
                                           "structured_compile_seconds")}
    fills = d["structured_num_mask_fills"]
    return {"json_fraction": fraction, "requests": len(requests), "json_requests": n_json,
            "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "steps": d["num_steps"], "mask_ms_per_fill": 1e3 * d["structured_mask_seconds"] / fills
            if fills else 0.0, "overlapped_fills": d["structured_num_overlapped_fills"],
            "mask_fills": fills, "compile_s": d["structured_compile_seconds"],
            "compilations_after_warmup": after["num_compilations_after_warmup"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--output-median", type=float, default=24)
    ap.add_argument("--output-max", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from jaxbatch.model.loader import load_model
    loaded = load_model(dtype=args.dtype)
    entries = workloads.load_prompts()
    prompt_ids = workloads.encode_prompts(entries, loaded.tokenizer)
    requests = workloads.offline_requests(prompt_ids, [e["kind"] for e in entries], args.num_requests,
                                      (args.output_median, 1.0, 4, args.output_max), args.seed,
                                      args.max_prompt_len)
    engine = harness.jaxbatch_engine(loaded, "continuous", args.max_num_seqs,
                                   harness.pow2_model_len(requests) + 128)
    engine.warmup()
    run(engine, requests[:4], 1.0)                # builds the grammar tokenizer, untimed
    rows = []
    for f in args.fractions:
        rows.append(run(engine, [dataclasses.replace(r, rid=f"{f}-{r.rid}") for r in requests], f))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| JSON % | output tok/s | steps | mask ms / fill | overlapped fills | compilations after warm-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {100 * r['json_fraction']:.0f} | {r['output_tok_s']:.1f} | {r['steps']} | "
              f"{r['mask_ms_per_fill']:.3f} | {r['overlapped_fills']}/{r['mask_fills']} | "
              f"{r['compilations_after_warmup']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
