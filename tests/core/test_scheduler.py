"""The Scheduler driven directly with fake step results: no model, no JAX.

`Sim` (tests/helpers/scheduler_sim.py) plays the engine and checks the scheduler's state
against invariants after every step.
"""
from __future__ import annotations

import random
from typing import Callable

import pytest

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import SampledToken, StepPlan, StepResult
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from scheduler_sim import (EOS, FILLER, Sim, assert_drained, check_plan, check_scheduler,  # noqa: F401
                           chunks_of, first_scheduled_step)

def test_continuous_admits_into_a_freed_slot_at_the_next_step():
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32)
    short = sim.add(max_tokens=1)
    long = sim.add(max_tokens=6)
    late = sim.add(max_tokens=2)
    sim.step()                                    # both prefill; `short` finishes at once
    assert short.status is SequenceStatus.FINISHED_LENGTH and short.slot is None
    assert late in sim.sched.waiting
    plan = sim.step()
    assert late.seq_id in {c.seq_id for c in plan.prefills}
    assert late.slot == 0                        # the slot `short` left
    assert long.seq_id in {d.seq_id for d in plan.decodes}
    sim.run()


MIXED_MAX_TOKENS = [1, 12, 2, 12, 1, 12, 3, 12, 2, 1, 12, 1]


def _mixed(batching: str) -> Sim:
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32, batching=batching)
    for n in MIXED_MAX_TOKENS:
        sim.add(prompt_len=5, max_tokens=n)
    return sim


def test_continuous_keeps_slots_full_whenever_work_waits():
    sim = _mixed("continuous")
    sim.run()
    # With blocks to spare, no slot stays empty at any step while a request waits.
    assert all(waiting == 0 or free == 0 for waiting, free in sim.after_admit)
    assert any(waiting for waiting, _ in sim.after_admit)


def test_static_admits_a_new_group_only_when_the_whole_group_finished():
    sim = _mixed("static")
    groups = []
    while sim.sched.has_unfinished():
        running_before = {s.seq_id for s in sim.sched.running}
        seen_before = set(first_scheduled_step(sim))
        sim.step()
        admitted = sim.scheduled_ids(sim.plans[-1]) - seen_before
        if admitted:
            assert not running_before, "static batching admitted into a running group"
            groups.append(sorted(admitted))
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert_drained(sim.sched)


def test_static_takes_more_steps_than_continuous_on_mixed_lengths():
    static = _mixed("static").run()
    continuous = _mixed("continuous").run()
    # Static: each group of 4 runs as long as its longest member (12 tokens) -> 3 * 12 steps.
    assert static == 36
    assert continuous < static
    assert continuous <= 27


# ---- token budget, decodes first, chunked prefill ----------------------------------------------
def test_long_prompt_is_chunked_while_others_decode_every_step():
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8)
    a = sim.add(prompt_len=3, max_tokens=20)
    b = sim.add(prompt_len=3, max_tokens=20)
    sim.step()
    long = sim.add(prompt_len=37, max_tokens=3)
    while long.num_output_tokens == 0:
        plan = sim.step()
        assert {d.seq_id for d in plan.decodes} == {a.seq_id, b.seq_id}
    assert chunks_of(sim, long.seq_id) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)]
    samples = [c.sample for p in sim.plans for c in p.prefills if c.seq_id == long.seq_id]
    assert samples == [False, False, False, False, True]
    assert len(sim.plans) == 1 + 5                # one chunk per step, no step lost
    sim.run()


