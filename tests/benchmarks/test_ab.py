"""The feature A/Bs' base (jaxbatch/benchmarks/ab.py) without an engine: variants take turns in
an order rotated each round, a figure is the median over rounds, ratios are against the named
baseline, and outputs are compared across every run when they must not change."""
from __future__ import annotations

import pytest

from jaxbatch.benchmarks import ab


def test_rounds_rotate_the_order_so_no_variant_always_goes_first():
    order = []
    runs = ab.interleave(["a", "b", "c"], 4, lambda v, r: order.append((r, v)) or r)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    assert runs == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1, 2, 3]}


def test_a_median_run_takes_each_figure_apart_and_keeps_the_rest():
    runs = [{"tok_s": 10.0, "ttft": {"mean_ms": 5.0}, "acceptance": None, "tokens": [[1]]},
            {"tok_s": 30.0, "ttft": {"mean_ms": 1.0}, "acceptance": 0.5, "tokens": [[2]]},
            {"tok_s": 20.0, "ttft": {"mean_ms": 3.0}, "acceptance": 0.7, "tokens": [[3]]}]
    assert ab.median_run(runs) == {"tok_s": 20.0, "ttft": {"mean_ms": 3.0}, "acceptance": None,
                                   "tokens": [[1]]}


def test_compare_states_medians_ratios_against_the_base_and_whether_outputs_agree():
    figures = {"off": iter([10.0, 14.0, 12.0]), "on": iter([30.0, 33.0, 36.0])}
    entry = ab.compare(["on", "off"], 3, lambda v, _: {"output_tokens_per_s": next(figures[v]),
                                                       "tokens": [[7, 8]]},
                       same_outputs=True, base="off")
    assert entry["off"] == {"output_tokens_per_s": 12.0}
    assert entry["on"] == {"output_tokens_per_s": 33.0}
    assert entry["ratio"]["on"]["output_tokens_per_s"] == pytest.approx(33.0 / 12.0)
    assert entry["ratio"]["off"]["output_tokens_per_s"] == 1.0
    assert entry["outputs_equal"] is True
    tokens = iter([[[1]], [[1]], [[2]], [[1]]])
    differ = ab.compare(["on", "off"], 2, lambda v, _: {"output_tokens_per_s": 1.0,
                                                        "tokens": next(tokens)}, same_outputs=True)
    assert differ["outputs_equal"] is False


def test_the_full_decode_step_is_the_median_of_steps_where_every_row_decoded():
    # (seconds, sequences, tokens): a prefill step, full decode steps, a thinner tail
    steps = [(0.9, 4, 40), (0.010, 4, 4), (0.030, 4, 4), (0.020, 4, 4), (0.005, 2, 2)]
    assert ab.full_decode_step_ms(steps, 4) == pytest.approx(20.0)
    assert ab.full_decode_step_ms(steps, 8) is None
