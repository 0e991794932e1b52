"""The OpenAI-compatible server end to end: one `jaxbatch serve` subprocess for the module,
called through the official `openai` client and raw HTTP (SSE framing, errors, disconnects)."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from server_utils import (MODEL, ServerProcess, idle, metric, metrics, raw_post, read_until,
                          sse_events, wait_for)

pytestmark = pytest.mark.slow
SETTINGS = ["--max-num-seqs", "16", "--max-model-len", "512", "--seed", "0"]
ENGINE_KW = dict(max_num_seqs=16, max_model_len=512, seed=0)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*SETTINGS)      # warmed up, as served: nothing may compile later
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline():
    from jaxbatch import LLM
    return LLM(warmup=False, **ENGINE_KW)


def call(server, fn, timeout=300):
    """Runs `await fn(client)` with a fresh AsyncOpenAI client (each bound to its own loop)."""
    async def go():
        async with AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                               timeout=timeout) as c:
            return await asyncio.wait_for(fn(c), timeout)
    return asyncio.run(go())


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
PROMPTS = ["Once upon a time", "The three primary colors are"]


def test_models_version_health(server):
    models = call(server, lambda c: c.models.list())
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base + "/version").json()["version"]
    assert httpx.get(server.base + "/health").status_code == 200
    assert server.health_seen[0] == 503, "the port should answer (503) before the engine is ready"


def test_greedy_outputs_equal_offline_token_for_token(server, offline):
    from jaxbatch import SamplingParams
    tok = offline.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=24)
    for conv in CONVERSATIONS:
        want = offline.chat(conv, greedy, use_tqdm=False)[0].outputs[0]
        got = call(server, lambda c: c.chat.completions.create(
            model=MODEL, messages=conv, temperature=0, max_tokens=24, logprobs=True, top_logprobs=0))
        choice = got.choices[0]
        assert choice.message.content == want.text
        assert [e.token for e in choice.logprobs.content] == [tok.decode([t]) for t in want.token_ids]
        assert got.usage.completion_tokens == len(want.token_ids)
        assert choice.finish_reason == want.finish_reason
    for prompt in PROMPTS:
        want = offline.generate(prompt, greedy, use_tqdm=False)[0]
        got = call(server, lambda c: c.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=24, logprobs=0))
        choice = got.choices[0]
        assert choice.text == want.outputs[0].text
        assert choice.logprobs.tokens == [tok.decode([t]) for t in want.outputs[0].token_ids]
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_64_concurrent_streams_equal_non_streamed(server):
    prompts = [[{"role": "user", "content": f"Write one sentence about the number {i}."}]
               for i in range(64)]

    async def streamed(c, i):
        extra = {"stream_options": {"include_usage": True}} if i % 2 == 0 else {}
        stream = await c.chat.completions.create(model=MODEL, messages=prompts[i], temperature=0,
                                                 max_tokens=10, stream=True, **extra)
        text, usages, finishes, after_finish = "", [], [], 0
        async for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk.usage)
                assert chunk.choices == []
            for ch in chunk.choices:
                after_finish += bool(finishes)
                text += ch.delta.content or ""
                if ch.finish_reason is not None:
                    finishes.append(ch.finish_reason)
        return text, usages, finishes, after_finish

    async def plain(c, i):
        r = await c.chat.completions.create(model=MODEL, messages=prompts[i], temperature=0,
                                            max_tokens=10)
        return r.choices[0].message.content, r.usage

    async def both(c):
        s = await asyncio.gather(*(streamed(c, i) for i in range(64)))
        p = await asyncio.gather(*(plain(c, i) for i in range(64)))
        return s, p

    streams, plains = call(server, both, timeout=600)
    for i, ((text, usages, finishes, after), (want, usage)) in enumerate(zip(streams, plains)):
        assert text == want, i
        assert len(finishes) == 1 and after == 0, (i, finishes)
        if i % 2 == 0:
            assert len(usages) == 1 and usages[0].completion_tokens == usage.completion_tokens
            assert usages[0].prompt_tokens == usage.prompt_tokens
        else:
            assert usages == []
    assert wait_for(lambda: idle(server.base), 30)


def test_sse_framing_chat_and_completions(server):
    body = {"model": MODEL, "messages": CONVERSATIONS[0], "max_tokens": 8, "n": 2, "seed": 3,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0]["choices"] == []
    tokens = 0
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] is not None for m in mine] == [False] * (len(mine) - 1) + [True]
        assert all("role" not in m["delta"] for m in mine[1:])
        for m in mine[1:]:
            for entry in (m["logprobs"] or {}).get("content") or []:
                tokens += 1
                assert len(entry["top_logprobs"]) == 2
    assert usage[0]["usage"]["completion_tokens"] == tokens > 0

    body = {"model": MODEL, "prompt": ["Hello", "Goodbye"], "max_tokens": 5, "temperature": 0,
            "stream": True, "ignore_eos": True}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=120)
    events = sse_events(r.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
    assert "usage" not in chunks[-1]
    # with include_usage: one last chunk, no choices, the usage of both prompts
    body["stream_options"] = {"include_usage": True}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=120)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert [c["choices"] for c in chunks if c.get("usage")] == [[]] and chunks[-1].get("usage")
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_completion_with_several_prompts_and_n(server):
    """A list of prompts is one engine request each; choices are numbered prompt-major."""
    one = lambda p: httpx.post(server.base + "/v1/completions", timeout=120, json={  # noqa: E731
        "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
    both = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "prompt": [[9906, 11], [9906]], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in both["choices"]]
    assert texts[:2] == [one([9906, 11])["choices"][0]["text"]] * 2   # greedy: n copies agree
    assert texts[2:] == [one([9906])["choices"][0]["text"]] * 2
    assert both["usage"]["completion_tokens"] == 24


def _abort_count(base):
    return metric(base, "vllm:request_success_total", finished_reason="abort")


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    assert wait_for(lambda: idle(server.base), 30)
    aborted = _abort_count(server.base)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    sock = raw_post(server.port, "/v1/completions", body)
    assert b"data: " in read_until(sock, b"data: ")
    assert metric(server.base, "vllm:num_requests_running") == 1
    sock.close()
    # Left alone it would run 480 steps (many seconds); aborted, it is gone within a step.
    assert wait_for(lambda: idle(server.base), 3), metrics(server.base)
    assert _abort_count(server.base) == aborted + 1


def test_disconnect_non_streaming_aborts_and_frees_kv(server):
    assert wait_for(lambda: idle(server.base), 30)
    aborted = _abort_count(server.base)
    body = {"model": MODEL, "messages": CONVERSATIONS[0], "max_tokens": 480, "ignore_eos": True}
    sock = raw_post(server.port, "/v1/chat/completions", body)
    assert wait_for(lambda: metric(server.base, "vllm:num_requests_running") == 1, 60)
    sock.close()
    assert wait_for(lambda: idle(server.base), 3), metrics(server.base)
    assert _abort_count(server.base) == aborted + 1


BAD = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    # Once killed the engine thread: an int32 overflow while building the sampling arrays.
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 2 ** 32}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 8}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 7]}, 400, "stop_token_ids"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CONVERSATIONS[0], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CONVERSATIONS[0], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, path, body, status, param):
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    ok = httpx.post(server.base + "/v1/completions", timeout=60,
                    json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and httpx.get(server.base + "/health").status_code == 200


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(server.base + "/v1/completions", content=b'{"prompt": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.get(server.base + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_openai_client_raises_typed_errors(server):
    with pytest.raises(openai.BadRequestError):
        call(server, lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=-1))
    with pytest.raises(openai.NotFoundError):
        call(server, lambda c: c.chat.completions.create(model="gpt-4", messages=CONVERSATIONS[0]))


def test_non_ascii_streams_without_replacement_chars(server):
    body = {"model": MODEL, "prompt": "Emoji list: 🙂 🎉 🚀 🌍 🍕 🐱 🎈 💡", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=120)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    deltas = [c["choices"][0]["text"] for c in chunks]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    text = "".join(deltas)
    assert any(ord(ch) > 0xFFFF for ch in text), text         # it did write emoji
    assert any("\ufffd" in t for t in tokens), tokens         # split across tokens...
    assert not any("\ufffd" in d for d in deltas), deltas     # ...yet never sent in halves


def test_stop_string_never_appears_in_a_delta(server):
    prompt = "The three primary colors are"
    plain = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}).json()
    tokens = plain["choices"][0]["logprobs"]["tokens"]
    text = plain["choices"][0]["text"]
    # A stop string across a token boundary: the end of token 5 and the start of token 6.
    cut = sum(len(t) for t in tokens[:6])
    stop = text[cut - 3:cut + 2]
    assert len(stop) == 5 and text.find(stop) == cut - 3 and not any(stop in t for t in tokens)
    r = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
        "stop": ["zzzz", stop]})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    deltas = [c["choices"][0]["text"] for c in chunks]
    joined = "".join(deltas)
    assert joined == text[:cut - 3]          # not even the stop string's first characters
    assert not any(stop in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_metrics_parse_and_counters_move(server):
    assert wait_for(lambda: idle(server.base), 30)
    before = metrics(server.base)
    r = httpx.post(server.base + "/v1/completions", timeout=120, json={
        "prompt": "Count: one, two,", "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    n_prompt = r.json()["usage"]["prompt_tokens"]
    after = metrics(server.base)
    delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)  # noqa: E731
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == n_prompt
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds"):
        assert delta(h + "_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert ("vllm:num_preemptions_total", ()) in after
    # vLLM's buckets, so its dashboards read ours.
    les = sorted(float(dict(k[1])["le"]) for k in after if k[0] == "vllm:time_to_first_token_seconds_bucket")
    assert les[:3] == [0.001, 0.005, 0.01] and les[-2] == 2560.0
    text = httpx.get(server.base + "/metrics").text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text
    # the start-up heap is out of the collector's walks (a full one would pause every stream)
    assert after[("jaxbatch:gc_frozen_objects", ())] > 10_000
    # vLLM's cache info, which llm-d's endpoint picker reads for block size and count.
    (info,) = [dict(k[1]) for k, v in after.items() if k[0] == "vllm:cache_config_info" and v == 1]
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 1
    assert info["enable_prefix_caching"] == "True" and info["prefix_caching_hash_algo"] == "sha256_cbor"


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_the_text(server):
    """A 300-token prompt sent again starts from its first 256-token chunk (the server's
    chunk size): `usage.prompt_tokens_details.cached_tokens` and the prefix-cache counters
    say so, and the greedy text is the same. Another `cache_salt` never hits."""
    assert wait_for(lambda: idle(server.base), 30)
    prompt = " ".join(f"Item {i}: a lamp and a key." for i in range(30))
    before = metrics(server.base)

    async def ask(c, salt=None):
        extra = {"cache_salt": salt} if salt else {}
        return await c.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                          temperature=0, extra_body=extra)
    first, second, salted = (call(server, ask), call(server, ask),
                             call(server, lambda c: ask(c, "tenant-b")))
    n_prompt = first.usage.prompt_tokens
    assert 256 < n_prompt < 512
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 256
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].text == second.choices[0].text == salted.choices[0].text
    after = metrics(server.base)
    delta = lambda name: after[(name, ())] - before.get((name, ()), 0)  # noqa: E731
    assert delta("vllm:prefix_cache_queries_total") == 3 * n_prompt
    assert delta("vllm:prefix_cache_hits_total") == 256
    assert httpx.post(server.base + "/reset_prefix_cache").status_code == 200
    assert call(server, ask).usage.prompt_tokens_details.cached_tokens == 0


def test_tokenize_detokenize(server, offline):
    tok = offline.get_tokenizer()
    r = httpx.post(server.base + "/tokenize", json={"prompt": "Hello, world"}).json()
    assert r["tokens"] == tok("Hello, world")["input_ids"] and r["count"] == len(r["tokens"])
    r2 = httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert r2["prompt"] == "Hello, world"


def test_the_load_generators_lean_client_reads_this_servers_streams(server):
    """`jaxbatch bench serve` streams through aiohttp (serve_client.AiohttpStreams): over
    uvicorn's chunked framing it sees every request through, each chunk's text and the usage."""
    from jaxbatch.benchmarks import serve_client
    from jaxbatch.benchmarks.serve_client import AiohttpStreams, run_load
    from jaxbatch.benchmarks.workloads import make_workload
    assert isinstance(serve_client._stream_client(None, None), AiohttpStreams)  # real sockets
    workload = make_workload(6, lengths=(12, 0.5, 4, 20), seed=3)
    for api in ("chat", "completions"):
        s = asyncio.run(run_load(server.base, workload, api=api, health_interval=None))["summary"]
        assert s["completed"] == len(workload) and s["failed"] == 0, s.get("errors")
        assert s["output_tokens"] == sum(r.max_tokens for r in workload)   # from usage
        assert s["requests_without_usage"] == 0 and s["requests_with_other_output_length"] == 0


def test_zz_nothing_compiled_while_serving(server):
    """Runs last in this module (pytest keeps file order): every request above, streaming or
    not, with logprobs, penalties and stops, was served by executables warm-up compiled."""
    samples = metrics(server.base)
    key = ("jaxbatch:compilations_after_warmup", ())
    assert key in samples, "the server must export its late-compilation gauge"
    assert samples[key] == 0
