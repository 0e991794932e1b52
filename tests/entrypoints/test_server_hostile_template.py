"""Request chat templates with --trust-request-chat-template (issue 26): honoured, but a hostile
one is stopped by time, output-size and memory limits in a killable child process, while
every other request (token ids, /tokenize, chat) keeps being answered and RSS stays flat."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "4", "--max-model-len", "256", "--no-warmup",
                        "--trust-request-chat-template")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def chat(server, **extra):
    return httpx.post(server.base + "/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 4, "temperature": 0, **extra})


def test_a_request_template_is_honoured(server):
    r = chat(server, chat_template=TEMPLATE)
    assert r.status_code == 200, r.text
    text = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\n")
    ids = httpx.post(server.base + "/tokenize", timeout=30, json={
        "prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # Not the model's own template (that one adds a system prompt).
    assert chat(server).json()["usage"]["prompt_tokens"] > len(ids)


def test_a_looping_template_does_not_block_anyone(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
            bomb = asyncio.ensure_future(c.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 2, "chat_template": LOOP}))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            tok = await c.post("/tokenize", json={"prompt": "hello"})
            ids = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            other = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            health = await c.get("/health")
            others = time.monotonic() - t0
            return await bomb, tok, ids, other, health, others
    t0 = time.monotonic()
    bomb, tok, ids, other, health, others = asyncio.run(main())
    assert bomb.status_code == 400 and bomb.json()["error"]["param"] == "chat_template"
    assert "longer than" in bomb.json()["error"]["message"]
    assert time.monotonic() - t0 < 15
    assert [r.status_code for r in (tok, ids, other, health)] == [200] * 4
    assert others < 10
    assert chat(server).status_code == 200 and httpx.get(server.base + "/health").status_code == 200


@pytest.mark.parametrize("template,why", [('{{ "ab " * 7000000 }}', "characters"),
                                          ('{{ "ab " * 700000000 }}', "memory")])
def test_a_huge_template_output_is_refused_and_rss_stays_flat(server, template, why):
    before = rss_mb(server.proc.pid)
    t0 = time.monotonic()
    r = chat(server, chat_template=template)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10
    assert rss_mb(server.proc.pid) - before < 200
    assert chat(server).status_code == 200
