"""The Scheduler driven directly with fake step results (no model, no JAX), for the tests of
the scheduler and of what plugs into it (prefix cache, speculation, overlap).

`Sim` plays the engine: schedule -> (check the plan) -> a token chosen by the test for every
sequence that samples -> update. After every step the scheduler's state is checked against
invariants computed here (slots, block ownership, statuses), not only against its own checks.
"""
from __future__ import annotations

from typing import Callable

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import SampledToken, StepPlan, StepResult
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.sampling_params import SamplingParams

EOS = 2
FILLER = 7          # the token the fake model emits unless a test says otherwise


class Sim:
    def __init__(self, eos=(EOS,), **config):
        config.setdefault("num_blocks", 256)
        config.setdefault("block_size", 4)
        # The largest max_model_len the pool can hold (SchedulerConfig refuses more), at most 256.
        config.setdefault("max_model_len", min(256, (config["num_blocks"] - 1) * config["block_size"]))
        self.config = SchedulerConfig(**config)
        self.sched = Scheduler(self.config, eos)
        self.seqs: dict[int, Sequence] = {}
        self.plans: list[StepPlan] = []
        self.rows: dict[int, list] = {}           # seq_id -> every SamplingRow it was given
        self.after_admit: list[tuple[int, int]] = []   # (waiting, free slots) after schedule()
        self._next_id = 0

    def add(self, prompt_len=4, priority=0, arrival=None, prompt=None, **params) -> Sequence:
        params.setdefault("max_tokens", 4)
        seq_id = self._next_id
        self._next_id += 1
        tokens = list(prompt) if prompt is not None else [10 + (seq_id + i) % 50
                                                            for i in range(prompt_len)]
        seq = Sequence(seq_id, f"req-{seq_id}", 0, tokens, SamplingParams(**params), seed=seq_id,
                       arrival_time=float(seq_id if arrival is None else arrival),
                       arrival_step=0, priority=priority)
        self.seqs[seq_id] = seq
        self.sched.add(seq)
        return seq

    def step(self, choose: Callable[[Sequence], int] = lambda seq: FILLER) -> StepPlan:
        decode_ready = {s.seq_id for s in self.sched.running if s.num_uncomputed_tokens == 1}
        plan = self.sched.schedule()
        self.after_admit.append((len(self.sched.waiting), len(self.sched.free_slots)))
        check_plan(self, plan, decode_ready)
        for sid, row in plan.sampling.items():
            self.rows.setdefault(sid, []).append(row)
        result = StepResult(
            sampled={sid: SampledToken(choose(self.seqs[sid]), -0.5, None) for sid in plan.sampling},
            prompt_logprobs={})
        self.sched.update(plan, result, self.seqs)
        check_scheduler(self.sched)
        self.plans.append(plan)
        return plan

    def run(self, max_steps=500, choose=lambda seq: FILLER) -> int:
        """Steps until nothing is left; returns the number of steps taken."""
        steps = 0
        while self.sched.has_unfinished():
            assert steps < max_steps, "the scheduler stopped making progress"
            self.step(choose)
            steps += 1
        assert_drained(self.sched)
        return steps

    def scheduled_ids(self, plan: StepPlan) -> set[int]:
        return {d.seq_id for d in plan.decodes} | {c.seq_id for c in plan.prefills}


def check_plan(sim: Sim, plan: StepPlan, decode_ready: set[int]) -> None:
    sched, cfg, seqs = sim.sched, sim.config, sim.seqs
    assert plan.num_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    ids = [d.seq_id for d in plan.decodes] + [c.seq_id for c in plan.prefills]
    assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
    assert len(plan.decodes) <= cfg.max_num_seqs
    slots = [d.slot for d in plan.decodes]
    assert len(slots) == len(set(slots))
    running = {s.seq_id for s in sched.running}
    assert set(ids) <= running, "a sequence that is not running was scheduled"
    # Decodes first: every sequence that was ready to decode and is still running decodes.
    assert decode_ready & running <= {d.seq_id for d in plan.decodes}
    for d in plan.decodes:
        seq = seqs[d.seq_id]
        assert d.slot == seq.slot
        assert d.position == seq.num_computed_tokens == seq.num_tokens - 1
        assert d.token_id == seq.token_at(d.position)
        assert len(d.block_table) >= sched.blocks.blocks_for(d.position + 1)
        assert d.block_table == sched.blocks.block_table(d.seq_id)
    for c in plan.prefills:
        seq = seqs[c.seq_id]
        end = c.start + len(c.token_ids)
        assert 0 < len(c.token_ids) <= cfg.prefill_chunk_size
        assert c.start == seq.num_computed_tokens
        assert c.token_ids == seq.tokens(c.start, end)
        assert c.sample == (end == seq.num_tokens)
        assert len(c.block_table) >= sched.blocks.blocks_for(end)
    sampling = {d.seq_id for d in plan.decodes} | {c.seq_id for c in plan.prefills if c.sample}
    assert set(plan.sampling) == sampling
    for sid, row in plan.sampling.items():
        assert row.seq_id == sid and row.position == seqs[sid].num_tokens


def check_scheduler(sched: Scheduler) -> None:
    cfg, blocks = sched.config, sched.blocks
    blocks.check_invariants()
    slots = [s.slot for s in sched.running]
    assert None not in slots and len(set(slots)) == len(slots)
    assert sorted(slots + sched.free_slots) == list(range(cfg.max_num_seqs)), "a slot was lost"
    assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        table = blocks.block_table(s.seq_id)
        assert len(table) >= blocks.blocks_for(s.num_computed_tokens), "computed KV has no block"
        assert len(table) <= max(1, blocks.blocks_for(s.num_tokens)), "over-allocated"
        assert s.num_computed_tokens < s.num_tokens
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and s.slot is None
        assert blocks.block_table(s.seq_id) == [], "a waiting sequence holds blocks"
        assert s.num_computed_tokens == 0
    # Prefix caching shares blocks between sequences: count each block once.
    in_use = blocks.num_total_blocks - blocks.num_free_blocks
    assert in_use == len({b for s in sched.running for b in blocks.block_table(s.seq_id)}), \
        "blocks held by sequences that are not running"


def assert_drained(sched: Scheduler) -> None:
    assert not sched.waiting and not sched.running and not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == sched.blocks.num_total_blocks
    assert sched.free_slots == list(range(sched.config.max_num_seqs))
    sched.blocks.check_invariants()


def first_scheduled_step(sim: Sim) -> dict[int, int]:
    first: dict[int, int] = {}
    for i, plan in enumerate(sim.plans):
        for sid in sim.scheduled_ids(plan):
            first.setdefault(sid, i)
    return first


def chunks_of(sim: Sim, seq_id: int) -> list[tuple[int, int]]:
    return [(c.start, len(c.token_ids)) for p in sim.plans for c in p.prefills if c.seq_id == seq_id]


# ---- continuous vs static ----------------------------------------------------------------------


def fake_model(tokens: list[int]) -> int:
    """Deterministic and repetitive enough for prompt lookup to be often right, sometimes
    wrong: mostly a cycle of period 5, with a twist every 7th position."""
    n = len(tokens)
    if n % 7 == 0:
        return 3 + (tokens[-1] * 7 + n) % 40
    return tokens[-5] if n >= 5 else 10 + n
