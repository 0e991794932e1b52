"""A step passes each room once (issue 54): the engine plans, dispatches the forwards, reads the
previous step, advances the matchers, fills the masks and dispatches sampling, in that order,
and nothing of the engine (collect, Scheduler.update, the matchers) runs while a runner call
is on the stack: the masks reach the runner as data."""
from __future__ import annotations

import functools

import pytest

from jaxbatch import LLM, SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM(loaded=embedded, max_num_seqs=4, max_model_len=256)


def _record(events, inside, obj, name, runner_call=False):
    real = getattr(obj, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        events.append((name, bool(inside)))
        if runner_call:
            inside.append(name)
        try:
            return real(*args, **kwargs)
        finally:
            if runner_call:
                inside.pop()
    setattr(obj, name, wrapper)


def test_a_grammar_step_reads_the_previous_step_between_forward_and_sampling(llm):
    engine = llm.llm_engine
    assert engine.async_scheduling
    events, inside = [], []
    for name in ("dispatch_model_calls", "dispatch_sampling", "collect"):
        _record(events, inside, engine.runner, name, runner_call=True)
    _record(events, inside, engine.scheduler, "update")
    _record(events, inside, engine.structured, "advance")
    _record(events, inside, engine.structured, "fill_bitmask")
    try:
        params = SamplingParams(temperature=0, max_tokens=6,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        llm.generate(["Answer yes or no: is the sky blue?"], params, use_tqdm=False)
    finally:
        for name in ("dispatch_model_calls", "dispatch_sampling", "collect", "update",
                     "advance", "fill_bitmask"):
            for obj in (engine.runner, engine.scheduler, engine.structured):
                obj.__dict__.pop(name, None)
    assert not [e for e in events if e[1]], f"the engine re-entered from a runner call: {events}"
    names = [name for name, _ in events]
    # An overlapped grammar step: its forwards are on the device before the previous step is
    # read, and its sampling is dispatched only once the masks are filled.
    overlapped = ["dispatch_model_calls", "collect", "update", "advance", "fill_bitmask",
                  "dispatch_sampling"]
    assert any(names[i:i + len(overlapped)] == overlapped for i in range(len(names))), names
    assert engine.structured.num_overlapped_fills > 0
