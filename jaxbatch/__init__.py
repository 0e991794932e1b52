"""jaxbatch: continuous-batching LLM inference in JAX with a paged KV cache.

Read top-down: llm.py -> engine.py -> scheduler.py (with block_manager.py, request.py,
policies.py, plan.py) -> runner.py (with sampler.py, attention.py, kv_cache.py) -> model/.
The host-side modules import no JAX; `import jaxbatch` stays light until LLM is used.
"""
from jaxbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "StructuredOutputsParams"]


def __getattr__(name):
    # Lazy, so the scheduler's tests can import jaxbatch.* without pulling in JAX.
    if name == "LLM":
        from jaxbatch.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from jaxbatch.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