def test_decodes_come_before_a_prefill_the_policy_prefers():
    # A budget too small for a full decode batch beside a chunk is refused up front ...
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Sim(max_num_seqs=5, max_num_batched_tokens=11, prefill_chunk_size=8)
    # ... and at the smallest valid budget (4 decodes + one chunk of 8), two long prompts that
    # the policy prefers (earlier arrival) share what the decodes leave: one chunk per step.
    sim = Sim(max_num_seqs=6, max_num_batched_tokens=13, prefill_chunk_size=8)
    decoders = [sim.add(prompt_len=2, max_tokens=6, arrival=10 + i) for i in range(4)]
    sim.step()
    long = sim.add(prompt_len=20, max_tokens=2, arrival=0)
    other = sim.add(prompt_len=20, max_tokens=2, arrival=1)
    for _ in range(2):
        plan = sim.step()
        assert {d.seq_id for d in plan.decodes} == {s.seq_id for s in decoders}
        assert [c.seq_id for c in plan.prefills] == [long.seq_id] and plan.num_tokens == 4 + 8
    sim.run()
    assert chunks_of(sim, long.seq_id) == [(0, 8), (8, 8), (16, 4)]
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in decoders)
    assert chunks_of(sim, long.seq_id) == [(0, 8), (8, 8), (16, 4)]


def test_budget_is_respected_and_spent_on_prefill_in_policy_order():
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=12, prefill_chunk_size=8)
    long = sim.add(prompt_len=40, max_tokens=2)
    shorts = [sim.add(prompt_len=2, max_tokens=5) for _ in range(3)]
    plan = sim.step()
    # long takes 8, two shorts take 2 each, the third no longer fits.
    assert [(c.seq_id, len(c.token_ids)) for c in plan.prefills] == \
        [(long.seq_id, 8), (shorts[0].seq_id, 2), (shorts[1].seq_id, 2)]
    assert plan.num_tokens == 12
    sim.run()                                     # check_plan asserts the budget every step
    assert max(p.num_tokens for p in sim.plans) <= 12


def test_chunk_boundaries_do_not_depend_on_other_requests():
    def boundaries(crowd: bool) -> list[tuple[int, int]]:
        sim = Sim(max_num_seqs=6, max_num_batched_tokens=20, prefill_chunk_size=8,
                  scheduling_policy="shortest_prompt_first")
        if crowd:
            for i in range(5):
                sim.add(prompt_len=3 + 2 * i, max_tokens=3 + i)
        target = sim.add(prompt_len=45, max_tokens=2, arrival=100)
        for step in range(40):
            if crowd and step % 3 == 0:
                sim.add(prompt_len=1 + step % 7, max_tokens=4)
            if sim.sched.has_unfinished():
                sim.step()
        sim.run()
        assert target.num_preemptions == 0
        return chunks_of(sim, target.seq_id)

    alone = boundaries(False)
    assert alone == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 5)]
    assert boundaries(True) == alone


# ---- policies ------------------------------------------------------------------------------------
def _service_order(policy: str, specs: list[dict]) -> list[int]:
    sim = Sim(max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64,
              scheduling_policy=policy, aging_tokens_per_step=0.0)
    for spec in specs:
        sim.add(max_tokens=1, **spec)
    sim.run()
    first = first_scheduled_step(sim)
    return sorted(first, key=first.get)


def test_fcfs_serves_by_arrival_time():
    specs = [dict(arrival=3.0), dict(arrival=1.0), dict(arrival=2.0), dict(arrival=1.0)]
    assert _service_order("fcfs", specs) == [1, 3, 2, 0]   # ties: lower seq_id first


def test_priority_serves_lower_value_first_then_arrival():
    specs = [dict(priority=2, arrival=0), dict(priority=0, arrival=5), dict(priority=1, arrival=1),
             dict(priority=0, arrival=2)]
    assert _service_order("priority", specs) == [3, 1, 2, 0]
    assert _service_order("fcfs", specs) == [0, 2, 3, 1]


def test_shortest_prompt_first_serves_short_prompts_first():
    specs = [dict(prompt_len=30, arrival=0), dict(prompt_len=5, arrival=1),
             dict(prompt_len=12, arrival=2), dict(prompt_len=5, arrival=3)]
    assert _service_order("shortest_prompt_first", specs) == [1, 3, 2, 0]


