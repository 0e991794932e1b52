"""Engines on tiny random models, run to completion, and their outputs compared with a
tolerance on log-probabilities: shared by the engine, prefix-cache, speculation and overlap
tests."""
from __future__ import annotations

from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from tiny_models import ours_from_hf

def tiny_engine(model, **kwargs) -> LLMEngine:
    cfg, params = ours_from_hf(model)
    loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0, from_cache=False)
    kwargs.setdefault("max_model_len", 256)
    # Equality tests step each engine a few dozen times: compiling only the shapes they meet
    # is faster than warming every bucket. Warm-up itself is tested in test_compilation.py.
    kwargs.setdefault("warmup", False)
    kwargs.setdefault("compilation_cache", False)
    return LLMEngine(loaded=loaded, **kwargs)


def tiny_engine_in(dtype, name: str = "llama_untied_gqa2", **kwargs) -> LLMEngine:
    """`tiny_engine` on the tiny model `name` (seed 5) with its weights in `dtype`, 4 slots,
    chunks of 32: the engine the CPU kernels' tests run with and without a kernel."""
    import jax
    import jax.numpy as jnp
    from tiny_models import make_hf_model
    cfg, params = ours_from_hf(make_hf_model(name, seed=5))
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    loaded = LoadedModel(cfg, params, None, f"tiny-{jnp.dtype(dtype).name}", 0.0, False)
    kwargs = {"max_num_seqs": 4, "max_model_len": 128, "prefill_chunk_size": 32,
              "warmup": False, "compilation_cache": False,
              "cpu_gemm": "packed",    # the AVX512 GEMM (test_cpu_amx_gemm.py runs AMX)
              **kwargs}
    return LLMEngine(loaded=loaded, **kwargs)


def greedy_case(seed: int = 7):
    """Four prompts of 5-70 tokens, each to 10 greedy tokens with their logprobs (40 in all)."""
    import numpy as np

    from jaxbatch import SamplingParams
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 37, 70, 12)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=10, logprobs=0,
                                    ignore_eos=True)] * 4


def tokens_agreeing(outs, refs, logprob_tol: float) -> int:
    """How many greedy tokens of `outs` equal `refs`' before each output's first divergence;
    the agreeing tokens' logprobs must be within `logprob_tol`."""
    agree = 0
    for out, ref in zip(outs, refs):
        a, b = out.outputs[0], ref.outputs[0]
        for tok_a, tok_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if tok_a != tok_b:
                break
            assert abs(lp_a[tok_a] - lp_b[tok_b]) < logprob_tol, (lp_a, lp_b)
            agree += 1
    return agree


def run_all(engine: LLMEngine, prompts, params) -> list:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


LOGPROB_TOL = 1e-5


class Close:
    """Equal to another logprob dict: same tokens, values within LOGPROB_TOL."""

    def __init__(self, logprobs):
        self.logprobs = logprobs

    def __eq__(self, other):
        a, b = self.logprobs, other.logprobs
        if a is None or b is None:
            return a is b
        return len(a) == len(b) and all(
            x.keys() == y.keys() and all(abs(x[t] - y[t]) <= LOGPROB_TOL for t in x)
            for x, y in zip(a, b))

    def __repr__(self):
        return repr(self.logprobs)


def result(out) -> list:
    return [(c.token_ids, Close(c.logprobs)) for c in out.outputs]


def tokens_and_logprobs(llm, prompts: list, params: list, group: list[int]) -> dict:
    """Runs prompts[i] with params[i] for i in group through `llm.generate` -> {i: (token ids,
    each generated token's logprob)}: what bit-for-bit comparisons compare."""
    outs = llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False)
    return {i: (o.outputs[0].token_ids,
                [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for i, o in zip(group, outs)}
