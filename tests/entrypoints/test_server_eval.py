"""Evaluation over HTTP: `/v1/completions` with `echo` (the prompt and its log-probabilities, as
OpenAI and vLLM shape them), `logit_bias`, and lm-evaluation-harness's `local-completions`
against `jaxbatch serve`, scored the same as the harness's `hf` model on the same weights.
One float32 server for the module; Hugging Face transformers on the same weights (the
embedded GGUF, as conftest's `hf_embedded` reads it) is the reference."""
from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from server_utils import MODEL, ROOT, ServerProcess, metrics

pytestmark = pytest.mark.slow
SETTINGS = ["--max-num-seqs", "8", "--max-model-len", "512", "--dtype", "float32",
            "--seed", "0"]
TASKS = os.path.join(ROOT, "tests", "data", "lmeval")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*SETTINGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf(hf_embedded):
    from transformers import AutoTokenizer
    from jaxbatch.model.loader import embedded_gguf_path
    path = embedded_gguf_path()
    return hf_embedded, AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def tokenizer_dir(hf, tmp_path_factory):
    """The tokenizer as a directory: lm-eval's API models load theirs by path."""
    out = tmp_path_factory.mktemp("tokenizer")
    hf[1].save_pretrained(out)
    return str(out)


def hf_log_softmax(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def post(server, body, path="/v1/completions"):
    return httpx.post(server.base + path, json={"model": MODEL, **body}, timeout=300)


def test_echo_gives_the_prompt_and_its_logprobs_before_the_completion(server, hf):
    model, tok = hf
    prompt = "The capital of France is Paris. The capital of Italy is"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = post(server, body).json()["choices"][0]
    echoed = post(server, {**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    lp, ids = echoed["logprobs"], tok(prompt)["input_ids"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    # The generated part is what the same request without echo reports.
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][n:] == plain["logprobs"][key], key
    assert "".join(lp["tokens"]) == echoed["text"]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    # The prompt part: nothing for the first token, then HF's numbers.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_log_softmax(model, ids)
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]]) < 1e-4, p
        top = lp["top_logprobs"][p]
        assert lp["tokens"][p] in top and 2 <= len(top) <= 3
        best = tok.decode([int(np.argmax(ref[p - 1]))])
        assert abs(top[best] - ref[p - 1].max()) < 1e-4, p
    assert "prompt_logprobs" not in echoed          # vLLM's own field: only when asked


def test_echo_of_batched_token_ids_with_max_tokens_0_is_the_prompt_only(server, hf):
    _, tok = hf
    prompts = [tok("Once upon a time")["input_ids"],
               tok("A long time ago, in a galaxy far, far away")["input_ids"]]

    async def go():
        async with AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0) as c:
            return await c.completions.create(model=MODEL, prompt=prompts, max_tokens=0,
                                              echo=True, logprobs=1, n=2, temperature=0)
    out = asyncio.run(go())
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        ids = prompts[c.index // 2]
        assert c.text == tok.decode(ids) and c.finish_reason == "length"
        assert len(c.logprobs.tokens) == len(ids)
        assert c.logprobs.token_logprobs[0] is None
        assert all(isinstance(v, float) for v in c.logprobs.token_logprobs[1:])
    assert out.choices[0].logprobs == out.choices[1].logprobs
    assert out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_echoed_logprobs_are_the_same_alone_in_a_batch_and_after_a_cache_fill(server, hf):
    """A prompt longer than a prefill chunk; its prompt logprobs come from its own prefill
    whatever runs beside it, and a cached copy of its prefix is not used for them."""
    _, tok = hf
    long = tok(" ".join(f"Item {i} is a red box on the shelf." for i in range(40)))["input_ids"]
    body = {"max_tokens": 0, "echo": True, "logprobs": 1}
    alone = post(server, {**body, "prompt": long}).json()["choices"][0]["logprobs"]
    batch = post(server, {**body, "prompt": [long[:50], long, long[7:]]}).json()
    assert batch["choices"][1]["logprobs"] == alone
    again = post(server, {**body, "prompt": long}).json()["choices"][0]["logprobs"]
    assert again == alone


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "echo": True, "stream": True}, "echo"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"-3": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"99999": 1}},
     "logit_bias"),
])
def test_refused_with_the_field_named(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logit_bias_over_http_steers_chat_and_completions(server, hf):
    _, tok = hf
    target = tok(" banana")["input_ids"][0]
    forced = post(server, {"prompt": "My favourite fruit is", "max_tokens": 3, "temperature": 0,
                           "logprobs": 0, "return_tokens_as_token_ids": True,
                           "logit_bias": {str(target): 100}}).json()["choices"][0]
    assert forced["logprobs"]["tokens"] == [f"token_id:{target}"] * 3
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5,
            "temperature": 0, "logprobs": True}
    plain = post(server, chat, "/v1/chat/completions").json()["choices"][0]
    first = tok(plain["logprobs"]["content"][0]["token"])["input_ids"][0]
    biased = post(server, {**chat, "logit_bias": {str(first): -100}},
                  "/v1/chat/completions").json()["choices"][0]
    assert biased["logprobs"]["content"][0]["token"] != plain["logprobs"]["content"][0]["token"]


def test_lm_eval_local_completions_scores_as_its_hf_model(server, hf, tokenizer_dir,
                                                          monkeypatch):
    """lm-evaluation-harness end to end, offline: a log-likelihood multiple-choice task and a
    generation task from tests/data/lmeval, against this server (token-id prompts, batched)
    and against the harness's own `hf` model on the same float32 weights."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)                     # the task files name their data from here
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = ["jaxbatch_mc", "jaxbatch_gen"]
    manager = TaskManager(include_path=TASKS, include_defaults=False)

    def run(model, args, batch_size):
        return simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=manager,
                               batch_size=batch_size, log_samples=True)
    ours = run("local-completions", {
        "model": MODEL, "base_url": server.base + "/v1/completions", "tokenizer": tokenizer_dir,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
        "max_length": 512}, 4)
    ref = run(HFLM(pretrained=hf[0], tokenizer=hf[1], batch_size=8), None, 8)

    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["jaxbatch_mc"][metric] == ref["results"]["jaxbatch_mc"][metric]
    assert (ours["results"]["jaxbatch_gen"]["exact_match,none"]
            == ref["results"]["jaxbatch_gen"]["exact_match,none"])
    mc = {s["doc_id"]: s for s in ours["samples"]["jaxbatch_mc"]}
    assert len(mc) == 6
    for s in ref["samples"]["jaxbatch_mc"]:
        got = [r[0] for r in mc[s["doc_id"]]["resps"]]
        want = [r[0] for r in s["resps"]]
        assert len(got) == len(want)
        for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
            assert abs(ll - ll_ref) < 1e-3, (s["doc_id"], ll, ll_ref)
            assert greedy == greedy_ref
    gen = {s["doc_id"]: s["resps"] for s in ours["samples"]["jaxbatch_gen"]}
    assert len(gen) == 4
    for s in ref["samples"]["jaxbatch_gen"]:
        assert gen[s["doc_id"]] == s["resps"]


def test_zz_nothing_compiled_while_serving(server):
    """Runs last: echo, prompt logprobs and logit_bias were all served by warm-up's executables."""
    assert metrics(server.base)[("jaxbatch:compilations_after_warmup", ())] == 0