def _long_prompt_wait(aging: float, steps: int = 60) -> int | None:
    """A 64-token prompt competes with a new 4-token prompt arriving every step; returns the
    step at which the long prompt is first scheduled, or None."""
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=80, prefill_chunk_size=64,
              scheduling_policy="shortest_prompt_first", aging_tokens_per_step=aging)
    sim.add(prompt_len=4, max_tokens=2)
    sim.add(prompt_len=4, max_tokens=2)
    long = sim.add(prompt_len=64, max_tokens=2)
    for step in range(steps):
        sim.add(prompt_len=4, max_tokens=2)
        sim.step()
        if long.num_computed_tokens or long.is_finished:
            return step
    return None


def test_aging_prevents_starvation_of_a_long_prompt():
    assert _long_prompt_wait(aging=0.0) is None      # without aging: starved by the stream
    waited = _long_prompt_wait(aging=4.0)
    assert waited is not None and waited <= 30       # (64 - 4) / 4 = 15 steps of aging, plus slack


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


# ---- preemption ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, victim_index", [("fcfs", 2), ("priority", 1)])
def test_preemption_picks_the_policys_worst_and_recomputes(policy, victim_index):
    # 3 usable blocks of 4 tokens. A (prompt 3) needs a second block at its 5th token; B and C
    # (prompt 2) still fit in one. fcfs evicts the latest arrival (C); priority the largest
    # priority value (B, priority 2).
    sim = Sim(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=8, num_blocks=4,
              block_size=4, scheduling_policy=policy)
    a = sim.add(prompt_len=3, max_tokens=4, priority=0)
    b = sim.add(prompt_len=2, max_tokens=3, priority=2)
    c = sim.add(prompt_len=2, max_tokens=3, priority=1)
    victim = [a, b, c][victim_index]
    survivor = [b, c][1 - (victim_index - 1)]
    sim.step()                                   # prefill all three
    sim.step()                                   # first decode: all fit
    assert sim.sched.num_preemptions == 0
    computed_before = victim.num_computed_tokens
    outputs_before = list(victim.output_token_ids)
    plan = sim.step()                            # A needs a block: the victim goes
    assert computed_before > 0
    assert victim.status is SequenceStatus.WAITING and victim in sim.sched.waiting
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert victim.slot is None and sim.sched.blocks.block_table(victim.seq_id) == []
    assert victim.output_token_ids == outputs_before      # tokens kept, KV dropped
    assert {d.seq_id for d in plan.decodes} == {a.seq_id, survivor.seq_id}
    assert survivor.num_preemptions == 0 and survivor.num_output_tokens == 3
    assert a.num_preemptions == 0 and len(sim.sched.blocks.block_table(a.seq_id)) == 2
    assert sim.sched.num_preemptions == 1
    sim.run()
    # The victim recomputed prompt + outputs in a prefill, then finished normally.
    recompute = [c for p in sim.plans[3:] for c in p.prefills if c.seq_id == victim.seq_id]
    assert recompute and recompute[0].start == 0
    assert recompute[0].token_ids == victim.prompt_token_ids + outputs_before
    for s in (a, b, c):
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == s.params.max_tokens


def test_admission_does_not_take_blocks_running_sequences_need():
    # 2 usable blocks; the running sequence needs its second block next step, so a waiting one
    # is not admitted just to be preempted.
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8, num_blocks=3,
              block_size=4)
    a = sim.add(prompt_len=4, max_tokens=3)
    b = sim.add(prompt_len=3, max_tokens=1)
    sim.step()
    assert b in sim.sched.waiting
    sim.run()
    assert sim.sched.num_preemptions == 0


def test_preemption_under_pressure_completes_everything():
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16, num_blocks=9,
              block_size=4)
    seqs = [sim.add(prompt_len=5 + i, max_tokens=12) for i in range(6)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 for s in seqs)


