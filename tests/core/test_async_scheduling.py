"""Host/device overlap (`async_scheduling`): step n+1 is planned and dispatched while step n
runs, with step n's tokens still on device (PENDING_TOKEN on the host). Outputs must be exactly
those of stepping without overlap, whatever stops, preempts or aborts a sequence meanwhile.

First the scheduler alone, driven like the engine drives it by a fake device that keeps each
slot's last token (as the runner does) and samples from a deterministic fake model; then the
engine on a tiny random model, overlap on vs off."""
from __future__ import annotations

import random

import pytest

from jaxbatch import SamplingParams
from jaxbatch.core.plan import PENDING_TOKEN, SampledToken, StepResult
from jaxbatch.core.request import SequenceStatus
from scheduler_sim import Sim, assert_drained, check_scheduler, fake_model


class OverlapSim(Sim):
    """Steps the way LLMEngine.step does with overlap: schedule n+1, "dispatch" it (the fake
    device computes its tokens now, reading pending tokens from its per-slot store), then apply
    step n's results, then mark n+1 dispatched. `overlap=False` applies each step at once."""

    def __init__(self, overlap: bool, **config):
        super().__init__(**config)
        self.overlap = overlap
        self.kept: dict[int, int] = {}          # the device's token per slot
        self.in_flight = None
        self.num_overlapped = 0

    def _device(self, plan) -> StepResult:
        sampled = {}
        for d in plan.decodes:
            if d.token_id == PENDING_TOKEN:
                # The host's copy ends with the placeholder; the device has the real token.
                assert self.seqs[d.seq_id].output_token_ids[-1] == PENDING_TOKEN
        for sid in plan.sampling:
            seq = self.seqs[sid]
            tokens = seq.prompt_token_ids + seq.output_token_ids
            if tokens[-1] == PENDING_TOKEN:
                tokens[-1] = self.kept[seq.slot]
            assert PENDING_TOKEN not in tokens, "a pending token that is not the last"
            token = fake_model(tokens)
            sampled[sid] = SampledToken(token, -0.5, None)
        for sid, s in sampled.items():
            self.kept[self.seqs[sid].slot] = s.token_id
        return StepResult(sampled, {})

    def step(self, choose=None):
        sched, seqs = self.sched, self.seqs
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None and sched.needs_tokens_to_plan(in_flight[0], seqs):
            sched.update(*in_flight, seqs)
            in_flight = None
        dispatched = None
        if sched.has_unfinished():
            plan = sched.schedule()
            if not plan.empty:
                for c in plan.prefills:
                    assert PENDING_TOKEN not in c.token_ids, "a prefill of an unread token"
                dispatched = (plan, self._device(plan))
                self.plans.append(plan)
                self.num_overlapped += in_flight is not None
        if in_flight is not None:
            sched.update(*in_flight, seqs)
        if dispatched is not None:
            sched.on_dispatched(dispatched[0], seqs)
            if self.overlap:
                self.in_flight = dispatched
            else:
                sched.update(*dispatched, seqs)
        check_scheduler(sched)

    def run(self, max_steps=2000, abort=None):
        steps = 0
        while self.sched.has_unfinished() or self.in_flight is not None:
            assert steps < max_steps, "no progress"
            if abort is not None:
                abort(self)
            self.step()
            steps += 1
        assert_drained(self.sched)
        return steps


