"""Smoke test of the benchmark suite on a tiny random model (no HF engines, no embedded model):
the metrics are computed and sane, continuous batching beats static on the mixed workload, no
compilation happens after warm-up, and the --dry-run paths of the GPU throughput driver and
gpu_e2e (benchmarks/, outside the wheel) run."""
from __future__ import annotations

import argparse
import json
import types

import pytest

from benchmarks.throughput_gpu import synthetic_prompt_ids
from jaxbatch.benchmarks import harness, throughput, workloads

# One namespace for the names these tests used from the former scripts/bench.py.
bench = types.SimpleNamespace(**{k: getattr(m, k) for m in (workloads, harness, throughput)
                                 for k in dir(m) if not k.startswith("_")})


def test_ideal_ratio_by_hand():
    # Static: max(4, 1) + max(1, 1) = 5 steps. Continuous: the 4-step request holds one slot
    # while the three 1-step requests pass through the other: 4 steps.
    ideal = bench.ideal_ratio([4, 1, 1, 1], slots=2)
    assert ideal["static_steps"] == 5
    assert ideal["continuous_steps"] == 4
    assert ideal["continuous_steps_lower_bound"] == 4
    assert ideal["ideal_ratio"] == pytest.approx(1.25)


def test_summarize_by_hand():
    traces = [bench.Trace("a", "short", 10, 3, 0.0, [1.0, 1.5, 2.5]),
              bench.Trace("b", "long", 20, 1, 1.0, [3.0])]
    s = bench.summarize(bench.RunResult("x", 0.0, traces))
    assert s["completed"] == 2 and s["output_tokens"] == 4 and s["input_tokens"] == 30
    assert s["duration_s"] == pytest.approx(3.0)
    assert s["output_tokens_per_s"] == pytest.approx(4 / 3)
    assert s["ttft"]["mean_ms"] == pytest.approx(1500.0)         # (1.0 + 2.0) / 2
    assert s["tpot"]["mean_ms"] == pytest.approx(750.0)          # (2.5 - 1.0) / 2, only "a"
    assert s["itl"]["median_ms"] == pytest.approx(750.0)         # gaps 0.5 and 1.0
    assert s["e2el"]["p99_ms"] == pytest.approx(2500.0, rel=0.01)


def test_workloads_are_seeded_and_shaped():
    entries = bench.load_prompts()
    kinds = [e["kind"] for e in entries]
    assert len(entries) >= 30 and {"short", "medium", "long"} <= set(kinds)
    prompts = synthetic_prompt_ids(entries, 512, seed=0)
    a = bench.online_requests(prompts, kinds, 8, 2, 4.0, (8, 1.0, 2, 16), seed=3)
    b = bench.online_requests(prompts, kinds, 8, 2, 4.0, (8, 1.0, 2, 16), seed=3)
    assert [(r.prompt_ids, r.output_len, r.arrival) for r in a] == \
           [(r.prompt_ids, r.output_len, r.arrival) for r in b]
    assert sum(r.kind == "long" for r in a) == 2
    assert all(x.arrival < y.arrival for x, y in zip(a, a[1:]))
    assert all(2 <= r.output_len <= 16 for r in a)


