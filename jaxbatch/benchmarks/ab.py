"""The feature A/Bs' base (`jaxbatch bench prefix | spec | structured | lora | quant`): variants
of one engine option run the same cases in turns, round by round, each round's order rotated by
one, so a slow moment of a shared machine hits every variant alike; each figure is the median
over rounds, stated beside the first variant's (the baseline) as a ratio."""
from __future__ import annotations

import statistics

from jaxbatch.benchmarks.base import Benchmark
from jaxbatch.benchmarks.report import cost_cell


def full_decode_step_ms(steps, rows: int) -> float | None:
    """Median of harness.drive's steps in which all `rows` sequences decoded (a token each)."""
    full = [s for s, seqs, tokens in steps if seqs == tokens == rows]
    return 1e3 * statistics.median(full) if full else None


def interleave(variants, rounds: int, measure) -> dict[str, list]:
    """{variant: [`measure(variant, round)` for each round]}, round r starting at variant r."""
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
    """`interleave`d runs summed up: {variant: its median run less per-request lists, "ratio":
    {variant: {k: its / the `base` (default: the first) variant's, for k in `keep`}}}; with
    `same_outputs`, "outputs_equal": whether every run gave the same tokens (for greedy options
    that must not change the text: prefix caching, speculation)."""
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
