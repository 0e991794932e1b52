"""Scheduling policies as sort keys: lower is served first, highest is preempted first.
Pure Python."""
from __future__ import annotations

from jaxbatch.core.request import Sequence


def policy_key(policy: str, seq: Sequence, step: int, aging_tokens_per_step: float):
    arrival = (seq.arrival_time, seq.seq_id)
    if policy == "fcfs":
        return arrival
    if policy == "priority":
        # vLLM convention: a smaller priority value is served first.
        return (seq.priority,) + arrival
    if policy == "shortest_prompt_first":
        # Aging in steps, not seconds, keeps schedules reproducible; the key falls without bound
        # while a request waits, so no request starves.
        waited = step - seq.arrival_step
        return (seq.num_prompt_tokens - aging_tokens_per_step * waited,) + arrival
    raise ValueError(f"unknown scheduling policy {policy!r}")