def _workload(sim: Sim, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(24):
        max_tokens = rng.randint(1, 30)
        sim.add(prompt_len=rng.randint(1, 40), max_tokens=max_tokens,
                stop_token_ids=rng.sample(range(3, 44), rng.randint(0, 2)),
                min_tokens=min(max_tokens, rng.choice([0, 0, 3])), ignore_eos=True)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks,prefix", [(400, False), (40, True), (28, False)])
def test_overlap_gives_the_tokens_of_stepping_without_it(seed, num_blocks, prefix):
    """Small pools preempt sequences whose token is still on device; prompts share prefixes
    when the cache is on."""
    config = dict(max_num_seqs=6, max_num_batched_tokens=40, prefill_chunk_size=8,
                  num_blocks=num_blocks, enable_prefix_caching=prefix)
    outputs = []
    for overlap in (False, True):
        sim = OverlapSim(overlap, **config)
        _workload(sim, seed)
        steps = sim.run()
        outputs.append({sid: (s.output_token_ids, s.status) for sid, s in sim.seqs.items()})
        if overlap:
            assert sim.num_overlapped > steps // 2
    assert outputs[0] == outputs[1]
    assert all(PENDING_TOKEN not in toks for toks, _ in outputs[1].values())


def test_a_sequence_certain_to_end_is_not_decoded_again():
    sim = OverlapSim(True, max_num_seqs=2, max_num_batched_tokens=32, prefill_chunk_size=16)
    seq = sim.add(prompt_len=5, max_tokens=2, ignore_eos=True)
    sim.run()
    # prefill (token 1), decode (token 2): no third step computing a token to throw away.
    assert len(seq.output_token_ids) == 2 and len(sim.plans) == 2


@pytest.mark.parametrize("seed", range(4))
def test_aborts_while_a_step_is_in_flight_leak_nothing(seed):
    rng = random.Random(seed)
    sim = OverlapSim(True, max_num_seqs=5, max_num_batched_tokens=32, prefill_chunk_size=8,
                     num_blocks=40, enable_prefix_caching=True)
    _workload(sim, seed)

    def abort(sim):
        live = [s for s in sim.seqs.values() if not s.is_finished]
        if live and rng.random() < 0.2:
            seq = rng.choice(live)
            sim.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
            assert PENDING_TOKEN not in seq.output_token_ids

    sim.run(abort=abort)
    assert all(PENDING_TOKEN not in s.output_token_ids for s in sim.seqs.values())


def test_penalties_and_proposers_plan_from_read_tokens():
    sim = OverlapSim(True, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=8)
    sim.add(prompt_len=6, max_tokens=12, ignore_eos=True, repetition_penalty=1.2)
    steps = sim.run()
    assert sim.num_overlapped == 0 and steps > 10


# ---- the engine ---------------------------------------------------------------------------------
SETTINGS = dict(max_num_seqs=6, block_size=4, prefill_chunk_size=16, max_num_batched_tokens=64,
                max_model_len=128)

PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=2, max_tokens=30,
                   ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.4,
                   max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[7, 50, 120], min_tokens=3),
    SamplingParams(temperature=0, max_tokens=9, prompt_logprobs=2),
    SamplingParams(temperature=0.9, n=2, seed=4, max_tokens=15, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1),
]


@pytest.fixture(scope="module")
def engines():
    from engines import tiny_engine
    from tiny_models import make_hf_model
    from jaxbatch.engine.llm_engine import LLMEngine
    model = make_hf_model("llama_untied_gqa2", seed=7)
    # 40 blocks of 4 tokens for 6 slots: the crowd below preempts.
    on = tiny_engine(model, num_blocks=40, async_scheduling=True, **SETTINGS)
    off = LLMEngine(loaded=on.loaded, runner=on.runner, warmup=False, compilation_cache=False,
                    num_blocks=40, async_scheduling=False, **SETTINGS)
    return on, off


def test_engine_overlap_on_equals_off_in_a_crowd_with_preemption(engines):
    import numpy as np
    from engines import result, run_all
    from tiny_models import random_token_prompts
    on, off = engines
    prompts = random_token_prompts(np.random.default_rng(3), [30, 5, 47, 12, 64, 9, 21, 3] * 2)
    params = PARAMS * 2
    before = on.stats()
    got = run_all(on, prompts, params)
    want = run_all(off, prompts, params)
    assert [result(o) for o in got] == [result(o) for o in want]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]
    stats = on.stats()
    assert stats["num_preemptions"] > before["num_preemptions"], "the pool should preempt"
    steps = stats["num_steps"] - before["num_steps"]
    assert stats["num_overlapped_steps"] - before["num_overlapped_steps"] > steps // 2
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert off.stats()["num_overlapped_steps"] == 0


def test_engine_abort_while_in_flight(engines):
    on, _ = engines
    on.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    on.add_request("b", [9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    on.step()
    on.step()
    assert on._in_flight is not None
    on.abort_request("a")
    outs = {}
    while on.has_unfinished_requests():
        for out in on.step():
            outs[out.request_id] = out
    on.step()                                    # collects what is still in flight
    assert outs["a"].outputs[0].finish_reason == "abort"
    assert PENDING_TOKEN not in outs["a"].outputs[0].token_ids
    assert len(outs["b"].outputs[0].token_ids) == 6
    stats = on.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0
