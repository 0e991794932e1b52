"""Speculative decoding on the host side, no JAX: the n-gram proposer, and the scheduler driven
by a fake deterministic model (the next token is a function of the tokens so far), so every
verification row's answer is known. With speculation on, every sequence must produce exactly
the tokens it produces with speculation off, whatever stops it."""
from __future__ import annotations

import random

import pytest

from jaxbatch.core.plan import SampledToken, StepResult
from jaxbatch.core.request import SequenceStatus
from jaxbatch.spec_decode.planner import SpeculativePlanner
from jaxbatch.spec_decode.speculative import NgramProposer, SpecCounters, SpeculativeConfig
from scheduler_sim import EOS, Sim, assert_drained, check_plan, check_scheduler, fake_model


# ---- proposer and config -----------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    # Suffix [6, 2, 3] never occurred before; [2, 3] did, last at index 6: 7, 8 followed.
    assert p.propose(tokens, 2) == [7, 8]
    assert p.propose(tokens, 5) == [7, 8, 6, 2, 3]
    assert p.propose([5, 6, 7, 8], 3) == []                      # no earlier occurrence
    assert p.propose([4, 4, 4, 4], 3) == [4]                     # only one token follows
    longest = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    # [1, 2, 3] matches at 0 (-> 10) although [3] alone last matched at 5 (-> 11).
    assert longest.propose([1, 2, 3, 10, 0, 3, 11, 1, 2, 3], 1) == [10]
    assert p.propose([1], 3) == []


@pytest.mark.parametrize("bad", [dict(method="medusa"), dict(num_speculative_tokens=0),
                                 dict(prompt_lookup_min=3, prompt_lookup_max=2),
                                 dict(max_batch_size=0), dict(unknown=1)])
def test_bad_speculative_configs_are_rejected(bad):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(bad)


def test_counters():
    c = SpecCounters()
    c.record(3, 2)
    c.record(2, 0)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (2, 5, 2)
    assert c.accepted_per_position == [1, 1, 0] and c.mean_accepted_length == 2.0


# ---- the scheduler with a fake model ------------------------------------------------------------
class SpecSim(Sim):
    """Sim whose tokens come from `fake_model`: each sampled row sees the sequence's tokens plus
    the proposals before it (what the device computes)."""

    def step(self, choose=None):
        decode_ready = {s.seq_id for s in self.sched.running if s.num_uncomputed_tokens == 1}
        plan = self.sched.schedule()
        check_plan(self, plan, decode_ready)
        drafts = {d.seq_id: d.draft_token_ids for d in plan.decodes}
        sampled, draft_sampled = {}, {}
        for sid in plan.sampling:
            seq = self.seqs[sid]
            tokens = seq.prompt_token_ids + seq.output_token_ids
            sampled[sid] = SampledToken(fake_model(tokens), -0.5, None)
            proposal = drafts.get(sid, [])
            draft_sampled[sid] = [SampledToken(fake_model(tokens + proposal[:i + 1]), -0.5, None)
                                  for i in range(len(proposal))]
            rows = plan.draft_sampling.get(sid, [])
            assert [r.position for r in rows] == [seq.num_tokens + i + 1 for i in range(len(proposal))]
        self.sched.update(plan, StepResult(sampled, {}, draft_sampled=draft_sampled), self.seqs)
        check_scheduler(self.sched)
        self.plans.append(plan)
        return plan


def run_pair(requests, spec: dict | None, **config) -> tuple[dict, "SpecSim"]:
    config.setdefault("max_num_seqs", 4)
    config.setdefault("prefill_chunk_size", 8)
    config.setdefault("max_num_batched_tokens", 64)
    sim = SpecSim(**config)
    if spec is not None:
        sim.sched.speculation = SpeculativePlanner(SpeculativeConfig(**spec))
    seqs = [sim.add(prompt=prompt, **params) for prompt, params in requests]
    sim.run(max_steps=3000)
    return {s.seq_id: (s.output_token_ids, s.status, s.stop_reason) for s in seqs}, sim


def mixed_requests(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(1, 20))]
        params = dict(max_tokens=rng.randint(1, 40))
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(3, 60)]
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randint(0, params["max_tokens"])
        if rng.random() < 0.5:
            params["ignore_eos"] = True
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_speculation_gives_the_tokens_of_plain_decoding(seed):
    requests = mixed_requests(seed, 12)
    plain, _ = run_pair(requests, None)
    spec, sim = run_pair(requests, dict(num_speculative_tokens=4, max_batch_size=4,
                                        prompt_lookup_min=1, prompt_lookup_max=3))
    assert spec == plain
    counters = sim.sched.speculation.counters
    assert counters.num_draft_tokens > 0 and 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    # Fewer steps: accepted proposals are tokens that needed no step of their own.
    assert len(sim.plans) < len(run_pair(requests, None)[1].plans)


