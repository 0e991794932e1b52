"""jaxbatch: continuous-batching LLM inference in JAX with a paged KV cache.

Read top-down (docs/architecture.md has a request's whole path): entrypoints/ (LLM, the
server) -> engine/ (options, building, LLMEngine.step, outputs) -> core/ (scheduler, KV blocks,
requests, plans; host only) -> worker/ (runner, sampler, attention) -> model/. The host-side
modules import no JAX; `import jaxbatch` stays light until LLM is used.
"""
import os

# jaxbatch uses transformers for tokenizers and chat templates only, and runs without torch:
# its advice that "PyTorch was not found. Models won't be available" would read as a fault.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxbatch.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                              RequestMetrics, RequestOutput)
from jaxbatch.pooling_params import PoolingParams
from jaxbatch.sampling_params import SamplingParams, StructuredOutputsParams
from jaxbatch.lora.request import LoRARequest     # plain data, no JAX

__all__ = ["LLM", "LLMEngine", "build_engine", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "RequestMetrics", "LoRARequest", "PoolingParams",
           "EmbeddingRequestOutput", "EmbeddingOutput"]


def __getattr__(name):
    # Lazy, so the scheduler's tests can import jaxbatch.* without pulling in JAX.
    if name == "LLM":
        from jaxbatch.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from jaxbatch.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "build_engine":
        from jaxbatch.engine.build import build_engine
        return build_engine
    raise AttributeError(name)
