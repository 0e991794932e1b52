"""Data-parallel replicas (jaxbatch/engine/data_parallel.py) on this one-device CPU: the
replicas share the device, which tests routing and equality, not speed-up (the 8-device
check of replicas on their own devices is in tp_checks.py)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.engine.build import build_engine
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.engine.data_parallel import DataParallelEngine
from tp_checks import SETTINGS, model, prompts_of


def _workload(n=24):
    rng = np.random.default_rng(6)
    prompts = prompts_of(rng, rng.integers(2, 60, size=n))
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i, top_p=0.9,
                             max_tokens=int(rng.integers(1, 30)), ignore_eos=True)
              for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def single_outputs():
    prompts, params = _workload()
    llm = LLM(loaded=model(8), **SETTINGS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def replicas():
    """Shared by the tests below (compiling is what costs): every test leaves it idle."""
    return build_engine(loaded=model(8), data_parallel_size=2, **SETTINGS)


def test_two_replicas_give_one_engines_outputs(single_outputs, replicas):
    prompts, params = _workload()
    llm = LLM.from_engine(replicas)
    engine = llm.llm_engine
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == single_outputs
    # Both replicas worked, and each ends with every block free.
    assert all(r.stats()["num_steps"] > 0 for r in engine.replicas)
    stats = engine.stats()
    assert stats["data_parallel_size"] == 2 and stats["outstanding_work"] == [0, 0]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_routing_follows_outstanding_tokens_not_request_counts(replicas):
    engine = replicas
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n)
    engine.add_request("long", list(range(3, 63)), sp(40))      # 60 + 40 tokens -> replica 0
    engine.add_request("short1", [5, 6, 7], sp(4))              # 7 tokens -> replica 1
    engine.add_request("short2", [5, 6, 7], sp(4))              # 1 has 7 < 100 -> replica 1
    assert [engine._routed[r].replica for r in ("long", "short1", "short2")] == [0, 1, 1]
    assert engine.outstanding_work() == [100, 14]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("short1", [5], sp(1))
    engine.abort_request("long")
    finished = {}
    while engine.has_unfinished_requests() or any(r._pending_outputs for r in engine.replicas):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {"long": "abort", "short1": "length", "short2": "length"}
    assert engine.outstanding_work() == [0, 0]


def test_a_prompt_goes_where_its_prefix_is_cached(replicas):
    """Replica 0 served a 70-token prompt (2 chunks of 32 cached). With a short request
    queued there, the same prompt still goes to replica 0: the 64 cached tokens outweigh it."""
    engine = replicas
    engine.reset_prefix_cache()
    prompt = list(range(3, 73))
    sp = SamplingParams(temperature=0, max_tokens=2)

    def drain():
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return done
    engine.add_request("first", prompt, sp)
    assert engine._routed["first"].replica == 0
    drain()
    engine.add_request("busy", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("again", prompt, sp)
    assert [engine._routed[r].replica for r in ("busy", "again")] == [0, 0]
    assert drain()["again"].num_cached_tokens == 64
    engine.add_request("salted", prompt, SamplingParams(temperature=0, max_tokens=2,
                                                        cache_salt="other"))
    assert engine._routed["salted"].replica == 0          # no hit anywhere: least loaded
    drain()


def test_async_server_front_over_replicas(single_outputs, replicas):
    """The server's AsyncLLM drives the replicas as it drives one engine."""
    from jaxbatch.entrypoints.async_llm import AsyncLLM
    prompts, params = _workload()
    prompts, params, expected = prompts[:6], params[:6], single_outputs[:6]

    async def main():
        llm = AsyncLLM(lambda: replicas)
        llm.start()
        await llm.wait_ready(120)

        async def one(p, sp):
            final = None
            async for out in llm.generate(p, sp):
                final = out
            return final.outputs[0].token_ids
        try:
            return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        finally:
            await llm.shutdown()

    assert list(asyncio.run(main())) == expected
