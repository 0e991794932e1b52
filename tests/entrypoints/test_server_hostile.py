"""Hostile and careless clients (issue 26) against one `jaxbatch serve` subprocess: refused
request templates, size limits checked before the work, slow and idle connections, a
concurrency limit that spares the probes, every request field honoured or refused, strict
types, seeds, /reset_prefix_cache, request-counted metrics. Each case ends within seconds and
a normal request right after it gets 200 with the right text."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server_utils import ServerProcess, idle, metric, raw_post, read_until, wait_for

pytestmark = pytest.mark.slow
KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN, QUEUED, BODY, CONCURRENT, HEADER_TIMEOUT = 256, 8, 200_000, 6, 1.5
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-num-seqs", "8", "--max-model-len", str(MAX_LEN), "--no-warmup",
                        "--api-key", KEY, "--max-num-queued-reqs", str(QUEUED),
                        "--max-prompts-per-request", "6", "--max-request-body-bytes", str(BODY),
                        "--max-concurrent-requests", str(CONCURRENT),
                        "--timeout-header-read", str(HEADER_TIMEOUT), "--timeout-keep-alive", "2")
    try:
        srv.wait_ready()
        srv.reference = _completion(srv)
        yield srv
    finally:
        srv.stop()


def _completion(server, **extra):
    r = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 4,
                         "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def still_serving(server):
    assert _completion(server) == server.reference
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200


def post(server, path, body, timeout=30, **kw):
    return httpx.post(server.base + path, json=body, headers=AUTH, timeout=timeout, **kw)


def assert_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    return err["message"]


# ---- 1. request-supplied chat templates ---------------------------------------------------------
@pytest.mark.parametrize("where", ["top", "kwargs"])
def test_request_chat_template_refused_without_the_flag(server, where):
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    body = {"messages": CHAT, "max_tokens": 2}
    body.update({"chat_template": bomb} if where == "top" else
                {"chat_template_kwargs": {"chat_template": bomb}})
    t0 = time.monotonic()
    message = assert_error(post(server, "/v1/chat/completions", body), 400, "chat_template")
    assert "--trust-request-chat-template" in message and time.monotonic() - t0 < 5
    still_serving(server)


# ---- 2. limits checked before the work ------------------------------------------------------------
def test_body_over_the_cap_is_413_before_parsing(server):
    big = b'{"prompt": "' + b"a" * (BODY * 5) + b'"}'
    t0 = time.monotonic()
    r = httpx.post(server.base + "/v1/completions", content=big, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 413, None)

    def chunks():   # no Content-Length: counted while it is read
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = httpx.post(server.base + "/v1/completions", content=chunks(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 413, None)
    assert time.monotonic() - t0 < 5
    still_serving(server)


def test_prompt_over_the_character_cap_is_refused_before_tokenizing(server):
    # Under the body cap, but more characters than MAX_LEN tokens of this vocabulary can spell.
    prompt = "z" * (BODY - 1000)
    message = assert_error(post(server, "/v1/completions", {"prompt": prompt}), 400, "prompt")
    assert "characters" in message
    chat = [{"role": "user", "content": prompt}]
    message = assert_error(post(server, "/v1/chat/completions", {"messages": chat}), 400,
                           "messages")
    assert "characters" in message
    still_serving(server)


def test_prompts_times_n_count_against_the_queue_cap(server):
    assert wait_for(lambda: idle(server.base), 30)
    # 4 prompts x n=3 = 12 sequences can never fit a queue of 8: 400, not 12 queued sequences.
    body = {"prompt": ["a", "b", "c", "d"], "n": 3, "max_tokens": 2}
    assert "prompts x n" in assert_error(post(server, "/v1/completions", body), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": ["x"] * 7, "max_tokens": 2}), 400,
                 "prompt")   # --max-prompts-per-request 6
    # A running n=6 request holds 6 of the 8: 2 prompts x n=2 more is a 503, 2 x 1 is admitted.
    sock = raw_post(server.port, "/v1/completions", {
        "prompt": "Tell me a story.", "n": 6, "max_tokens": 200, "ignore_eos": True,
        "stream": True}, AUTH)
    try:
        assert b" 200 OK" in read_until(sock, b"data: ")
        r = post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert r.status_code == 503 and "Retry-After" in r.headers, r.text
        ok = post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2},
                  timeout=120)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    finally:
        sock.close()
    assert wait_for(lambda: idle(server.base), 10)
    still_serving(server)


@pytest.mark.parametrize("stop", [[f"s{i}" for i in range(65)], ["x" * 2500, "y" * 2500]])
def test_stop_strings_are_capped(server, stop):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stop})
    assert_error(r, 400, "stop")
    still_serving(server)


# ---- 3. connections -----------------------------------------------------------------------------------
def test_slowloris_connections_are_closed_and_health_stays_fast(server):
    """A few sockets that send a header byte every 0.3 s, and one that sends nothing: each is
    closed soon after the header deadline while /health answers fast."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(6)]
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
    closed_at: dict[int, float] = {}
    latencies = []
    t0 = time.monotonic()
    with httpx.Client(base_url=server.base, timeout=5) as probe:
        pos = 0
        while len(closed_at) < len(socks) and time.monotonic() - t0 < HEADER_TIMEOUT + 6:
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    s.sendall(head[pos % len(head):pos % len(head) + 1])
                except OSError:
                    closed_at[i] = time.monotonic() - t0
            pos += 1
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.3)
    assert len(closed_at) == len(socks), "slowloris sockets were never closed"
    assert max(closed_at.values()) < HEADER_TIMEOUT + 4, closed_at
    silent.settimeout(HEADER_TIMEOUT + 4)     # a socket.timeout here: never closed
    data = silent.recv(1024)
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
    assert data == b"" or silent.recv(1024) == b""
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    assert p99 < 0.25, latencies   # 50 ms measured idle; slack for a shared 2-core machine
    for s in socks + [silent]:
        s.close()
    still_serving(server)


