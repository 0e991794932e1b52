"""The feature A/Bs' base (`jaxbatch bench prefix | spec | structured | lora | quant`): variants
of one engine option run the same cases in turns, round by round, each round's order rotated by
one, so a slow moment of a shared machine hits every variant alike; each figure is the median
over rounds, stated beside the first variant's (the baseline) as a ratio. `drive` is the
measurement most share: requests run to the end on one engine."""
from __future__ import annotations

import itertools
import statistics
import time
from collections import deque

from jaxbatch.benchmarks.base import Benchmark
from jaxbatch.benchmarks.report import cost_cell, stats_ms

_RUN_IDS = itertools.count()


def drive(engine, requests, concurrency: int | None = None) -> dict:
    """Runs `requests`, each (prompt ids, SamplingParams[, add_request keywords]), to the end,
    with at most `concurrency` in flight (None: all at once): wall time, output tokens/s, TTFT
    and TPOT, each computing step as (seconds, sequences, tokens), every request's tokens and
    text, and how much each numeric engine stat moved."""
    run, before, pending = next(_RUN_IDS), engine.stats(), deque(enumerate(requests))
    sent, times, finals, steps = {}, {}, {}, []
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        while pending and (concurrency is None
                           or engine.get_num_unfinished_requests() < concurrency):
            i, (prompt, params, *kw) = pending.popleft()
            sent[i], times[i] = time.monotonic(), []
            engine.add_request(f"ab{run}-{i}", prompt, params, **(kw[0] if kw else {}))
        logged, began = len(engine.step_log), time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        for _, seqs, _, tokens in engine.step_log[logged:]:
            steps.append((now - began, seqs, tokens))
        for out in outputs:
            i = int(out.request_id.rsplit("-", 1)[1])
            times[i] += [now] * (len(out.outputs[0].token_ids) - len(times[i]))
            if out.finished:
                finals[i] = out.outputs[0]
    duration, after = time.monotonic() - start, engine.stats()
    tokens = [list(finals[i].token_ids) for i in range(len(requests))]
    return {"duration_s": duration, "output_tokens": sum(map(len, tokens)),
            "output_tokens_per_s": sum(map(len, tokens)) / duration,
            "ttft": stats_ms([t[0] - sent[i] for i, t in times.items() if t]),
            "tpot": stats_ms([(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]),
            "steps": steps, "tokens": tokens, "texts": [finals[i].text for i in range(len(requests))],
            "stats": {k: v - before[k] for k, v in after.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and isinstance(before.get(k), (int, float))}}


def full_decode_step_ms(steps, rows: int) -> float | None:
    """Median step of `drive`'s steps in which all `rows` sequences decoded (one token each)."""
    full = [s for s, seqs, tokens in steps if seqs == tokens == rows]
    return 1e3 * statistics.median(full) if full else None


def interleave(variants, rounds: int, measure) -> dict[str, list]:
    """`measure(variant, round)` for every variant, `rounds` times, round r starting at
    variant r mod len(variants); {variant: [its runs in round order]}."""
    variants, runs = list(variants), {v: [] for v in variants}
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            runs[v].append(measure(v, r))
    return runs


def median_run(runs: list[dict]) -> dict:
    """One run of figures: each number the median over `runs` (nested dicts alike), anything
    else as the first run has it."""
    out = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        numbers = isinstance(first, (int, float)) and not isinstance(first, bool)
        out[key] = (median_run(values) if isinstance(first, dict) else
                    statistics.median(values) if numbers and None not in values else first)
    return out


def compare(variants, rounds: int, measure, same_outputs: bool = False,
            keep=("output_tokens_per_s",), base=None) -> dict:
    """`interleave`d runs summed up: {variant: its median run (without per-request lists),
    "ratio": {variant: {key: its / the `base` variant's (default: the first), for each key of
    `keep`}}}; with `same_outputs`, "outputs_equal": whether every run of every variant gave
    the same tokens (greedy options that must not change the text: prefix caching, speculation)."""
    runs = interleave(variants, rounds, measure)
    entry = {v: {k: x for k, x in median_run(rs).items() if not isinstance(x, list)}
             for v, rs in runs.items()}
    base = entry[next(iter(runs)) if base is None else base]
    entry["ratio"] = {v: {k: (entry[v][k] / base[k] if base.get(k) else None) for k in keep}
                      for v in runs}
    if same_outputs:
        tokens = [r["tokens"] for rs in runs.values() for r in rs]
        entry["outputs_equal"] = all(t == tokens[0] for t in tokens)
    return entry


def tok_s_cells(tok_s, price: dict) -> list[str]:
    """The two table cells every A/B states per variant: output tokens/s and its cost."""
    return [f"{tok_s:.1f}", cost_cell(tok_s, price)]


class ABBenchmark(Benchmark):
    """A feature A/B: the base's flags and report, and --rounds (alias --repeats)."""
    rounds = 2          # --rounds' default

    def parser(self):
        ap = super().parser()
        ap.add_argument("--rounds", "--repeats", type=int, default=self.rounds,
                        help="variants take turns this many times; figures are medians")
        ap.add_argument("--seed", type=int, default=0)
        return ap

    def check(self, args):
        return "--rounds: at least 1" if args.rounds < 1 else None
