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