def test_concurrency_limit_spares_health_and_metrics(server):
    assert wait_for(lambda: idle(server.base), 30)
    body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    socks = [raw_post(server.port, "/v1/completions", body, AUTH) for _ in range(CONCURRENT)]
    try:
        for s in socks:   # all 6 in flight (8 slots): none can finish 200 tokens meanwhile
            assert b" 200 OK" in read_until(s, b"data: ")
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "concurrent" in r.json()["error"]["message"]
        assert httpx.get(server.base + "/health", timeout=5).status_code == 200
        assert httpx.get(server.base + "/metrics", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
    assert wait_for(lambda: idle(server.base), 10)
    still_serving(server)


# ---- 5. every field honoured or refused; strict types ------------------------------------------------
REFUSED = [
    # Structured outputs and tools are implemented (tests/structured/): what stays refused.
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"frobnicate": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice.
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/completions", {"bad_words": ["Paris"]}, "bad_words"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"stream_options": {"include_usage": True, "extra": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "4",
                                            "name": "f"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]},
     "messages"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"seed": 2 ** 32 + 5}, "seed"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_unimplemented_fields_and_wrong_types_are_400_naming_the_field(server, path, extra,
                                                                       param):
    body = {"prompt": "hi"} if path != "/v1/chat/completions" else {"messages": CHAT}
    if path != "/tokenize":
        body["max_tokens"] = 2
    body.update(extra)
    assert_error(post(server, path, body), 400, param)
    still_serving(server)


def test_openai_metadata_fields_are_accepted(server):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "user": "u1",
                                              "metadata": {"k": "v"}, "store": False,
                                              "service_tier": "auto"})
    assert r.status_code == 200, r.text