@pytest.fixture(scope="module", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """Engines of the same shapes (continuous and static, the dry runs' twins) compile the same
    executables: a throwaway persistent cache lets the second one load them instead."""
    import jax
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    jax.config.update(keys[0], str(tmp_path_factory.mktemp("xla")))
    jax.config.update(keys[1], 0.0)
    yield
    for k, v in saved.items():
        jax.config.update(k, v)


@pytest.fixture(scope="module")
def tiny():
    from jaxbatch.benchmarks.random_models import random_model
    return random_model("tiny", "float32", seed=0)


def test_offline_and_online_on_tiny_model(tiny):
    throughput = bench.Throughput()
    args = throughput.resolve(throughput.parser().parse_args([
        "--engines", "continuous", "static", "--max-num-seqs", "4", "--request-rate", "50",
        "--online-chunk", "16", "--warmup", "workload"]))
    entries = bench.load_prompts()
    kinds = [e["kind"] for e in entries]
    prompts = synthetic_prompt_ids(entries, tiny.config.vocab_size, seed=0)
    requests = bench.offline_requests(prompts, kinds, 10, (8, 1.0, 2, 24), seed=0,
                                      max_prompt_len=24)
    off = bench.bench_offline(args, tiny, requests)
    cont, stat = off["summaries"]["continuous"], off["summaries"]["static"]
    total = sum(r.output_len for r in requests)
    for s in (cont, stat):
        assert s["completed"] == 10 and s["output_tokens"] == total
        assert 0 < s["ttft"]["median_ms"] <= s["e2el"]["median_ms"]
        assert s["itl"]["mean_ms"] > 0 and 0 < s["mean_slot_occupancy"] <= 1
        assert s["compilations_during_timed_run"] == 0 and s["compilations_before"] > 0
    for run in off["runs"].values():
        assert len(run.step_seconds) == len(run.steps) and min(run.step_seconds) > 0
    assert cont["num_steps"] < stat["num_steps"]
    assert cont["mean_slot_occupancy"] > stat["mean_slot_occupancy"]
    assert off["ideal"]["ideal_ratio"] >= 1.0

    online = bench.online_requests(prompts, kinds, 4, 1, 50.0, (4, 1.0, 2, 8), seed=0,
                                   max_prompt_len=48)
    on = bench.bench_online(args, tiny, online)
    assert on["summaries"]["chunked"]["prefill_chunk_size"] == 16
    assert on["summaries"]["unchunked"]["prefill_chunk_size"] >= 48
    for s in on["summaries"].values():
        assert s["completed"] == 5 and s["short_ttft"]["p99_ms"] > 0
        assert s["compilations_during_timed_run"] == 0

    report = {"args": vars(args), "offline": off, "online": on}
    rows = {r["target"]: r for r in bench.targets(report)}
    assert rows["compilations after warm-up"]["status"] == "met"
    assert "continuous / static output tok/s" in rows


def test_a_peer_runs_on_the_same_requests_against_its_goal(tiny, monkeypatch):
    """The seam the lab's HF baselines use: `peer_goals` names engines --engines may choose,
    `peer_runs` runs them on the offline requests, and the targets state each goal."""
    seen = []

    class Twin(throughput.Throughput):
        peer_goals = {"twin": 0.5}

        def peer_runs(self, args, requests):
            def run(reqs, slots):
                seen.append((len(reqs), slots))
                engine = harness.warmed_engine(tiny, "continuous", slots,
                                               harness.pow2_model_len(reqs), reqs, "workload")
                return harness.run_jaxbatch(engine, reqs, "twin")
            return {"twin": run}
    monkeypatch.setattr(throughput, "encode_prompts", lambda entries, tokenizer:
                        synthetic_prompt_ids(entries, tiny.config.vocab_size, seed=0))
    twin = Twin()
    report = twin.bench(tiny, twin.parser().parse_args([
        "--engines", "continuous", "twin", "--workloads", "offline", "--num-requests", "6",
        "--max-num-seqs", "2", "--max-prompt-len", "24", "--output-max", "8",
        "--warmup", "workload", "--xla-cache", ""]))
    assert seen == [(6, 2)] and set(report["offline"]["summaries"]) == {"continuous", "twin"}
    rows = {r["target"]: r for r in report["targets"]}
    assert rows["continuous / twin output tok/s"]["goal"] == ">= 0.5"


def test_step_observers_see_every_step(tiny, monkeypatch):
    """The engine's and the runner's hooks (benchmarks/observer.py): one on_step per
    step with its plan, one on_executable per executable run, gone again after `observe`."""
    from benchmarks.observer import ExecutableTimer, HostDelay, KvReadMeter, observe
    engine = bench.jaxbatch_engine(tiny, "continuous", 4, 64)
    requests = [bench.Request(f"r{i}", list(range(10 + i, 17 + 2 * i)), 3 + i) for i in range(3)]
    first = len(engine.step_log)
    with observe(engine, KvReadMeter()) as meter, observe(engine, ExecutableTimer()) as timer:
        bench.run_jaxbatch(engine, requests, "observed", progress=False)
    steps = engine.step_log[first:]
    assert len(meter.per_step) == len(steps) > 0
    assert [decode_only for _, decode_only in meter.per_step] == \
        [tokens == seqs for _, seqs, _, tokens in steps]
    # The last step decodes the longest request alone: its context is prompt + output - 1.
    assert meter.per_step[-1] == (len(requests[-1].prompt_ids) + requests[-1].output_len - 1, True)
    kinds = timer.by_kind()
    assert {"prefill", "decode", "sample"} <= set(kinds) and all(s > 0 for _, s in kinds.values())
    # Steps with decodes: a decode call, or decode rows inside a mixed call (unified_step).
    assert kinds["decode"][0] + kinds.get("mixed", (0,))[0] == sum(kv > 0 for kv, _ in meter.per_step)
    assert timer.prefill_tokens["prompt"] == sum(len(r.prompt_ids) for r in requests)
    assert timer.prefill_tokens["computed"] >= timer.prefill_tokens["prompt"]
    assert engine.step_observers == [] and engine.runner.executable_observers == []
    # HostDelay (bench overlap): its sleep, once per step (recorded, not slept).
    from benchmarks import observer
    slept = []
    monkeypatch.setattr(observer.time, "sleep", slept.append)
    with observe(engine, HostDelay(30.0)), observe(engine, KvReadMeter()) as meter:
        bench.run_jaxbatch(engine, requests[:1], "delayed", progress=False)
    assert len(meter.per_step) >= 3 and slept == [0.03] * len(meter.per_step)
    with pytest.raises(TypeError):
        with observe(engine, object()):
            pass


def test_bench_gpu_dry_run(tmp_path):
    from benchmarks import throughput_gpu
    report = throughput_gpu.main(["--dry-run", "--num-requests", "6", "--out", str(tmp_path),
                                  "--xla-cache", "", "--price-per-hour", "3.6"])
    tiny = report["gpu"]["models"]["tiny"]
    for s in tiny["summaries"].values():
        assert s["compilations_during_timed_run"] == 0
        assert s["mbu_median"] > 0 and s["decode_steps"] > 0
    # Every throughput table states the cost per million output tokens at the given price.
    assert report["price"] == {"usd_per_hour": 3.6, "source": "--price-per-hour"}
    md = (tmp_path / "bench.md").read_text()
    cost = 3.6 / (tiny["summaries"]["continuous"]["output_tokens_per_s"] * 3600) * 1e6
    assert "$ / M out tok" in md and f"${cost:.3f}" in md and "$3.6000 per hour" in md
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["gpu"]["models"]["tiny"]["weight_bytes_read_per_step"] > 0


def test_gpu_e2e_dry_run(tmp_path):
    from benchmarks import gpu_e2e
    assert gpu_e2e.main(["--dry-run", "--out", str(tmp_path), "--slots", "2",
                         "--new-tokens", "4", "--check-requests", "1"]) == 0
    result = json.loads((tmp_path / "gpu_e2e.json").read_text())["models"][0]
    assert result["check"]["equal"] and result["speed"]["compilations_timed"] == 0
    assert result["speed"]["decode_tokens_per_s"] > 0


def test_families_bench_runs_each_family_on_one_workload(tmp_path, capsys):
    from benchmarks import families
    assert families.main(["--families", "llama", "gemma3", "--hidden", "64", "--layers", "2",
                          "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                          "--vocab", "512", "--window", "16", "--num-requests", "4",
                          "--rounds", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "families.json").read_text())
    for fam in ("llama", "gemma3"):
        (res,) = report["rounds"][fam]
        want = families.workload(argparse.Namespace(seed=0, num_requests=4, vocab=512))
        assert res["output_tokens"] == sum(n for _, n in want)
        assert res["output_tok_s"] > 0
    table = (tmp_path / "families.md").read_text()
    assert "| gemma3 |" in table and table.count("| 0 |") == 2   # no compilation after warm-up


def test_lora_bench_times_each_case_without_compiling(tmp_path):
    from jaxbatch.benchmarks import lora
    lora.main(["--model", "tiny", "--rows", "4", "--rounds", "1", "--tokens", "10",
               "--max-loras", "2", "--price-per-hour", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_lora.json").read_text())
    assert report["compilations_after_warmup"] == [0, 0]
    cases = ("no LoRA engine", "LoRA engine, 0 adapters", "LoRA engine, 1 adapter",
             "LoRA engine, 2 adapters")
    (result,) = report["results"].values()
    assert sorted(result) == sorted(cases + ("ratio",))
    assert all(result[case]["decode_step_ms"] > 0 for case in cases)
    assert result["ratio"]["no LoRA engine"]["decode_step_ms"] == 1.0


def test_roofline_bench_reports_steps_against_measured_floors(tmp_path):
    from jaxbatch.benchmarks import roofline
    roofline.main(["--random-model", "tiny", "--rows", "4", "--steps", "4", "--context", "64",
                   "--prefill-tokens", "32", "--price-per-hour", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_roofline.json").read_text())
    assert report["copy_bandwidth_bytes_s"] > 1e8 and report["gemm_peak_flop_s"] > 1e8
    (dec,) = report["decode"]
    assert dec["rows"] == 4 and dec["kv_mb"] > 0 and dec["step_over_floor"] > 0
    # tiny: 2 layers, 4 KV heads' worth of head_dim 16 in bf16, every length in (32, 64]
    assert 4 * 33 * 2 * 2 * 2 * 16 * 2 / 1e6 <= dec["kv_mb"] <= 4 * 64 * 2 * 2 * 2 * 16 * 2 / 1e6
    # the floor is the larger of bytes / bandwidth and the matmul FLOPs (layers + LM head) / peak
    from jaxbatch.benchmarks.random_models import MODEL_SHAPES
    cfg = MODEL_SHAPES["tiny"]
    flops = 2 * (roofline.matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size) * 4
    assert dec["compute_floor_ms"] == pytest.approx(1e3 * flops / report["gemm_peak_flop_s"])
    assert dec["floor_ms"] == max(dec["bandwidth_floor_ms"], dec["compute_floor_ms"])
    assert dec["bound"] == ("compute" if dec["compute_floor_ms"] > dec["bandwidth_floor_ms"]
                            else "bandwidth")
    # in order, at the read bandwidth: the matmuls' own floor, then the KV read
    reads = report["read_bandwidth_bytes_s"]
    assert reads > 1e8
    weights_ms, kv_ms = (1e9 * dec[k] / reads for k in ("weight_mb", "kv_mb"))
    assert dec["sequential_floor_ms"] == pytest.approx(
        max(weights_ms, dec["compute_floor_ms"]) + kv_ms)
    assert dec["overlapped_over_floor"] == pytest.approx(
        dec["overlapped_step_ms"] / dec["floor_ms"])
    # against the bytes alone, and the lowest ratio the matmuls' FLOPs leave reachable
    assert dec["overlapped_over_bandwidth_floor"] == pytest.approx(
        dec["overlapped_step_ms"] / dec["bandwidth_floor_ms"])
    assert dec["reachable_over_bandwidth_floor"] == pytest.approx(
        dec["floor_ms"] / dec["bandwidth_floor_ms"])
    assert dec["reachable_over_bandwidth_floor"] >= 1
    assert report["prefill"]["tokens"] == 32 and report["prefill"]["step_over_floor"] > 0


def test_roofline_takes_the_gemm_peak_in_the_weights_dtype(monkeypatch, tmp_path):
    """A float32 model's compute floor at float32's rate (about half bf16's without AMX)."""
    from jaxbatch.benchmarks import roofline
    seen = []
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda: 1e10)
    monkeypatch.setattr(roofline, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(roofline, "gemm_peak",
                        lambda dtype, quantization=None: seen.append(str(dtype)) or 1e11)
    monkeypatch.setattr(roofline, "decode_rows", lambda *a, **options: {
        "rows": 4, "context": 64, "step_ms": 1.0, "weight_mb": 1.0, "kv_mb": 1.0,
        "bandwidth_floor_ms": 1.0, "compute_floor_ms": 1.0, "bound": "compute",
        "floor_ms": 1.0, "step_over_floor": 1.0, "overlapped_step_ms": 1.0,
        "overlapped_over_floor": 1.0, "sequential_floor_ms": 1.0,
        "overlapped_over_sequential": 1.0, "overlapped_over_bandwidth_floor": 1.0,
        "reachable_over_bandwidth_floor": 1.0})
    monkeypatch.setattr(roofline, "prefill_chunk", lambda *a, **options: {
        "tokens": 32, "step_ms": 1.0, "gflop": 1.0, "floor_ms": 1.0, "step_over_floor": 1.0})
    for dtype in ("float32", "bfloat16"):
        roofline.main(["--random-model", "tiny", "--dtype", dtype, "--rows", "4",
                       "--price-per-hour", "1", "--out", str(tmp_path)])
        report = json.loads((tmp_path / "bench_roofline.json").read_text())
        assert seen[-1] == report["gemm_dtype"] == dtype
    roofline.main(["--random-model", "tiny", "--rows", "4", "--quantization", "w8a8",
                   "--price-per-hour", "1", "--out", str(tmp_path)])
    # w8a8's floor is int8's (gemm_peak's quantization), and the report says so
    assert json.loads((tmp_path / "bench_roofline.json").read_text())["gemm_dtype"] == "int8 (w8a8)"


def test_roofline_hands_the_engines_the_kernel_asked_for(monkeypatch, tmp_path):
    from jaxbatch.benchmarks import roofline
    engines = []
    real = roofline.steady_decode_engine
    monkeypatch.setattr(roofline, "steady_decode_engine",
                        lambda *a, **kw: engines.append(real(*a, **kw)) or engines[-1])
    roofline.main(["--random-model", "tiny", "--rows", "4", "--context", "64", "--steps", "1",
                   "--prefill-tokens", "32", "--cpu-gemm", "xla", "--price-per-hour", "1",
                   "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_roofline.json").read_text())["cpu_gemm"] == "xla"
    assert engines[0].stats()["kernels"]["matmul"] == "XLA dots (cpu_gemm='xla')"


def test_roofline_read_bandwidth_reads_every_byte_once(monkeypatch):
    """One np.max per core over its own part of the array: the parts tile it exactly."""
    import numpy as np

    from jaxbatch.benchmarks import roofline
    from jaxbatch.benchmarks.machine import cpu_count
    sizes = []
    real_max = np.max
    monkeypatch.setattr(np, "max", lambda a: sizes.append(a.nbytes) or real_max(a))
    assert roofline.read_bandwidth(nbytes=1 << 20, reps=1) > 0
    assert sum(sizes) == 1 << 20 and len(sizes) == cpu_count()


def test_roofline_gemm_peak_multiplies_in_the_dtype_it_is_given(monkeypatch):
    from jaxbatch.benchmarks import roofline
    seen = []
    monkeypatch.setattr(roofline, "_best_seconds",
                        lambda fn, *args, **kw: seen.append(args[0].dtype) or 1.0)
    assert roofline.gemm_peak("float32", n=8) == 2 * 8 ** 3
    assert roofline.gemm_peak("bfloat16", n=8) == 2 * 8 ** 3
    assert [str(d) for d in seen] == ["float32", "bfloat16"]


def test_roofline_gemm_peak_is_the_fastest_of_xlas_dot_and_the_seams_forms(monkeypatch):
    from cpu_kernels import packed_gemm
    from jaxbatch.benchmarks import roofline
    from jaxbatch.worker.kernel_forms import AmxPacked, Packed
    if packed_gemm.why_not("bfloat16", 16, 16) is not None:
        pytest.skip("the packed GEMM kernel does not run here")
    amx = packed_gemm.amx_why_not() is None
    for dot_s, avx512_s, amx_s in ((1.0, 0.5, 0.25), (1.0, 2.0, 2.0), (1.0, 0.5, 2.0)):
        monkeypatch.setattr(roofline, "_best_seconds", lambda fn, x, w, **kw: (
            amx_s if isinstance(w, AmxPacked) else avx512_s if isinstance(w, Packed) else dot_s))
        fastest = min(dot_s, avx512_s, amx_s if amx else float("inf"))
        assert roofline.gemm_peak("bfloat16", n=16) == 2 * 16 ** 3 / fastest


def test_roofline_w8a8_peak_is_the_fastest_of_the_seams_forms(monkeypatch):
    from cpu_kernels import w8a8_gemm
    from jaxbatch.benchmarks import roofline
    from jaxbatch.worker.kernel_forms import AmxPackedW8A8, OutInW8A8
    if w8a8_gemm.unavailable_reason() is not None:
        pytest.skip("the VNNI kernel does not run here")
    amx = w8a8_gemm.amx_why_not() is None
    for xla_s, vnni_s, amx_s in ((0.5, 1.0, 2.0), (1.0, 0.25, 2.0), (1.0, 0.5, 0.125)):
        monkeypatch.setattr(roofline, "_best_seconds", lambda fn, x, form, **kw: (
            xla_s if isinstance(form, OutInW8A8) else
            amx_s if isinstance(form, AmxPackedW8A8) else vnni_s))
        fastest = min(xla_s, vnni_s, amx_s if amx else float("inf"))
        assert roofline.gemm_peak("bfloat16", n=16, quantization="w8a8") == 2 * 16 ** 3 / fastest


def test_roofline_decode_floor_is_the_larger_of_bandwidth_and_compute():
    from jaxbatch.benchmarks import roofline
    from jaxbatch.benchmarks.random_models import random_model
    loaded = random_model("tiny")
    # a slow GEMM makes the step compute-bound; a fast one leaves it bandwidth-bound
    slow = roofline.decode_rows(loaded, 4, 64, 2, bandwidth=1e12, peak=1e6, read_bandwidth=1e12)
    assert slow["bound"] == "compute" and slow["floor_ms"] == slow["compute_floor_ms"]
    assert slow["compute_floor_ms"] > slow["bandwidth_floor_ms"]
    fast = roofline.decode_rows(loaded, 4, 64, 2, bandwidth=1e6, peak=1e18, read_bandwidth=1e6)
    assert fast["bound"] == "bandwidth" and fast["floor_ms"] == fast["bandwidth_floor_ms"]


def test_roofline_times_the_overlapped_steps_in_steady_decode(monkeypatch):
    """Steps with and without overlap, interleaved round by round in one engine."""
    from jaxbatch.benchmarks import roofline
    from jaxbatch.benchmarks.random_models import random_model
    from jaxbatch.engine.llm_engine import LLMEngine
    seen = []
    real_step = LLMEngine.step

    def step(engine):
        seen.append(engine.async_scheduling)
        return real_step(engine)
    monkeypatch.setattr(LLMEngine, "step", step)
    result = roofline.decode_rows(random_model("tiny"), 4, 64, 3, bandwidth=1e9, peak=1e9,
                                  read_bandwidth=1e9)
    # prefill, first decode, then per round: a read-back and a timed step without overlap, a
    # dispatch and the timed steps with it
    assert seen == [False] * 2 + ([False] * 2 + [True] * (1 + roofline.OVERLAPPED_STEPS)) * 3
    assert result["overlapped_step_ms"] > 0


def test_roofline_refuses_a_timed_step_that_left_steady_decode():
    """Timing past the requests' last token: the overlapped steps run fewer rows, then none."""
    from jaxbatch.benchmarks import roofline
    from jaxbatch.benchmarks.roofline import steady_decode_engine
    from jaxbatch.benchmarks.random_models import random_model
    engine = steady_decode_engine(random_model("tiny"), 4, 64, 2, seed=0)
    engine.step()
    with pytest.raises(RuntimeError, match="left steady decode"):
        roofline.overlapped_period(engine, 4, 8)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--context", "96"],
                                  ["--steps", "20", "--context", "64"]])
def test_roofline_refuses_steps_that_would_leave_the_page_bucket(argv):
    from jaxbatch.benchmarks import roofline
    with pytest.raises(SystemExit):
        roofline.main(["--random-model", "tiny", "--rows", "4"] + argv)


def test_ops_bench_names_each_op_with_its_shape_and_class(tmp_path):
    from benchmarks import ops
    assert ops.main(["--random-model", "tiny", "--rows", "4", "--steps", "2", "--context", "64",
                     "--prefill-tokens", "32", "--top", "50", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ops.json").read_text())
    for part in ("decode_4", "prefill"):
        prof = report[part]
        assert prof["ops"] and all(r["ms"] >= 0 and r["shape"] for r in prof["ops"])
        # every step runs its layer matmuls and the LM head: our GEMM kernel where the
        # engine's kernels include it (this CPU), XLA's dots elsewhere
        classes = prof["by_class_ms"]
        assert classes.get("gemm kernel", 0) + classes.get("dot", 0) > 0
        assert any(r["class"] == "loop" for r in prof["ops"])      # the attention loop


def test_hlo_ops_reads_shapes_and_fusion_kinds():
    from benchmarks.ops import hlo_ops, op_class
    text = ('  %ynn_fusion.5 = f32[16,1536]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, '
            'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}\n'
            '  %bitcast-convert_bitcast_fusion.2 = bf16[576,1536]{1,0} fusion(%g, %h), '
            'kind=kLoop, calls=%f\n'
            '  %cond.154.clone.3 = (bf16[16,1536]{1,0}) conditional(%i, %x), '
            'branch_computations={%b0, %b1}\n'
            '  %custom-call.7 = f32[16,960]{1,0} custom-call(%x, %w), '
            'custom_call_target="jaxbatch_packed_gemm", api_version=API_VERSION_TYPED_FFI\n'
            '  %custom-call.8 = f32[16,9,64]{2,1,0} custom-call(%q, %k), '
            'custom_call_target="jaxbatch_paged_decode_f32"\n'
            '  %custom-call.9 = f32[128,9,64]{2,1,0} custom-call(%q, %k), '
            'custom_call_target="jaxbatch_paged_prefill"\n'
            '  ROOT %while.3 = (s32[], f32[4]{0}) while(%t), condition=%c, body=%b\n')
    ops = hlo_ops(text)
    assert ops["ynn_fusion.5"] == ("f32[16,1536]", "fusion:__ynn_fusion")
    assert ops["bitcast-convert_bitcast_fusion.2"] == ("bf16[576,1536]", "fusion:kLoop")
    assert op_class("ynn_fusion.5", *ops["ynn_fusion.5"], set()) == "dot"
    assert op_class("bitcast-convert_bitcast_fusion.2", *ops["bitcast-convert_bitcast_fusion.2"],
                    {"576,1536]"}) == "weight copy"
    assert op_class("while.3", *ops["while.3"], set()) == "loop"
    assert op_class("cond.154.clone.3", *ops["cond.154.clone.3"], set()) == "switched dot"
    assert ops["custom-call.7"] == ("f32[16,960]", "custom-call:jaxbatch_packed_gemm")
    assert op_class("custom-call.7", *ops["custom-call.7"], set()) == "gemm kernel"
    assert op_class("custom-call.8", *ops["custom-call.8"], set()) == "decode kernel"
    assert op_class("custom-call.9", *ops["custom-call.9"], set()) == "prefill kernel"


def test_executable_ops_name_clashes_go_to_the_model_call():
    from benchmarks.ops import executable_ops
    hlo = lambda shape: types.SimpleNamespace(
        as_text=lambda: f"  %ynn_fusion.1 = {shape} fusion(%a), kind=kCustom, calls=%c\n")
    compiled = {("sample", 4): hlo("f32[4,1]{1,0}"), ("decode", 4): hlo("f32[4,576]{1,0}")}
    for keys in ([("sample", 4), ("decode", 4)], [("decode", 4), ("sample", 4)]):
        assert executable_ops(compiled, keys)["ynn_fusion.1"][0] == "f32[4,576]"
    assert executable_ops(compiled, [("sample", 4)])["ynn_fusion.1"][0] == "f32[4,1]"


def test_roofline_counts_a_tied_head_once():
    import numpy as np

    from jaxbatch.benchmarks import roofline
    from jaxbatch.model.linear import OutIn, PerLayer
    from jaxbatch.worker.weight_forms import Packed
    embed, layer = np.zeros((64, 16), np.float32), np.zeros((16, 16), np.float32)
    tied = {"embed": embed, "layers": {"wo": PerLayer((OutIn(layer),))}}
    assert roofline.model_bytes(tied) == embed.nbytes + layer.nbytes
    packed = {**tied, "tied_head": Packed(embed.T.copy())}
    assert roofline.model_bytes(packed) == embed.nbytes + layer.nbytes


def test_vs_vllm_rotates_every_engine_and_runs_hf_with_caching_off_only(tmp_path, monkeypatch):
    """bench vs-vllm with --hf-dtypes: HF generate joins the rotation where prefix caching is
    off (it has no prefix cache), and jaxbatch float32 / HF float32 is reported there."""
    from benchmarks import vs_vllm
    calls = []
    speed = {"jaxbatch": 300.0, "vllm": 250.0, "hf": 20.0}
    for name in vs_vllm.RUNNERS:
        monkeypatch.setitem(vs_vllm.RUNNERS, name,
                            lambda args, caching, out, dtype, name=name:
                            calls.append((name, caching, dtype)) or speed[name])
    report = vs_vllm.main(["--prefix-caching", "off", "on", "--rounds", "2", "--hf-dtypes",
                           "float32", "--out", str(tmp_path), "--price-per-hour", "1"])
    assert sorted(set(calls)) == [("hf", "off", "float32"), ("jaxbatch", "off", "float32"),
                                  ("jaxbatch", "on", "float32"), ("vllm", "off", "float32"),
                                  ("vllm", "on", "float32")]
    assert len(calls) == 2 * 3 + 2 * 2
    off, on = report["results"]["off"], report["results"]["on"]
    assert off["float32_over_hf"] == 15.0 and "float32_over_hf" not in on
    assert off["ratio_of_bests"] == on["ratio_of_bests"] == 1.2