# ---- stops in update -----------------------------------------------------------------------------
def _run_one(choose=lambda seq: FILLER, eos=(EOS,), max_model_len=256, **params) -> Sequence:
    sim = Sim(eos=eos, max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_size=16,
              max_model_len=max_model_len)
    seq = sim.add(prompt_len=5, **params)
    sim.run(choose=choose)
    seq.rows = sim.rows[seq.seq_id]
    return seq


def emit(tokens):
    """A chooser that emits `tokens` in order, then FILLER."""
    return lambda seq: tokens[seq.num_output_tokens] if seq.num_output_tokens < len(tokens) else FILLER


def test_eos_stops_and_is_kept_in_the_output():
    seq = _run_one(emit([5, 6, EOS, 8]), max_tokens=10)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.finish_reason == "stop"
    assert seq.output_token_ids == [5, 6, EOS] and seq.stop_reason is None
    assert seq.finished_time is not None


def test_any_of_several_eos_ids_stops():
    seq = _run_one(emit([5, 99]), eos=(EOS, 99), max_tokens=10)
    assert seq.output_token_ids == [5, 99] and seq.status is SequenceStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    seq = _run_one(lambda s: EOS, ignore_eos=True, max_tokens=5)
    assert seq.output_token_ids == [EOS] * 5
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"


def test_stop_token_id_stops_with_it_as_stop_reason():
    seq = _run_one(emit([5, 9, 11]), stop_token_ids=[11, 9], max_tokens=10)
    assert seq.output_token_ids == [5, 9]
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 9


def test_stop_token_ids_still_apply_with_ignore_eos():
    seq = _run_one(emit([EOS, 9]), stop_token_ids=[9], ignore_eos=True, max_tokens=10)
    assert seq.output_token_ids == [EOS, 9] and seq.stop_reason == 9


def test_max_tokens_gives_exactly_that_many():
    seq = _run_one(max_tokens=3)
    assert seq.output_token_ids == [FILLER] * 3
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.stop_reason is None


