"""Benchmarks as a tool: `jaxbatch bench` lists and dispatches every benchmark, a missing one
says so, no tool puts paths on sys.path, scripts/ holds only the GPU harness and setup tools,
the cost per million output tokens is stated, and the step observers see what the engine did."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxbatch.benchmarks import machine, registry, report
from jaxbatch.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_KEPT = {"bootstrap.py", "gpu_check.sh", "gpu_check.py", "gpu_check_int8.py",
                "setup_vllm_cpu.sh", "setup_llama_cpp.sh", "export_safetensors.py"}
# What a user runs to decide (issue 55): each from `jaxbatch bench`, at most a dozen.
NAMED = ("throughput", "latency", "serve", "startup", "prefix", "spec", "structured", "lora",
         "quant", "roofline")
# The instruments outside the wheel that README.md and docs/BENCHMARKS.md run by name.
INSTRUMENTS = ("vs-vllm", "serve-launch", "throughput-hf", "throughput-gpu", "gpu-e2e", "scaleout", "overlap",
               "profile", "ops", "calls", "gemm", "attention-read", "step-keys", "detok",
               "families", "accuracy", "hostile")


def test_help_lists_every_benchmark(capsys):
    assert cli.main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert cli.main(["bench"]) == 0
    assert capsys.readouterr().out == listed
    for name in NAMED:
        assert re.search(rf"^  {re.escape(name)} ", listed, re.M), name
    assert len(registry.BENCHMARKS) <= 12
    assert "cost per million output tokens" in listed


def test_instruments_list_every_named_one_and_each_has_main(capsys):
    import benchmarks
    from benchmarks.__main__ import main as run
    assert run([]) == 0
    listed = capsys.readouterr().out
    for name in INSTRUMENTS:
        assert re.search(rf"^  {re.escape(name)} ", listed, re.M), name
    for name, (module, _) in benchmarks.INSTRUMENTS.items():
        assert callable(importlib.import_module(f"benchmarks.{module}").main), name
    assert run(["no-such-instrument"]) == 2


def test_every_registered_module_has_main_or_is_reported_missing(capsys):
    for name in registry.BENCHMARKS:
        module = name
        path = ROOT / "jaxbatch" / "benchmarks" / f"{module}.py"
        if path.exists():
            assert callable(importlib.import_module(f"jaxbatch.benchmarks.{module}").main), name
        else:      # a module missing from an install: a clear message, no traceback
            assert registry.main([name]) == 2
            assert f"jaxbatch/benchmarks/{module}.py is missing" in capsys.readouterr().err


def test_unknown_benchmark_is_a_usage_error(capsys):
    assert cli.main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no-such-bench'" in err and "throughput" in err


def test_dispatch_passes_the_arguments_on(monkeypatch):
    from jaxbatch.benchmarks import startup
    seen = []
    monkeypatch.setattr(startup, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "startup", "--repeats", "1"]) == 0
    assert seen == [["--repeats", "1"]]


def test_instrument_dispatch_passes_the_arguments_on(capsys):
    # The cheapest real instrument: detokenization of a few tokens (tokenizer only, no model).
    from benchmarks.__main__ import main as run
    assert run(["detok", "--tokens", "40", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "texts identical" in out and "over 40 tokens" in out


def test_python_dash_m_jaxbatch_bench_lists_them():
    proc = subprocess.run([sys.executable, "-m", "jaxbatch", "bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "roofline" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "vs-vllm" in proc.stdout


def test_listing_imports_no_jax():
    # scaleout sets XLA_FLAGS (virtual devices) before JAX starts: the dispatcher must not
    # have started it.
    code = ("import sys; from jaxbatch.entrypoints.cli import main; main(['bench']); "
            "print('JAX LOADED' if 'jax' in sys.modules else 'NO JAX')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("NO JAX"), proc.stderr


def test_no_tool_edits_sys_path():
    offenders = [str(p.relative_to(ROOT)) for d in ("scripts", "jaxbatch", "benchmarks")
                 for p in (ROOT / d).rglob("*.py") if "sys.path.insert" in p.read_text()]
    assert offenders == []


def test_scripts_holds_only_the_gpu_harness_and_setup_tools():
    assert {p.name for p in (ROOT / "scripts").iterdir()} <= SCRIPTS_KEPT


def test_bundled_data_is_package_data():
    from jaxbatch.benchmarks import workloads
    for path in (workloads.DEFAULT_PROMPTS, workloads.SYSTEM_PROMPT):
        assert path.is_file(), path
    text = (ROOT / "pyproject.toml").read_text()
    assert '"jaxbatch.benchmarks" = ["data/*.json", "data/*.txt"]' in text


def test_cost_per_million_output_tokens():
    # $0.36/h at 100 tok/s: 360 000 tokens an hour, so $1 per million.
    assert report.cost_per_million(100.0, 0.36) == pytest.approx(1.0)
    assert report.cost_per_million(0.0, 0.36) is None
    assert report.cost_per_million(100.0, None) is None
    assert report.cost_cell(100.0, {"usd_per_hour": 0.36}) == "$1.000"
    line = report.price_line({"usd_per_hour": 0.36, "source": "test"})
    assert "$0.3600 per hour (test)" in line


def test_default_price_is_stated_for_the_machine():
    price, source = machine.default_price_per_hour({"cpu_model": "AMD EPYC", "cpu_count": 2})
    assert price == pytest.approx(2 * 0.05796) and "m7a" in source and "2 vCPU" in source
    price, source = machine.default_price_per_hour({"cpu_model": "Intel Xeon", "cpu_count": 4})
    assert price == pytest.approx(4 * 0.0504) and "m7i" in source
    price, source = machine.default_price_per_hour({"jax_backend": "gpu", "device": "H200"})
    assert price is None and "--price-per-hour" in source and "H200" in source
    given = machine.resolve_price(1.5, {"cpu_model": "AMD EPYC", "cpu_count": 2})
    assert given == {"usd_per_hour": 1.5, "source": "--price-per-hour"}


def test_price_flag_states_its_default_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "prefix", "--help"])
    assert re.search(r"--price-per-hour.*default on this CPU: \$[0-9.]+/h", capsys.readouterr().out,
                     re.S)


def test_help_states_the_docstring_once_and_its_second_paragraph_after_the_flags(capsys):
    """A benchmark's module docstring is its --help: the first paragraph above the flags, the
    rest (where there is a rest) below them."""
    for name, first, rest in (("prefix", "Prefix caching, on vs off", None),
                              ("quant", "Capacity and throughput", "The budget is what")):
        with pytest.raises(SystemExit):
            cli.main(["bench", name, "--help"])
        out = capsys.readouterr().out
        flags = out.index("\noptions:")
        assert out.count(first) == 1 and out.index(first) < flags
        assert rest is None or out.index(rest) > flags


def test_machine_info_names_the_cpu_and_the_device():
    info = machine.machine_info()
    assert info["cpu_count"] >= 1 and isinstance(info["cpu_flags"], list)
    assert info["jax"] and info["jax_backend"] and info["device"]


def test_profile_floor_counts_every_token_once_through_the_matrices(monkeypatch):
    """bench profile's compute floor: layer matrices for every prompt and output token, the
    head per output token, attention over each token's keys, at the measured peak."""
    from types import SimpleNamespace

    from benchmarks import profile
    from jaxbatch.benchmarks import roofline
    cfg = SimpleNamespace(num_heads=2, num_kv_heads=1, head_dim=4, hidden_size=8,
                          intermediate_size=16, num_layers=3, vocab_size=10)
    engine = SimpleNamespace(model_config=cfg, stats=lambda: {"dtype": "bfloat16"})
    outs = [SimpleNamespace(prompt_token_ids=[1] * 5,
                            outputs=[SimpleNamespace(token_ids=[2] * 3)])] * 2
    monkeypatch.setattr(roofline, "gemm_peak", lambda dtype: 1e9)
    floor = profile.workload_floor(engine, outs)
    per_layer = 8 * (2 * 8 + 2 * 4) + 3 * 8 * 16
    tokens, keys = 8, 8 * 9 // 2
    flops = 2 * (2 * 3 * per_layer * tokens + 2 * 10 * 8 * 3 + 4 * 3 * 2 * 4 * keys)
    assert floor["gflop"] == pytest.approx(flops / 1e9)
    assert floor["seconds"] == pytest.approx(flops / 1e9)


