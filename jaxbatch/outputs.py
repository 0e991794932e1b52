"""What callers get back, named as in vLLM. Pure Python."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    """Times from time.monotonic()."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None        # "stop" | "length" | "abort" | None
    stop_reason: int | str | None = None
    # With a reasoning parser: the thought (`text` is then the answer after it); None: no
    # thought in this output, or no parser.
    reasoning: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens served from the prefix cache (by earlier requests; n > 1 samples sharing
    # the prompt computed by the first are counted in stats()["prefix_cache_hits"] only).
    num_cached_tokens: int = 0


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What an embedding request returns (vLLM's shape): `outputs.embedding`."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
