"""Which attention backend `auto` picks, and the engine running on each backend.

`auto`: CPU -> xla; a GPU whose jax imports and lowers the Pallas Triton kernels -> pallas; a GPU
without them (the Triton backend is deprecated from jax 0.11) -> xla. A GPU is simulated here by
patching `attention._platform`; "lowers" is checked for real against an abstract H200, and
"missing" by making the Triton module fail to import. No torch: the engine runs a tiny
random-weight model, so CI runs this file under jax 0.10.2 and jax 0.11.2.
"""
from __future__ import annotations

import builtins

import jax
import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.worker import attention
from pallas_kernels import availability

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # jax 0.11: Triton


@pytest.fixture
def fresh_availability():
    availability.triton_unavailable_reason.cache_clear()
    yield
    availability.triton_unavailable_reason.cache_clear()


@pytest.fixture
def no_triton(monkeypatch, fresh_availability):
    """As on a jax whose Pallas Triton backend was removed: the module does not import."""
    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "jax.experimental.pallas" and fromlist and "triton" in fromlist:
            raise ImportError("cannot import name 'triton' from 'jax.experimental.pallas'")
        if name == "jax.experimental.pallas.triton":
            raise ImportError("No module named 'jax.experimental.pallas.triton'")
        return real_import(name, globals, locals, fromlist, level)
    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(attention, "_platform", lambda: "gpu")


def test_auto_is_xla_on_cpu():
    assert attention.resolve_backend("auto") == "xla"


def test_auto_is_pallas_on_a_gpu_whose_jax_lowers_the_triton_kernels(on_gpu,
                                                                     fresh_availability):
    assert availability.triton_unavailable_reason() is None
    assert attention.resolve_backend("auto") == "pallas"


def test_auto_falls_back_to_xla_on_a_gpu_without_triton(on_gpu, no_triton):
    why = availability.triton_unavailable_reason()
    assert why is not None and "does not import" in why
    assert attention.resolve_backend("auto") == "xla"
    with pytest.raises(ValueError, match="'pallas' is not usable.*Use 'auto' or 'xla'"):
        attention.resolve_backend("pallas")
    with pytest.raises(ValueError, match="'pallas_interpret' is not usable"):
        attention.resolve_backend("pallas_interpret")


def test_auto_falls_back_to_xla_when_the_kernels_do_not_lower(on_gpu, fresh_availability,
                                                              monkeypatch):
    """The module imports but lowering raises, as jax does where a backend is gone."""
    import importlib
    paged_decode = importlib.import_module("pallas_kernels.paged_decode")
    ragged_paged_attention = importlib.import_module("pallas_kernels.ragged_paged_attention")

    def gone(*_, **__):
        raise NotImplementedError("Pallas Triton backend is not available")
    for module in (paged_decode, ragged_paged_attention):
        monkeypatch.setattr(module, "compiler_params", gone)
    jax.clear_caches()              # earlier traces of the kernels would be reused
    try:
        why = availability.triton_unavailable_reason()
        assert why is not None and "NotImplementedError" in why
        assert attention.resolve_backend("auto") == "xla"
    finally:
        jax.clear_caches()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="choose one of auto, xla, reference, pallas"):
        attention.resolve_backend("triton")


# --- the engine on each backend -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from jaxbatch.benchmarks.random_models import random_model
    return random_model("tiny", "float32", seed=0)


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def make_engine(tiny, backend):
    from jaxbatch.engine.llm_engine import LLMEngine
    return LLMEngine(loaded=tiny, max_num_seqs=4, max_model_len=128, prefill_chunk_size=32,
                     max_num_batched_tokens=64, attention_backend=backend, warmup=False)


def test_engine_reports_the_backend_auto_picked(tiny, on_gpu, no_triton):
    """A GPU without Triton: the engine runs on xla and says so."""
    engine = make_engine(tiny, "auto")
    assert engine.stats()["attention_backend"] == "xla"
    assert len(run(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True))[0]) == 3


def test_backends_give_the_same_greedy_tokens(tiny):
    """Prompts of several lengths (a single token, exactly one page, two chunks crossing page
    boundaries) through xla, the reference and the Pallas kernels in interpret mode. The random model's
    logits have a spread of ~8 (sqrt(hidden_size)), so float32 near-ties are not a concern;
    the prompts come from a fixed seed."""
    rng = np.random.default_rng(20240515)
    prompts = [rng.integers(3, 512, n).tolist() for n in (1, 16, 45)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "reference", "pallas_interpret"):
        engine = make_engine(tiny, backend)
        assert engine.stats()["attention_backend"] == backend
        tokens[backend] = run(engine, prompts, params)
    assert tokens["reference"] == tokens["xla"]
    assert tokens["pallas_interpret"] == tokens["xla"]
