"""AsyncLLM without HTTP: its generate() iterator and abort on the real engine, and its
threading contract (idle blocking, merged deltas, bad requests, a dying engine thread, drain,
admission) on a scripted fake engine that runs in milliseconds."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxbatch import SamplingParams
from jaxbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.entrypoints.async_llm import (DEAD, READY, AsyncLLM, EngineDeadError,
                                          EngineUnavailableError)


class FakeEngine:
    """LLMEngine's interface: one token per step per request; `text` is "a" per token."""

    def __init__(self, step_seconds=0.005, fail_on_step=None):
        self.reqs, self.pending, self.tokenizer = {}, [], None
        self.step_seconds, self.fail_on_step = step_seconds, fail_on_step
        self.num_steps = 0
        self.step_threads = set()

    def add_request(self, rid, prompt, params, priority=0, arrival_time=None, lora_request=None):
        if not prompt or rid in self.reqs:
            raise ValueError(f"bad request {rid!r}")
        self.reqs[rid] = (list(prompt), [], params)

    def abort_request(self, rids):
        for rid in [rids] if isinstance(rids, str) else rids:
            if rid in self.reqs:
                self.pending.append(self._out(rid, *self.reqs.pop(rid), reason="abort"))

    def _out(self, rid, prompt, toks, params, reason=None):
        return RequestOutput(rid, None, prompt, None, [CompletionOutput(
            0, "a" * len(toks), list(toks), None, reason)], reason is not None, RequestMetrics(0.0))

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.step_threads.add(threading.current_thread().name)
        out, self.pending = self.pending, []
        if not self.reqs:
            return out
        self.num_steps += 1
        if self.fail_on_step == self.num_steps:
            raise RuntimeError("boom")
        time.sleep(self.step_seconds)
        for rid, (prompt, toks, params) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= params.max_tokens
            out.append(self._out(rid, prompt, toks, params, "length" if done else None))
            if done:
                del self.reqs[rid]
        return out

    def stats(self):
        return dict(num_running=len(self.reqs), num_waiting=0, num_free_blocks=8,
                    num_total_blocks=8, num_preemptions=0)


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def started(engine, **kw):
    llm = AsyncLLM(lambda: engine, **kw)
    llm.start()
    await llm.wait_ready(10)
    return llm


def test_generate_streams_cumulative_outputs_on_the_engine_thread():
    async def main():
        engine = FakeEngine()
        llm = await started(engine)
        outs = [o async for o in llm.generate([1, 2], SamplingParams(max_tokens=5))]
        await llm.shutdown()
        return outs, engine
    outs, engine = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [7] * 5
    assert all(not o.finished for o in outs[:-1])
    assert engine.step_threads == {"jaxbatch-engine"}     # never the event loop's thread


def test_idle_engine_thread_blocks_instead_of_spinning():
    async def main():
        engine = FakeEngine()
        llm = await started(engine)
        _ = [o async for o in llm.generate([1], SamplingParams(max_tokens=2))]
        calls = []
        orig = engine.step
        engine.step = lambda: calls.append(1) or orig()
        await asyncio.sleep(0.5)
        idle_calls = len(calls)
        _ = [o async for o in llm.generate([1], SamplingParams(max_tokens=2))]
        await llm.shutdown()
        return idle_calls, len(calls)
    idle_calls, total = run(main())
    assert idle_calls == 0 and total >= 2


def test_slow_reader_gets_merged_deltas_and_the_final_output():
    async def main():
        llm = await started(FakeEngine(step_seconds=0.001))
        seen = []
        async for out in llm.generate([1], SamplingParams(max_tokens=200)):
            seen.append(out)
            await asyncio.sleep(0.02)       # far slower than the engine
        await llm.shutdown()
        return seen
    seen = run(main())
    assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 200
    assert len(seen) < 100                  # merged: not one item per step piled up
    texts = [o.outputs[0].text for o in seen]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_bad_request_is_a_value_error_and_the_thread_lives_on():
    async def main():
        llm = await started(FakeEngine())
        with pytest.raises(ValueError):
            async for _ in llm.generate([], SamplingParams(max_tokens=2)):
                pass
        outs = [o async for o in llm.generate([3], SamplingParams(max_tokens=3))]
        state = llm.state
        await llm.shutdown()
        return outs, state
    outs, state = run(main())
    assert outs[-1].finished and state == READY


def test_engine_thread_death_fails_callers_and_marks_dead():
    async def main():
        llm = await started(FakeEngine(fail_on_step=3))
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate([1], SamplingParams(max_tokens=10)):
                pass
        assert llm.state == DEAD and not llm.healthy
        with pytest.raises(EngineDeadError):
            llm.admit()
        with pytest.raises(EngineDeadError):
            await llm.add_request("x", [1], SamplingParams())
    run(main())


def test_breaking_out_or_cancelling_aborts():
    async def main():
        engine = FakeEngine(step_seconds=0.01)
        llm = await started(engine)
        async for out in llm.generate([1], SamplingParams(max_tokens=1000), request_id="a"):
            break
        task = asyncio.ensure_future(_consume(llm.generate([1], SamplingParams(max_tokens=1000),
                                                           request_id="b")))
        await asyncio.sleep(0.1)
        task.cancel()
        for _ in range(100):
            if not engine.reqs and not llm._mailboxes:
                break
            await asyncio.sleep(0.01)
        left = dict(engine.reqs)
        await llm.shutdown()
        return left
    assert run(main()) == {}


async def _consume(agen):
    async for _ in agen:
        pass


def test_admission_cap_and_drain():
    async def main():
        engine = FakeEngine(step_seconds=0.01)
        llm = await started(engine, max_queued_requests=2)
        t1, t2 = llm.admit(), llm.admit()
        with pytest.raises(EngineUnavailableError):
            llm.admit()
        t1.release()
        t1.release()                         # idempotent
        t3 = llm.admit()
        stream = await llm.add_request("long", [1], SamplingParams(max_tokens=10_000))
        t2.release()
        t3.release()
        consumer = asyncio.ensure_future(_last(stream))
        t0 = time.monotonic()
        await llm.drain(0.3)                 # cannot finish in time: aborted after 0.3 s
        waited = time.monotonic() - t0
        with pytest.raises(EngineUnavailableError):
            llm.admit()
        last = await consumer
        await llm.shutdown()
        return last, waited
    last, waited = run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0.25 < waited < 5


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


# ---- the real engine ------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_on_the_real_engine_matches_offline_and_abort_frees_blocks(embedded):
    from jaxbatch import LLM, LLMEngine
    kw = dict(max_num_seqs=4, max_model_len=256, warmup=False)
    offline_engine = LLMEngine(loaded=embedded, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = LLM.from_engine(offline_engine).generate("The capital of France is", greedy,
                                                    use_tqdm=False)[0]

    async def main():
        llm = await started(LLMEngine(loaded=embedded, runner=offline_engine.runner, **kw))
        outs = [o async for o in llm.generate("The capital of France is", greedy)]
        with pytest.raises(ValueError):     # too long for max_model_len: the engine says no
            await llm.add_request("long", list(range(300)), greedy)
        async for _ in llm.generate("Tell me a story", SamplingParams(max_tokens=200)):
            break                           # leaves after the first token: aborted
        for _ in range(200):
            s = llm.stats
            if s["num_running"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
                break
            await asyncio.sleep(0.02)
        await llm.shutdown()
        return outs, s
    outs, stats = run(main(), timeout=600)
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[-1].outputs[0].text == want.outputs[0].text
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
