"""Smoke test of `jaxbatch bench prefix` (jaxbatch/benchmarks/prefix.py) on the embedded model with tiny settings: every
workload runs with the cache on and off, the shared system prompt and the resent histories hit,
distinct prompts do not, and the greedy outputs of multi-turn conversations are equal."""
from __future__ import annotations

import pytest

from jaxbatch.benchmarks.prefix import Prefix


def test_bench_prefix_tiny_run(embedded):
    bench = Prefix()
    args = bench.parser().parse_args([
        "--slots", "4", "--max-model-len", "1024", "--chunk", "256", "--repeats", "1",
        "--prefix-requests", "3", "--prefix-rate", "100", "--conversations", "2", "--turns", "2",
        "--output-len", "3", "--no-warmup", "--distinct-requests", "4"])
    report = bench.bench(embedded, args)
    shared, multi, distinct = report["shared_system"], report["multi_turn"], report["no_sharing"]
    assert shared["off"]["hit_tokens"] == 0 and multi["off"]["hit_tokens"] == 0
    # The ~870-token system prompt: up to its first 768 tokens (3 chunks) are computed once
    # (requests arriving together compute it side by side until one has registered it).
    assert shared["on"]["hit_tokens"] > 0 and shared["on"]["hit_tokens"] % 256 == 0
    assert multi["on"]["hit_tokens"] >= 2 * 768          # turn 2 resends turn 1's prompt
    assert multi["outputs_equal"]
    assert distinct["on"]["hit_rate"] == 0.0
    assert report["shared_system"]["ratio"]["on"]["ttft_mean_ms"] == pytest.approx(
        shared["on"]["ttft_mean_ms"] / shared["off"]["ttft_mean_ms"])
    table = bench.markdown({**report, "price": {"usd_per_hour": 1.0, "source": "test"}})
    assert table.count("| shared_system |") == 3
