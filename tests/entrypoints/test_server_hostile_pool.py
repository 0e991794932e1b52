"""The tokenizer pool and the template child (issue 26): no single job can hold the tokenizer
path; a job past its deadline is abandoned, its worker replaced, and /health's `stuck()` says
so until the thread is gone; a hostile request template is stopped by time, size and memory
limits in a child process that is killed and replaced."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxbatch.entrypoints.openai.template_render import TemplateError, TemplateRenderer
from jaxbatch.entrypoints.openai.tokenizer_pool import PoolTimeout, TokenizerPool


class Tok:
    """A stand-in tokenizer: each worker must get its own copy."""
    def __init__(self):
        self.uses = 0


def test_a_stuck_job_is_abandoned_and_the_others_keep_going():
    release = threading.Event()

    async def main():
        pool = TokenizerPool(size=2, timeout=0.5)
        pool.start(Tok())
        stuck = asyncio.ensure_future(pool.run(lambda tok: release.wait(30)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        # While one worker is stuck, other jobs still finish at once, on the other worker.
        got = await asyncio.gather(*(pool.run(lambda tok, i=i: (i, id(tok))) for i in range(5)))
        fast = time.monotonic() - t0
        with pytest.raises(PoolTimeout) as info:
            await stuck
        assert info.value.started
        stuck_now = pool.stuck()
        # The replacement keeps 2 usable workers: 2 slow jobs run side by side.
        t1 = time.monotonic()
        await asyncio.gather(*(pool.run(lambda tok: time.sleep(0.3)) for _ in range(2)))
        parallel = time.monotonic() - t1
        release.set()
        for _ in range(100):
            if pool.stuck() == 0:
                break
            await asyncio.sleep(0.02)
        after = pool.stuck()
        pool.shutdown()
        return got, fast, stuck_now, parallel, after, pool.num_replaced
    got, fast, stuck_now, parallel, after, replaced = asyncio.run(main())
    assert [i for i, _ in got] == list(range(5)) and fast < 0.4
    assert stuck_now == 1 and after == 0 and replaced == 1
    assert parallel < 0.55


def test_workers_use_their_own_tokenizer_copy():
    async def main():
        tok = Tok()
        pool = TokenizerPool(size=3, timeout=5)
        pool.start(tok)
        ids = await asyncio.gather(*(pool.run(lambda t: (time.sleep(0.05), id(t))[1])
                                     for _ in range(9)))
        pool.shutdown()
        return tok, set(ids)
    tok, ids = asyncio.run(main())
    assert id(tok) not in ids and len(ids) >= 2


@pytest.fixture(scope="module")
def renderer():
    r = TemplateRenderer(timeout=2.0, max_memory_bytes=256 << 20)
    yield r
    r.close()


@pytest.mark.parametrize("template,why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than"),                                            # time
    ('{{ "ab " * 7000000 }}', "characters"),                   # output size
    ('{{ "ab " * 700000000 }}', "memory"),                     # memory
    ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),  # the sandbox
])
def test_hostile_templates_are_stopped(renderer, template, why):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=why):
        renderer.render(template, {"messages": []}, max_chars=100_000)
    assert time.monotonic() - t0 < 5
    # The next render works (a fresh child if the last one was killed).
    assert renderer.render("{{ messages[0].content }}!", {"messages": [{"content": "hi"}]},
                           100) == "hi!"


def test_health_notices_a_stuck_tokenizer_worker():
    """The app's /health, in process (no model): 503 while an abandoned worker still runs."""
    import httpx

    from jaxbatch.entrypoints.async_llm import READY
    from jaxbatch.entrypoints.openai.app import build_app

    release = threading.Event()

    async def main():
        app = build_app(lambda: None, served_model_name="m")
        app.state.llm.state = READY             # as if the engine were up
        pool = app.state.pre.pool
        pool.timeout = 0.3
        pool.start(Tok())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            before = (await c.get("/health")).status_code
            with pytest.raises(PoolTimeout):
                await pool.run(lambda tok: release.wait(30))
            during = await c.get("/health")
            release.set()
            for _ in range(100):
                if pool.stuck() == 0:
                    break
                await asyncio.sleep(0.02)
            after = (await c.get("/health")).status_code
        pool.shutdown()
        return before, during, after
    before, during, after = asyncio.run(main())
    assert before == 200 and after == 200
    assert during.status_code == 503 and "stuck" in during.json()["error"]["message"]
