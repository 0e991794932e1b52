"""quantization="w8a8" end to end on a tiny random model: the kernel seam picks the CPU's VNNI
kernel (cpu_gemm="packed"), the same over AMX int8 tiles ("amx", auto on an AMX CPU) or XLA's
int8 dots ("xla") and says so, a request's tokens are the same solo and batched, each gives the tokens of the jnp
reference (the stacked layout runs the reference), and a CPU that cannot run the kernel
refuses the option before anything loads."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import w8a8_gemm
from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from engines import run_all
from tiny_models import make_hf_model, ours_from_hf, random_token_prompts

REASON = w8a8_gemm.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"W8A8 kernel unavailable: {REASON}")


@pytest.fixture(scope="module")
def tiny():
    cfg, params = ours_from_hf(make_hf_model("llama_untied_gqa2", seed=5))
    return LoadedModel(cfg, params, tokenizer=None, source="tiny-w8a8", load_seconds=0.0,
                       from_cache=False)


def _engine(tiny, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("warmup", False)
    kw.setdefault("compilation_cache", False)
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(loaded=tiny, quantization="w8a8", **kw)


PROMPTS = random_token_prompts(np.random.default_rng(3), [5, 40, 17, 64])
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 12, 8)]


def _tokens(engine, prompts=PROMPTS, params=PARAMS):
    return [list(o.outputs[0].token_ids) for o in run_all(engine, prompts, params)]


SAYS = {"amx": ("cpu_kernels.w8a8_gemm (AMX int8 tiles", "w8a8 (amx)"),
        "packed": ("cpu_kernels.w8a8_gemm (AVX512-VNNI", "w8a8 (cpu)"),
        "xla": ("XLA's int8 dots", "w8a8 (xla)")}


@pytest.fixture(scope="module", params=sorted(SAYS))
def kernel(request, tiny):
    """(cpu_gemm, its engine)"""
    if request.param == "amx" and w8a8_gemm.amx_why_not() is not None:
        pytest.skip(f"no AMX tiles here: {w8a8_gemm.amx_why_not()}")
    return request.param, _engine(tiny, cpu_gemm=request.param)


@pytest.fixture
def kernel_engine(kernel):
    return kernel[1]


def test_the_seam_runs_the_kernel_asked_for_and_says_so(kernel):
    cpu_gemm, engine = kernel
    says_kernel, says_form = SAYS[cpu_gemm]
    assert says_kernel in engine.stats()["kernels"]["w8a8"]
    assert says_form in engine.stats()["kernels"]["weights"]
    assert engine.stats()["quantization"] == "w8a8"


def test_the_lm_head_takes_the_layers_w8a8_form_and_logits_stay_float32(kernel_engine):
    from jaxbatch.worker.kernel_forms import W8A8_KERNELS
    head = kernel_engine.runner.params["lm_head"]
    assert type(head) is W8A8_KERNELS[kernel_engine.runner.kernels.weight_form.w8a8_kernel]
    from jaxbatch.model.decoder import compute_logits
    hidden = jnp.ones((2, kernel_engine.model_config.hidden_size), jnp.bfloat16)
    logits = jax.jit(compute_logits)(kernel_engine.runner.params, hidden)
    assert logits.dtype == jnp.float32
    assert logits.shape == (2, kernel_engine.model_config.vocab_size)
    out = run_all(kernel_engine, PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=2,
                                                              logprobs=3, ignore_eos=True)])
    assert len(out[0].outputs[0].logprobs[0]) >= 3


def test_solo_equals_batched(kernel_engine):
    batched = _tokens(kernel_engine)
    for i in (1, 3):
        assert _tokens(kernel_engine, [PROMPTS[i]], [PARAMS[i]]) == [batched[i]]


@pytest.fixture(scope="module")
def reference_tokens(tiny):
    """The jnp reference's tokens, run once for both kernels."""
    reference = _engine(tiny, weight_layout="stacked")
    assert "jnp reference" in reference.stats()["kernels"]["w8a8"]
    return _tokens(reference)


def test_the_kernel_gives_the_tokens_of_the_jnp_reference(reference_tokens, kernel_engine):
    assert _tokens(kernel_engine) == reference_tokens


def test_w8a8_is_refused_where_its_kernel_cannot_run(tiny):
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        _engine(tiny, cpu_kernels="off")


def test_nothing_compiles_after_warm_up(tiny):
    # A small token budget: half the shapes to warm up; the 64-token prompt is chunked.
    engine = _engine(tiny, warmup=True, max_num_batched_tokens=64)
    _tokens(engine)
    assert engine.stats()["num_compilations_after_warmup"] == 0
