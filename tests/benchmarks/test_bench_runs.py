"""Each `jaxbatch bench` name runs, on the embedded model with the smallest settings: the ones
without a run of their own elsewhere (throughput, serve, prefix, lora and roofline have theirs
in test_bench_smoke.py, test_bench_serve.py and test_bench_prefix.py). Slow: e2e (pyproject)."""
from __future__ import annotations

import importlib.util
import json

from jaxbatch.entrypoints import cli


def test_latency_runs_chunked_against_unchunked(tmp_path):
    assert cli.main(["bench", "latency", "--online-short", "2", "--online-long", "1",
                     "--request-rate", "50", "--online-output-max", "4", "--max-num-seqs", "4",
                     "--online-chunk", "16", "--max-prompt-len", "48", "--xla-cache", "",
                     "--price-per-hour", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["online"]["summaries"]) == {"chunked", "unchunked"}
    assert all(s["completed"] == 3 for s in report["online"]["summaries"].values())
    if importlib.util.find_spec("matplotlib"):       # the short requests' TTFT, as a CDF
        assert report["plots"] == ["online_ttft_cdf.png"]
        assert (tmp_path / "online_ttft_cdf.png").stat().st_size > 0


def test_quant_runs_capacity_and_both_caches(tmp_path, capsys):
    assert cli.main(["bench", "quant", "--context", "64", "--base-seqs", "2", "--requests", "4",
                     "--variants", "f32_kv", "int8_kv",
                     "--price-per-hour", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_quant.json").read_text())
    assert report["capacity"]["int8"]["blocks"] > report["capacity"]["float32"]["blocks"]
    assert set(report["runs"]) == {"f32_kv", "int8_kv", "ratio"}
    assert report["runs"]["ratio"]["f32_kv"]["output_tokens_per_s"] == 1.0
    assert "$ / M out tok" in capsys.readouterr().out


def test_structured_runs_free_and_constrained(tmp_path):
    assert cli.main(["bench", "structured", "--fractions", "0", "1", "--num-requests", "4",
                     "--max-num-seqs", "4", "--output-max", "8", "--max-prompt-len", "64",
                     "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "bench_structured.json").read_text())["runs"]
    rows = [runs["0 %"], runs["100 %"]]
    assert [r["json_fraction"] for r in rows] == [0.0, 1.0]
    assert rows[1]["mask_fills"] > 0 and all(r["compilations_after_warmup"] == 0 for r in rows)


def test_spec_runs_on_and_off(tmp_path):
    assert cli.main(["bench", "spec", "--concurrency", "1", "--requests-per-slot", "1",
                     "--repetitive-output", "4", "--repeats", "1", "--price-per-hour", "1",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_spec.json").read_text())
    assert report["repetitive@1"]["outputs_equal"] and report["default@1"]["outputs_equal"]


def test_startup_runs_cold_and_warm(tmp_path):
    assert cli.main(["bench", "startup", "--skip-serial", "--max-num-seqs", "2",
                     "--max-model-len", "128", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_startup.json").read_text())["results"]
    assert set(results) == {"cold", "warm"}
    assert all(r["llm_to_first_token_s"] > 0 for r in results.values())