def test_min_tokens_defers_stops_and_bans_them_meanwhile():
    seq = _run_one(lambda s: EOS, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert seq.output_token_ids == [EOS] * 3      # EOS at tokens 1 and 2 did not stop
    assert seq.status is SequenceStatus.FINISHED_STOPPED
    # Banned while fewer than 3 tokens were generated before the one being sampled (as vLLM).
    assert [sorted(r.banned_token_ids) for r in seq.rows] == [[EOS, 9]] * 3
    seq = _run_one(emit([5, 6, 8, EOS]), min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert seq.output_token_ids == [5, 6, 8, EOS]
    assert [sorted(r.banned_token_ids) for r in seq.rows] == [[EOS, 9]] * 3 + [[]]


def test_min_tokens_with_stop_token_id():
    seq = _run_one(lambda s: 9, min_tokens=2, stop_token_ids=[9], max_tokens=10)
    assert seq.output_token_ids == [9, 9] and seq.stop_reason == 9


def test_min_tokens_with_ignore_eos_does_not_ban_eos():
    seq = _run_one(min_tokens=2, stop_token_ids=[9], ignore_eos=True, max_tokens=3)
    assert [sorted(r.banned_token_ids) for r in seq.rows] == [[9], [9], []]


def test_max_model_len_caps_the_sequence():
    seq = _run_one(max_model_len=9, max_tokens=None)
    assert seq.num_tokens == 9 and seq.num_output_tokens == 4
    assert seq.status is SequenceStatus.FINISHED_LENGTH


def test_sampling_rows_carry_the_params_and_penalty_history():
    seq = _run_one(emit([5, 6, 8]), max_tokens=3, temperature=0.5, top_k=3, top_p=0.9,
                   min_p=0.1, presence_penalty=0.5, logprobs=2)
    rows = seq.rows
    assert [r.position for r in rows] == [5, 6, 7]
    assert all((r.temperature, r.top_k, r.top_p, r.min_p, r.logprobs, r.seed) ==
               (0.5, 3, 0.9, 0.1, 2, seq.seed) for r in rows)
    assert rows[2].history == seq.prompt_token_ids + [5, 6]
    assert rows[0].num_prompt_tokens == 5
    plain = _run_one(max_tokens=2)
    assert all(r.history == [] for r in plain.rows)   # no penalties: no history shipped


def test_logprobs_are_recorded_with_the_sampled_token():
    sim = Sim(max_num_seqs=1, max_num_batched_tokens=16, prefill_chunk_size=8)
    seq = sim.add(max_tokens=1, logprobs=1)
    plan = sim.sched.schedule()
    result = StepResult({seq.seq_id: SampledToken(4, -0.25, {3: -0.1, 4: -0.25, 8: -3.0})}, {})
    advanced = sim.sched.update(plan, result, sim.seqs)
    assert advanced == [seq]
    assert seq.output_logprobs == [{3: -0.1, 4: -0.25}]
    assert seq.first_token_time is not None and seq.last_token_time is not None
    assert_drained(sim.sched)


def test_finishing_frees_slot_and_blocks_at_once():
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_size=16)
    a = sim.add(prompt_len=9, max_tokens=10)
    b = sim.add(prompt_len=9, max_tokens=10)
    sim.step()                                    # admit both: a gets slot 0
    slot = a.slot
    sim.step(lambda s: EOS if s is a else FILLER)
    assert a.is_finished and sim.sched.blocks.block_table(a.seq_id) == []
    assert a.slot is None and sim.sched.free_slots == [slot]
    assert b.status is SequenceStatus.RUNNING
    in_use = sim.sched.blocks.num_total_blocks - sim.sched.blocks.num_free_blocks
    assert in_use == len(sim.sched.blocks.block_table(b.seq_id)) == 3
    sim.run()


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_waiting_and_running_sequences():
    sim = Sim(max_num_seqs=1, max_num_batched_tokens=16, prefill_chunk_size=8)
    a = sim.add(max_tokens=10)
    b = sim.add(max_tokens=10)
    sim.step()
    sim.sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert b not in sim.sched.waiting and b.finish_reason == "abort"
    sim.sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort"
    assert_drained(sim.sched)


# ---- random workloads ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_invariants(seed):
    rng = random.Random(seed)
    max_num_seqs = rng.choice([1, 2, 4, 6])
    block_size = rng.choice([1, 2, 4, 8])
    chunk = rng.choice([2, 4, 8, 16])
    num_blocks = rng.randint(6, 40)
    capacity = (num_blocks - 1) * block_size
    sim = Sim(max_num_seqs=max_num_seqs, block_size=block_size, num_blocks=num_blocks,
              prefill_chunk_size=chunk,
              max_num_batched_tokens=max_num_seqs - 1 + chunk + rng.randint(0, 8),
              # never outgrow the pool: see test_sequence_outgrowing_the_pool_still_finishes
              max_model_len=min(capacity, rng.choice([16, 32, 64])),
              scheduling_policy=rng.choice(["fcfs", "priority", "shortest_prompt_first"]),
              batching=rng.choice(["continuous", "continuous", "static"]))
    max_len = sim.config.max_model_len

    def add():
        prompt_len = rng.randint(1, min(max_len - 1, 30))
        kw = dict(max_tokens=rng.choice([None, 1, 3, 10, 40]), ignore_eos=rng.random() < 0.2)
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randint(3, 12)]
        if rng.random() < 0.2 and kw["max_tokens"]:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        sim.add(prompt_len=prompt_len, priority=rng.randint(0, 3), arrival=rng.random() * 10, **kw)

    def choose(seq):
        return EOS if rng.random() < 0.05 else rng.randint(3, 60)

    for _ in range(rng.randint(3, 12)):
        add()
    for step in range(400):
        if not sim.sched.has_unfinished() and step > 60:
            break
        if step < 60 and rng.random() < 0.3:
            add()
        live = sim.sched.running + sim.sched.waiting
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sim.sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
            assert victim.finish_reason == "abort"
            check_scheduler(sim.sched)
        if sim.sched.has_unfinished():
            sim.step(choose)
        for s in sim.seqs.values():
            p = s.params
            assert s.num_tokens <= max_len
            assert p.max_tokens is None or s.num_output_tokens <= p.max_tokens
            if s.status is SequenceStatus.FINISHED_STOPPED:
                assert s.num_output_tokens >= p.min_tokens
                last = s.output_token_ids[-1]
                assert (last == EOS and not p.ignore_eos) or last in p.stop_token_ids
            elif s.status is SequenceStatus.FINISHED_LENGTH:
                assert s.num_output_tokens == p.max_tokens or s.num_tokens == max_len
    assert not sim.sched.has_unfinished(), "work left after 400 steps"
    assert_drained(sim.sched)
    assert all(s.is_finished for s in sim.seqs.values())