def test_profile_builds_the_engine_on_the_model_and_quantization_asked(monkeypatch):
    """`--model` and `--quantization` reach the engine (a checkpoint's W8A8 run is profiled as
    such, not the embedded bf16 model under its name)."""
    import jaxbatch
    from benchmarks import profile
    built = {}

    class Built(Exception):
        pass

    def fake_llm(model=None, **kwargs):
        built.update(kwargs, model=model)
        raise Built

    monkeypatch.setattr(jaxbatch, "LLM", fake_llm)
    with pytest.raises(Built):
        profile.main(["--model", "ckpt/dir", "--quantization", "w8a8", "--dtype", "bfloat16"])
    assert built["model"] == "ckpt/dir" and built["quantization"] == "w8a8"
    assert built["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        profile.main(["--quantization", "fp4"])


def test_step_keys_names_the_public_runner_hooks_it_needs(monkeypatch):
    """The instrument runs executables on the runner's argument layout; without a public form
    of it, it says which hooks it needs, before any model loads (no private call instead)."""
    from benchmarks import step_keys
    from jaxbatch.worker.runner import ModelRunner
    monkeypatch.delattr(ModelRunner, "model_args", raising=False)
    with pytest.raises(SystemExit, match="model_args"):
        step_keys.main(["decode,4,1"])
