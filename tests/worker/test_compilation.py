"""Nothing compiles while serving: warm-up covers every shape and sampling feature, a miss is
counted and logged, the pool is updated in place, and a second start loads executables."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from engines import run_all
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts

SOAK_SEED = 20261129


@pytest.fixture(scope="module")
def tiny():
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=7))
    return LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0, from_cache=False)


def _random_params(rng, i, prompt_len, max_len):
    """Every feature that used to be a compile-time variant, mixed at random."""
    roll = rng.random(6)
    max_tokens = int(max(1, min(rng.geometric(1 / 12), max_len - prompt_len - 1)))
    return SamplingParams(
        n=int(rng.choice([1, 1, 1, 2])),
        temperature=float(rng.choice([0.0, 0.7, 1.0])), seed=i,
        top_k=int(rng.choice([0, 0, 5])), top_p=float(rng.choice([1.0, 0.9])),
        min_p=float(rng.choice([0.0, 0.05])),
        presence_penalty=0.5 if roll[0] < 0.2 else 0.0,
        frequency_penalty=0.3 if roll[1] < 0.2 else 0.0,
        repetition_penalty=1.2 if roll[2] < 0.2 else 1.0,
        logprobs=int(rng.integers(0, 5)) if roll[3] < 0.3 else None,
        prompt_logprobs=int(rng.integers(0, 3)) if roll[4] < 0.15 else None,
        min_tokens=min(2, max_tokens) if roll[5] < 0.2 else 0,
        stop_token_ids=[int(rng.integers(3, 256))] if roll[5] > 0.8 else None,
        max_tokens=max_tokens, ignore_eos=True)


def test_500_request_random_soak_compiles_nothing_after_warmup(tiny):
    engine = LLMEngine(loaded=tiny, max_num_seqs=8, max_model_len=256, prefill_chunk_size=64,
                       compilation_cache=False)
    compiled = engine.stats()["num_compilations"]
    assert engine.runner.warmed_up and compiled == len(engine.runner.bucket_shapes())
    rng = np.random.default_rng(SOAK_SEED)
    lengths = np.minimum(rng.geometric(1 / 40, size=500), 220)
    prompts = random_token_prompts(rng, lengths)
    pending = list(enumerate(prompts))
    finished, aborted = set(), set()
    while pending or engine.has_unfinished_requests():
        # Requests arrive a few at a time while others run, and some are aborted mid-flight.
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, _random_params(rng, i, len(p), 256))
        if rng.random() < 0.02 and engine.has_unfinished_requests():
            victim = next(iter(engine.outputs.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished.add(out.request_id)
    assert len(finished) == 500
    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0, engine.runner.compilations_after_warmup
    assert stats["num_compilations"] == compiled
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_shape_missed_by_warmup_is_counted_and_logged(tiny, caplog):
    engine = LLMEngine(loaded=tiny, max_num_seqs=4, max_model_len=64, compilation_cache=False)
    # Pretend the buckets forgot 3-row decode calls: the runner must notice, not hide it.
    real = engine.runner.layout.decode_row_bucket
    engine.runner.layout.decode_row_bucket = lambda n: 3 if n == 3 else real(n)
    for i in range(3):
        engine.add_request(str(i), [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with caplog.at_level(logging.WARNING, logger="jaxbatch.worker.runner"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats()["num_compilations_after_warmup"] >= 1
    assert any("after warm-up" in r.message and "'decode', 3" in r.message for r in caplog.records)


def _pool_aliases(hlo_text: str) -> list[int]:
    header = hlo_text.splitlines()[0]
    aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
    return [int(p) for p in re.findall(r"\((\d+), \{\}", aliases.group(1))] if aliases else []


@pytest.mark.parametrize("backend,stored", [("xla", False), ("xla", True),
                                            ("pallas_interpret", False)])
def test_compiled_model_calls_update_the_pool_in_place(tiny, backend, stored, tmp_path):
    """The pool goes in donated and comes back aliased to its input buffers, and no
    instruction of the compiled step copies a pool-sized array (also when the step is lowered
    from its stored export: `lowered_store.py`)."""
    engine = LLMEngine(loaded=tiny, max_num_seqs=2, max_model_len=64, attention_backend=backend,
                       warmup=False, compilation_cache=False)
    runner = engine.runner
    if stored:
        from jaxbatch.worker.runner import ModelRunner
        runner = ModelRunner(runner.model_cfg, tiny.params, runner.cfg, runner.pool[0].dtype,
                             backend, lowered_dir=str(tmp_path))
        assert runner.executables.store is not None
    pool_shape = "f32[" + ",".join(str(d) for d in runner.pool[0].shape) + "]"
    num_param_leaves = len(__import__("jax").tree.leaves(runner.params))
    keys = runner.layout.bucket_shapes()
    kinds = sorted({k[0] for k in keys})                     # decode, prefill (and mixed: xla)
    assert "mixed" in kinds or backend != "xla"
    for key in [[k for k in keys if k[0] == kind][-1] for kind in kinds]:
        text = runner.executables.lower(key, runner.example_args(key)).compile().as_text()
        assert sorted(_pool_aliases(text)) == [num_param_leaves, num_param_leaves + 1], key
        copies = [line for line in text.splitlines()
                  if re.search(r"= " + re.escape(pool_shape) + r"\{[^}]*\} copy\(", line)]
        assert not copies, (key, copies[:3])


def test_second_warmup_reads_every_executable_from_the_persistent_cache(tiny, tmp_path):
    """Two runners with the same settings: the first compiles and fills JAX's persistent
    cache, the second (new function objects, so no in-memory hit) reads every executable back;
    both give the same tokens and log-probabilities as a runner that stores nothing (plain
    `jax.jit` lowering)."""
    import jax
    from jax import monitoring
    from jaxbatch.worker import compile_cache
    from jaxbatch.worker.runner import ModelRunner
    if compile_cache.enable() is None:
        pytest.skip("JAXBATCH_COMPILATION_CACHE=0")
    events = []
    monitoring.register_event_listener(lambda event, **_: events.append(event))
    count = lambda name, since: sum(e == "/jax/compilation_cache/" + name for e in events[since:])
    settings = dict(max_num_seqs=2, max_model_len=48, seed=123)
    outputs = []
    for attempt in range(3):
        engine = LLMEngine(loaded=tiny, warmup=False, compilation_cache=attempt < 2, **settings)
        assert (engine.runner.executables.store is None) == (attempt == 2)
        before = len(events)
        engine.warmup()
        if attempt == 1:
            # Every compile that reached the disk cache found its executable there (functions
            # shared by both runners may also hit JAX's in-memory cache first), and nothing
            # was traced: every lowering was read back from the store.
            assert count("cache_hits", before) >= len(engine.runner.layout.bucket_shapes())
            assert count("cache_misses", before) == 0
            report = engine.runner.warmup_report
            assert report["from_store"] == report["compiled"] == len(engine.runner.bucket_shapes())
        engine.add_request("a", [9, 8, 7, 6], SamplingParams(temperature=0.8, seed=1, max_tokens=6,
                                                            logprobs=2))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append((out.outputs[0].token_ids, out.outputs[0].logprobs))
        assert engine.stats()["num_compilations_after_warmup"] == 0
    assert outputs[0] == outputs[1] == outputs[2]


def test_lowered_store_reads_back_what_it_exported_and_refuses_what_does_not_fit(tmp_path, caplog):
    """A second store over the same directory lowers from the stored export (same numbers as a
    plain jit); an entry for other shapes, or an unreadable one, is a miss, replaced."""
    import jax
    import jax.numpy as jnp
    from jaxbatch.worker.lowered_store import LoweredStore

    def fn(params, x):
        return jnp.tanh(x @ params["w"]) + params["b"], x * 2

    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "b": np.ones(4, np.float32)}
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    expected = jax.jit(fn)(params, x)
    first = LoweredStore(str(tmp_path), "fp")
    out = first.lower(("f", 2), fn, (1,), (params, x)).compile()(params, jnp.asarray(x))
    assert first.hits == 0
    second = LoweredStore(str(tmp_path), "fp")
    out2 = second.lower(("f", 2), fn, (1,), (params, x)).compile()(params, jnp.asarray(x))
    assert second.hits == 1
    for a, b, c in zip(expected, out, out2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # Another fingerprint does not see it.
    assert LoweredStore(str(tmp_path), "other")._load(("f", 2), (params, x)) is None
    with caplog.at_level(logging.WARNING, logger="jaxbatch.worker.lowered_store"):
        # Same key, other shapes: a miss, then replaced by the new export.
        x3 = np.ones((5, 3), np.float32)
        third = LoweredStore(str(tmp_path), "fp")
        assert third.lower(("f", 2), fn, (), (params, x3)).compile()(params, x3)[0].shape == (5, 4)
        assert third.hits == 0 and third._load(("f", 2), (params, x3)) is not None
        # An unreadable entry: a miss.
        with open(third._path(("f", 2)), "wb") as f:
            f.write(b"not a pickle")
        assert third._load(("f", 2), (params, x3)) is None
    assert any("other argument shapes" in r.message for r in caplog.records)
    assert any("unreadable" in r.message for r in caplog.records)


def test_a_step_that_cannot_be_exported_is_lowered_by_jit(tiny, tmp_path, caplog):
    """Whatever jax.export refuses costs the store, never the warm-up."""
    from jaxbatch.worker.runner import ModelRunner
    engine = LLMEngine(loaded=tiny, max_num_seqs=2, max_model_len=48, warmup=False,
                       compilation_cache=False)
    runner = ModelRunner(engine.runner.model_cfg, tiny.params, engine.runner.cfg,
                         engine.runner.pool[0].dtype, lowered_dir=str(tmp_path))

    def refuse(*args, **kwargs):
        raise ValueError("cannot export this")
    runner.executables.store.lower = refuse
    with caplog.at_level(logging.WARNING, logger="jaxbatch.worker.runner"):
        runner.warmup(run=False)
    assert runner.executables.store is None and runner.warmup_report["from_store"] == 0
    assert runner.num_compilations == len(runner.bucket_shapes())
    assert any("jax.export failed" in r.message for r in caplog.records)


def test_warmup_runs_each_model_step_once_and_changes_no_output(tiny, monkeypatch):
    """warmup_runs: every decode and prefill executable runs once before the first request
    (XLA:CPU sets an executable's kernels up on its first run), on inputs that leave every
    request's output as it is without the runs."""
    from jaxbatch.worker.compilation import Executables
    ran = []
    real_run = Executables.run
    monkeypatch.setattr(Executables, "run",
                        lambda self, key, args: ran.append(key) or real_run(self, key, args))
    settings = dict(max_num_seqs=4, max_model_len=128, prefill_chunk_size=32,
                    compilation_cache=False)
    engines = {}
    for runs in (False, True):
        ran.clear()
        engines[runs] = LLMEngine(loaded=tiny, warmup_runs=runs, **settings)
        runner = engines[runs].runner
        model_keys = [k for k in runner.bucket_shapes() if runner.is_model_call(k)]
        assert any(k[0] == "mixed" for k in model_keys)
        assert sorted(ran) == (sorted(model_keys) if runs else []), runs
    assert engines[True].runner.warmup_report["run_s"] > 0
    rng = np.random.default_rng(3)
    prompts = random_token_prompts(rng, [5, 40, 17, 70, 9])
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    outputs = {}
    for runs, engine in engines.items():
        outputs[runs] = [(out.outputs[0].token_ids, [sorted(lp.items()) for lp in
                                                     out.outputs[0].logprobs])
                         for out in run_all(engine, prompts, [params] * len(prompts))]
        assert engine.stats()["num_compilations_after_warmup"] == 0
    assert outputs[True] == outputs[False]


def test_warmup_runs_the_lora_twins_too(tiny, monkeypatch):
    from jaxbatch.worker.compilation import Executables
    ran = []
    real_run = Executables.run
    monkeypatch.setattr(Executables, "run",
                        lambda self, key, args: ran.append(key) or real_run(self, key, args))
    engine = LLMEngine(loaded=tiny, enable_lora=True, max_loras=1, max_lora_rank=4,
                       max_num_seqs=4, max_model_len=64, compilation_cache=False)
    model_keys = [k for k in engine.runner.bucket_shapes() if engine.runner.is_model_call(k)]
    assert {"decode_lora", "mixed_lora"} <= {k[0] for k in model_keys}
    assert sorted(ran) == sorted(model_keys)


def test_the_store_registers_every_kernel_a_stored_step_may_call(tmp_path):
    """A stored step is not traced, so nothing registers the kernels it calls on the way: the
    store's fingerprint must (a fresh process once met 'No FFI handler registered for
    jaxbatch_paged_prefill' reading a cached executable). Every kernel source is in KERNELS."""
    import os
    import subprocess
    import sys
    import cpu_kernels
    sources = {k.SOURCE for k in cpu_kernels.KERNELS}
    here = os.path.dirname(cpu_kernels.__file__)
    assert sources == {f for f in os.listdir(here) if f.endswith(".cc")}
    if any(cpu_kernels.register_all()):
        pytest.skip(f"a CPU kernel is unavailable: {cpu_kernels.register_all()}")
    script = (
        "import jax, jax.numpy as jnp, cpu_kernels\n"
        "from jaxbatch.worker import lowered_store\n"
        "lowered_store.fingerprint('any')\n"
        "for kernel in cpu_kernels.KERNELS:\n"
        "    amx = cpu_kernels.availability.amx_unavailable_reason() is None   # no registering\n"
        "    for t in [t for t in kernel.TARGETS if amx or not t.endswith('_amx')]:\n"
        "        call = jax.ffi.ffi_call(t, jax.ShapeDtypeStruct((2,), jnp.float32))\n"
        "        jax.jit(call).lower(jnp.zeros(2)).compile()   # raises when not registered\n"
        "    print('registered', kernel.__name__, amx)\n")
    root = os.path.dirname(here)
    env = dict(os.environ, JAXBATCH_COMPILATION_CACHE="0",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("registered") == len(cpu_kernels.KERNELS), done.stdout
