"""A step on its way through the runner, as two records the engine holds between calls.

`ForwardedStep`: the step's model calls are on the device, their logits not yet sampled. The
engine fills the grammar masks of `sampling_rows()` meanwhile (structured outputs) and hands
them back to `ModelRunner.dispatch_sampling` as data, so the runner never calls up into it.
`DispatchedStep`: sampling is on the device too; `ModelRunner.collect` reads it back.
"""
from __future__ import annotations

import dataclasses

from jaxbatch.core.plan import SamplingRow, StepPlan


@dataclasses.dataclass
class ForwardedPart:
    """One sampled part of a model call (a mixed call has two): its call and unread outputs."""
    call: object                 # step_inputs.ModelCall
    logits: object               # [rows, V] on device
    hidden: object | None        # a prefill part's hidden states (for prompt logprobs)


@dataclasses.dataclass
class ForwardedStep:
    plan: StepPlan
    next_tokens: dict[int, int]
    parts: list[ForwardedPart]
    started: float               # perf_counter() when its dispatch began

    def sampling_rows(self) -> list[list[SamplingRow | None]]:
        """Each part's sampling rows, in the order `dispatch_sampling` takes their masks."""
        return [part.call.rows for part in self.parts]


class DispatchedStep:
    """A step whose calls are on the device: the plan, and each call's unread outputs."""
    def __init__(self, plan: StepPlan, next_tokens: dict[int, int], pending: list,
                 dispatch_seconds: float):
        self.plan, self.next_tokens, self.pending = plan, next_tokens, pending
        self.dispatch_seconds = dispatch_seconds