# ---- configurations that could stall -----------------------------------------------------------
def test_sequence_outgrowing_the_pool_still_finishes():
    # A pool that cannot hold one max_model_len sequence is refused up front ...
    with pytest.raises(ValueError, match="num_blocks"):
        Sim(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8, num_blocks=3,
            block_size=4, max_model_len=64)
    # ... and with the smallest pool that can, a growing sequence preempts the other and finishes.
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8, num_blocks=7,
              block_size=4, max_model_len=24)
    seq = sim.add(prompt_len=4, max_tokens=20)   # 5 tokens fit; 9 would need a 3rd block
    other = sim.add(prompt_len=2, max_tokens=2)
    for _ in range(50):
        if not sim.sched.has_unfinished():
            break
        sim.step()
    assert other.is_finished
    assert seq.is_finished, (f"stalled: {seq.num_tokens} tokens, status {seq.status}, "
                             f"last plan empty={sim.plans[-1].empty}")


@pytest.mark.parametrize("max_num_seqs, budget, chunk", [(2, 8, 16), (4, 8, 8), (4, 10, 8)])
def test_a_budget_with_no_room_for_a_chunk_beside_a_full_decode_batch_is_refused(
        max_num_seqs, budget, chunk):
    # max_num_seqs - 1 sequences decoding leave budget - (max_num_seqs - 1) tokens: less than a
    # chunk, and a chunk is never split to fit, so a prompt could wait forever.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=\d+: must be >= max_num_seqs - 1"):
        Sim(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, prefill_chunk_size=chunk)
    # One token more and the same settings are accepted.
    Sim(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs - 1 + chunk,
        prefill_chunk_size=chunk)


@pytest.mark.parametrize("max_num_seqs, chunk", [(2, 16), (4, 8), (8, 4)])
def test_long_prompt_gets_a_chunk_every_step_at_the_smallest_budget(max_num_seqs, chunk):
    """The smallest budget the config accepts, and every step a stream of short prompts (3-6
    tokens, so they compete for prefill budget too) refills every free slot: the long prompt,
    first in line, still computes one whole chunk per step and samples its token right after
    its last chunk."""
    sim = Sim(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs - 1 + chunk,
              prefill_chunk_size=chunk)
    long = sim.add(prompt_len=40, max_tokens=1, arrival=0)
    rng = random.Random(max_num_seqs * 100 + chunk)
    steps_needed = -(-40 // chunk)
    for step in range(steps_needed):
        for _ in range(max_num_seqs):
            sim.add(prompt_len=rng.randint(3, 6), max_tokens=rng.randint(2, 5), arrival=1 + step)
        plan = sim.step()
        chunks = [c for c in plan.prefills if c.seq_id == long.seq_id]
        assert len(chunks) == 1 and chunks[0].start == step * chunk, (
            f"step {step}: the long prompt got {chunks} (computed {long.num_computed_tokens})")
    assert long.is_finished and long.num_output_tokens == 1