def test_stops_inside_an_accepted_run_truncate_there():
    prompt = [5, 6, 7, 8, 9] * 4
    cut_runs = 0     # steps whose accepted run went past the token that stopped the sequence
    for n in range(2, 12):
        params = dict(max_tokens=n)
        for extra in ({}, dict(stop_token_ids=[8]), dict(stop_token_ids=[8], min_tokens=min(4, n)),
                      dict(stop_token_ids=[9, 6])):
            case = {**params, **extra}
            plain, _ = run_pair([(prompt, case)], None, max_model_len=40)
            spec, sim = run_pair([(prompt, case)], dict(num_speculative_tokens=6),
                                 max_model_len=40)
            assert spec == plain, case
            last = [p for p in sim.plans if p.decodes][-1].decodes[0]
            tokens = prompt + spec[0][0]
            if len(tokens) < last.position + 2 + len(last.draft_token_ids):
                cut_runs += tokens[last.position + 1:] == last.draft_token_ids[:len(tokens) - last.position - 1]
    assert cut_runs > 0
    # max_model_len inside a run: the sequence stops at the limit.
    plain, _ = run_pair([(prompt, dict(max_tokens=None, ignore_eos=True))], None, max_model_len=32)
    spec, _ = run_pair([(prompt, dict(max_tokens=None, ignore_eos=True))],
                       dict(num_speculative_tokens=6), max_model_len=32)
    assert spec == plain and len(spec[0][0]) == 32 - len(prompt)


def test_large_batches_and_opted_out_requests_do_not_speculate():
    requests = [([5, 6, 7, 8, 9] * 3, dict(max_tokens=20))] * 3
    _, sim = run_pair(requests, dict(num_speculative_tokens=3, max_batch_size=2))
    for plan in sim.plans:
        if len(plan.decodes) > 2:
            assert not any(d.draft_token_ids for d in plan.decodes)
    _, sim = run_pair([([5, 6, 7, 8, 9] * 3, dict(max_tokens=20, speculate=False))],
                      dict(num_speculative_tokens=3))
    assert sim.sched.speculation.counters.num_drafts == 0


def test_proposals_never_preempt_and_spare_blocks_come_back():
    """A pool so small that proposals often find no free block: they shrink instead of
    preempting; the outputs still match and nothing leaks."""
    requests = mixed_requests(7, 10)
    plain, plain_sim = run_pair(requests, None, num_blocks=24, max_model_len=64, block_size=4)
    spec, sim = run_pair(requests, dict(num_speculative_tokens=5, max_batch_size=4),
                         num_blocks=24, max_model_len=64, block_size=4)
    assert spec == plain
    assert sim.sched.num_preemptions <= plain_sim.sched.num_preemptions
    assert_drained(sim.sched)


def test_speculation_with_prefix_caching_and_preemption():
    requests = [([5, 6, 7, 8, 9] * 6, dict(max_tokens=40, ignore_eos=True))] * 3 + mixed_requests(3, 6)
    kwargs = dict(num_blocks=30, max_model_len=96, block_size=4, enable_prefix_caching=True)
    plain, _ = run_pair(requests, None, **kwargs)
    spec, sim = run_pair(requests, dict(num_speculative_tokens=4), **kwargs)
    assert spec == plain
    assert sim.sched.prefix_cache_hits > 0 and sim.sched.num_preemptions > 0
    assert all(status.finished for _, status, _ in spec.values())
    assert SequenceStatus.FINISHED_ABORTED not in {status for _, status, _ in spec.values()}


def test_serve_flag_parses_speculative_config():
    from jaxbatch.engine.config import engine_kwargs_from_args as engine_kwargs
    from jaxbatch.entrypoints.cli import _parser
    args = _parser().parse_args(["serve", "--speculative-config",
                                 '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 5}
    assert engine_kwargs(_parser().parse_args(["serve"]))["speculative_config"] is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--speculative-config", "[1, 2]"])


def test_metrics_export_spec_counters_as_deltas():
    from jaxbatch.entrypoints.openai.metrics import ServerMetrics
    m = ServerMetrics("m")
    base = dict(num_running=0, num_waiting=0, num_free_blocks=8, num_total_blocks=8,
                num_preemptions=0)
    m.record([], {**base, "spec_num_drafts": 2, "spec_num_draft_tokens": 6,
                  "spec_num_accepted_tokens": 4, "spec_accepted_per_position": [2, 2]}, 0.0)
    m.record([], {**base, "spec_num_drafts": 3, "spec_num_draft_tokens": 9,
                  "spec_num_accepted_tokens": 5, "spec_accepted_per_position": [3, 2, 0]}, 1.0)
    text = m.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0' in text


def test_a_sequence_whose_proposals_fail_backs_off():
    """A model whose next token is pseudo-random over 10 values: prompt lookup always finds
    something to propose and is mostly wrong, so proposing pauses for 1, 2, 4, ... steps after
    each miss; the tokens are unchanged."""
    import test_speculative as me
    original = me.fake_model
    me.fake_model = lambda tokens: 3 + random.Random(len(tokens)).randrange(10)
    try:
        prompt = list(range(3, 13)) * 2
        plain, _ = run_pair([(prompt, dict(max_tokens=80, ignore_eos=True))], None, max_model_len=128)
        spec, sim = run_pair([(prompt, dict(max_tokens=80, ignore_eos=True))],
                             dict(num_speculative_tokens=3, prompt_lookup_min=1), max_model_len=128)
    finally:
        me.fake_model = original
    assert spec == plain
    counters = sim.sched.speculation.counters
    assert counters.num_accepted_tokens < counters.num_draft_tokens / 3
    assert 0 < counters.num_drafts < 80 / 3       # far from one draft per step
