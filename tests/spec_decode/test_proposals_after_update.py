"""Drafts are proposed after the update, never while a step is planned (issue 54): the proposer
(a whole draft engine for draft_model) runs once the step's tokens are applied, as vLLM V1
proposes after sampling, and the next plan carries what it proposed, trimmed to its budget."""
from __future__ import annotations

from jaxbatch import SamplingParams
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import SampledToken, StepResult
from jaxbatch.core.request import Sequence
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.spec_decode.planner import SpeculativePlanner
from jaxbatch.spec_decode.speculative import SpeculativeConfig


class RecordingProposer:
    def __init__(self):
        self.calls = []           # (where it ran, what it was asked)
        self.where = "outside"

    def propose_batch(self, requests, rows=None):
        self.calls.append((self.where, dict(requests)))
        return {sid: [40 + i for i in range(k)] for sid, (_, k) in requests.items()}


def test_the_proposer_runs_in_update_and_the_next_plan_carries_its_drafts():
    proposer = RecordingProposer()
    sched = Scheduler(SchedulerConfig(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=64, prefill_chunk_size=8),
                      speculation=SpeculativePlanner(SpeculativeConfig(num_speculative_tokens=3),
                                                     proposer))
    real_schedule, real_update = sched.schedule, sched.update

    def during(where, real):
        def run(*args):
            proposer.where = where
            try:
                return real(*args)
            finally:
                proposer.where = "outside"
        return run
    sched.schedule, sched.update = during("schedule", real_schedule), during("update", real_update)
    seq = Sequence(0, "r", 0, [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True), 0, 0.0, 0)
    seqs = {0: seq}
    sched.add(seq)
    plan = sched.schedule()                      # the prompt: nothing to propose for yet
    assert proposer.calls == [] and not plan.decodes
    sched.update(plan, StepResult({0: SampledToken(9, -0.1, None)}, {}), seqs)
    assert proposer.calls == [("update", {0: ([5, 6, 7, 9], 3)})]
    plan = sched.schedule()
    assert [d.draft_token_ids for d in plan.decodes] == [[40, 41, 42]]
    assert [r.position for r in plan.draft_sampling[0]] == [5, 6, 7]
    samples = [SampledToken(t, -0.1, None) for t in (41, 7, 3)]      # two proposals accepted
    sched.update(plan, StepResult({0: SampledToken(40, -0.1, None)}, {},
                                  draft_sampled={0: samples}), seqs)
    assert seq.output_token_ids == [9, 40, 41, 7]
    assert [where for where, _ in proposer.calls] == ["update", "update"]
    assert proposer.calls[-1][1] == {0: ([5, 6, 7, 9, 40, 41, 7], 3)}
