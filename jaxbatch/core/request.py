"""Where a request is at every moment. Pure Python.

A user request with `n` completions becomes `n` Sequences that the scheduler treats
independently. A Sequence moves

    WAITING --admit--> RUNNING --(stop / length)--> FINISHED_*
       ^                  |
       +----preempt-------+        (blocks freed; its tokens recomputed on re-admission)

`num_computed_tokens` counts the tokens whose KV is in the pool; an admission that finds a
cached prefix (jaxbatch/core/prefix_cache.py) starts it at the hit's length instead of 0. While it is below
`num_tokens - 1` the sequence is prefilling (prompt, or prompt + outputs after a preemption);
at `num_tokens - 1` it decodes one token per step.
"""
from __future__ import annotations

import dataclasses
import enum

from jaxbatch.pooling_params import PoolingParams
from jaxbatch.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int                      # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                       # per-sequence sampling seed (resolved at add_request)
    arrival_time: float
    arrival_step: int
    priority: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    slot: int | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    lora_int_id: int = 0            # its LoRA adapter (jaxbatch/lora/), 0 = the base model
    # Prefix caching: the keys of the sequence's full blocks, computed as far as needed (its
    # tokens only ever grow, so they stay valid), and the prompt tokens its first admission
    # found in the cache.
    block_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None
    # Speculative decoding: after a proposal mostly rejected the sequence pauses proposing
    # until this step, for twice as long each time (reset by a mostly accepted one).
    spec_resume_step: int = 0
    spec_backoff: int = 0
    # Embedding requests: prefill only, pooled (never sampled); each computed chunk's pooled
    # vector by the chunk's start (a chunk recomputed after a preemption gives the same one).
    pooling: PoolingParams | None = None
    pooled: dict[int, object] = dataclasses.field(default_factory=dict)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def prefills_last_token(self) -> bool:
        """An embedding request computes its whole prompt in prefill chunks (its last token
        too), and never decodes; a generating one decodes its last token."""
        return self.pooling is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