def test_seed_in_range_is_honoured(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    a = [_completion(server, **body, seed=2 ** 32 - 1) for _ in range(2)]
    assert a[0] == a[1]


def test_prompt_logprobs_are_returned(server):
    ids = post(server, "/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0,
                                         "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and entry[str(tid)]["logprob"] <= 0   # the prompt's own token
        assert 2 <= len(entry) <= 3


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server, stream):
    body = {"prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = full.strip()[:2]        # a stop string the greedy text is sure to contain
    assert stop and stop in full

    def text(**extra):
        b = dict(body, stop=[stop], stream=stream, **extra)
        r = post(server, "/v1/completions", b)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["text"]
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    cut = text()
    assert cut == full[:full.index(stop)]
    assert text(include_stop_str_in_output=True) == cut + stop


def test_return_tokens_as_token_ids(server):
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "logprobs": 1}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    ids = post(server, "/v1/completions", dict(body, return_tokens_as_token_ids=True)
               ).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids["tokens"])
    got = post(server, "/detokenize", {"tokens": [int(t[9:]) for t in ids["tokens"]]}).json()
    assert got["prompt"] == "".join(plain["tokens"])
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                 "logprobs": True,
                                                 "return_tokens_as_token_ids": True}).json()
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_truncate_prompt_tokens_keeps_the_end(server):
    text = "One two three four five six seven eight nine ten. The capital of France is"
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    want = post(server, "/v1/completions", {"prompt": ids[-5:], "max_tokens": 4,
                                            "temperature": 0}).json()
    got = post(server, "/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0,
                                           "truncate_prompt_tokens": 5}).json()
    assert got["usage"]["prompt_tokens"] == 5
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


def test_continue_final_message(server):
    conv = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    plain = post(server, "/v1/chat/completions", {"messages": conv, "max_tokens": 2,
                                                  "add_generation_prompt": False}).json()
    cont = post(server, "/v1/chat/completions", {"messages": conv, "max_tokens": 2,
                                                 "temperature": 0,
                                                 "add_generation_prompt": False,
                                                 "continue_final_message": True}).json()
    # Continued: the assistant turn is left open (no end-of-turn token and newline after it).
    assert cont["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
    assert "Paris" in cont["choices"][0]["message"]["content"]


# ---- 6. the smaller ones --------------------------------------------------------------------------------
def test_reset_prefix_cache_needs_the_key_and_a_same_origin_post(server):
    url = server.base + "/reset_prefix_cache"
    assert httpx.post(url, timeout=10).status_code == 401
    assert httpx.get(url, timeout=10, headers=AUTH).status_code == 405
    # What a foreign web page's form or fetch() would send (the browser adds the Origin).
    r = httpx.post(url, data={"a": "b"}, timeout=10,
                   headers={**AUTH, "Origin": "http://evil.example"})
    assert_error(r, 403, None)
    assert httpx.post(url, timeout=10, headers=AUTH).status_code == 200   # vLLM's: no body
    host = f"127.0.0.1:{server.port}"
    assert httpx.post(url, timeout=10, headers={**AUTH, "Origin": f"http://{host}"}).status_code == 200


def test_num_requests_running_counts_requests_not_sequences(server):
    assert wait_for(lambda: idle(server.base), 30)
    sock = raw_post(server.port, "/v1/completions", {
        "prompt": "Tell me a story.", "n": 4, "max_tokens": 200, "ignore_eos": True,
        "stream": True}, AUTH)
    try:
        assert b" 200 OK" in read_until(sock, b"data: ")
        seen = [metric(server.base, "vllm:num_requests_running") for _ in range(5)]
        assert max(seen) == 1, seen
    finally:
        sock.close()
    assert wait_for(lambda: idle(server.base), 10)


def test_idle_keep_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 200 " in read_until(s, b"\r\n\r\n")
        t0 = time.monotonic()
        while s.recv(4096):   # a socket.timeout (10 s) here: never closed
            pass
        assert time.monotonic() - t0 < 5     # --timeout-keep-alive 2
