"""LoRA adapters over HTTP (issue 25, "Server"): one `jaxbatch serve --enable-lora` subprocess
on a tiny random Llama (written with save_pretrained, with the embedded model's tokenizer) and
tiny random PEFT adapters; compared with offline `LLM.generate(..., lora_request=)` on the same
checkpoint."""
from __future__ import annotations

import copy
import os

import httpx
import pytest

from kernel_cache import cache_sharing_kernels
from server_utils import ServerProcess

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE_KW = dict(max_model_len=128, max_num_seqs=4, seed=0, dtype="float32", enable_lora=True,
                 max_loras=2, max_lora_rank=8)
FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--dtype", "float32",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--no-warmup",
         "--api-key", KEY]
ADAPTERS = {"sql": (8, ["q_proj", "v_proj", "down_proj"]),     # served from the start
            "late": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"]),   # loaded at run time
            "wide": (16, ["q_proj"])}                          # rank above --max-lora-rank
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _write_adapter(model, folder, r, targets, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():      # random init is small next to the tiny model: make the delta show
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import torch
    import transformers
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    root = tmp_path_factory.mktemp("serve_lora")
    tokenizer = load_tokenizer(embedded_gguf_path())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    ckpt = str(root / "tiny")
    model.save_pretrained(ckpt, safe_serialization=True)
    tokenizer.save_pretrained(ckpt)
    paths = {}
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        _write_adapter(model, paths[name], r, targets, seed=20 + i)
    return ckpt, paths, cache_sharing_kernels(str(root / "cache"))


@pytest.fixture(scope="module")
def server(files):
    ckpt, paths, cache = files
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXBATCH_CACHE", cache)          # the checkpoint's param cache: not ~/.cache
        srv = ServerProcess(ckpt, *FLAGS, "--lora-modules", f"sql={paths['sql']}")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(files):
    from jaxbatch import LLM
    ckpt, _, cache = files
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXBATCH_CACHE", cache)
        return LLM(ckpt, warmup=False, **ENGINE_KW)


def post(server, path, body, headers=AUTH):
    return httpx.post(server.base + path, json=body, headers=headers, timeout=120)


def offline_text(offline, lora, chat=False):
    from jaxbatch import SamplingParams
    params = SamplingParams(**GREEDY)
    if chat:
        return offline.chat(CHAT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return offline.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def served_text(server, model, chat=False):
    if chat:
        r = post(server, "/v1/chat/completions", {"model": model, "messages": CHAT, **GREEDY})
    else:
        r = post(server, "/v1/completions", {"model": model, "prompt": PROMPT, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model          # the name asked, adapter or base
    choice = body["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def base_name(server):
    return httpx.get(server.base + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def test_models_list_each_adapter_with_the_base_as_parent(server, files):
    _, paths, _ = files
    data = httpx.get(server.base + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in data[1:]] == ["sql"]
    assert data[1]["parent"] == data[0]["id"] and data[1]["root"] == paths["sql"]


def test_adapter_by_model_name_equals_offline_lora_request(server, offline, files):
    from jaxbatch import LoRARequest
    _, paths, _ = files
    sql = LoRARequest("sql", 1, paths["sql"])
    base = base_name(server)
    for chat in (False, True):
        want = offline_text(offline, sql, chat)
        assert served_text(server, "sql", chat) == want
        # The adapter matters: the base model's text differs, and the server gives that too.
        want_base = offline_text(offline, None, chat)
        assert want_base != want
        assert served_text(server, base, chat) == want_base


def test_lora_requests_info_names_running_and_waiting_adapters_one_series_at_a_time():
    from jaxbatch.entrypoints.openai.metrics import ServerMetrics
    m = ServerMetrics("m")
    base = dict(num_running=1, num_waiting=2, num_free_blocks=8, num_total_blocks=8)
    m.record([], {**base, "lora_max_loras": 2, "lora_running": {"sql": 1},
                  "lora_waiting": {"late": 1, "b": 2}}, 0.0)
    text = m.render().decode()
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",' \
           'waiting_lora_adapters="b,late"}' in text
    m.record([], {**base, "lora_max_loras": 2, "lora_running": {}, "lora_waiting": {}}, 1.0)
    lines = [l for l in m.render().decode().splitlines() if l.startswith("vllm:lora_requests_info")]
    assert lines == [lines[0]] and 'running_lora_adapters=""' in lines[0]
    assert "lora_requests_info{" not in ServerMetrics("x").render().decode().replace(
        "# HELP vllm:lora_requests_info", "")       # no sample without an --enable-lora engine


def test_metrics_carry_lora_requests_info(server):
    assert served_text(server, "sql", False)
    text = httpx.get(server.base + "/metrics", headers=AUTH).text
    assert 'vllm:lora_requests_info{max_lora="2"' in text


def test_unknown_model_is_404_with_openai_error_body(server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        r = post(server, path, {"model": "no-such-adapter", **body, "max_tokens": 2})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == 404 and err["param"] == "model" and "no-such-adapter" in err["message"]


def test_load_use_and_unload_at_run_time(server, offline, files):
    from jaxbatch import LoRARequest
    _, paths, _ = files
    load = {"lora_name": "late", "lora_path": paths["late"]}
    assert post(server, "/v1/load_lora_adapter", load, headers={}).status_code == 401
    assert served_text(server, "sql", False)         # (a slot is busy with another adapter)
    assert post(server, "/v1/completions", {"model": "late", "prompt": PROMPT}).status_code == 404
    r = post(server, "/v1/load_lora_adapter", load)
    assert r.status_code == 200, r.text
    r = post(server, "/v1/load_lora_adapter", load)       # the name exists
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    # A bad adapter: 400 with the reader's message, and nothing registered.
    for bad, says in ((paths["wide"], "exceeds max_lora_rank=8"), (paths["wide"] + "-x", "no such")):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": bad})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    ids = [m["id"] for m in httpx.get(server.base + "/v1/models", headers=AUTH).json()["data"]]
    assert ids[1:] == ["sql", "late"]
    assert served_text(server, "late", False) == offline_text(
        offline, LoRARequest("late", 7, paths["late"]), False)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert post(server, "/v1/completions", {"model": "late", "prompt": PROMPT}).status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    ids = [m["id"] for m in httpx.get(server.base + "/v1/models", headers=AUTH).json()["data"]]
    assert ids[1:] == ["sql"]
    # Loaded again under the same name (a fresh lora_int_id): served as before.
    assert post(server, "/v1/load_lora_adapter", load).status_code == 200
    assert served_text(server, "late", False) == offline_text(
        offline, LoRARequest("late", 7, paths["late"]), False)


def test_unload_refuses_an_adapter_an_admitted_request_holds():
    """400 from the moment a request naming it is admitted until its response is done (a
    running request on the tiny model finishes too fast to catch over HTTP reliably)."""
    import asyncio
    from jaxbatch.entrypoints.openai.errors import APIError
    from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry

    class Ticket:
        cost, released = 1, 0

        def release(self):
            self.released += 1

    removed = []

    class FakeLLM:   # AsyncLLM.call runs fn on the engine thread; here, on a stand-in engine
        async def call(self, fn):
            class Engine:
                def remove_lora(self, name):
                    removed.append(name)
                    return True
            return fn(Engine())

    registry = LoRARegistry("base", True, {"a": "/some/peft"})
    request = registry.resolve("a")
    ticket = Ticket()
    held = registry.hold(ticket, request)
    with pytest.raises(APIError) as e:
        asyncio.run(registry.unload(FakeLLM(), "a"))
    assert e.value.status == 400 and "in use by 1" in e.value.message
    assert registry.resolve("a") is request and not removed      # nothing changed
    held.release()
    held.release()                                                # once only
    assert ticket.released == 2 and registry.in_use["a"] == 0
    asyncio.run(registry.unload(FakeLLM(), "a"))
    assert removed == ["a"]
    with pytest.raises(APIError) as e:
        registry.resolve("a")
    assert e.value.status == 404


def test_lora_modules_are_checked_before_serving(offline, files, capsys):
    from jaxbatch.entrypoints import cli
    from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry
    _, paths, _ = files
    assert cli.main(["serve", "--lora-modules", f"sql={paths['sql']}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert cli.main(["serve", "--enable-lora", "--lora-modules", "sql"]) == 2
    assert "expected NAME=PATH" in capsys.readouterr().err
    # What the engine thread runs once the engine is built (cli.py): a bad adapter raises the
    # reader's message, so the server exits with it instead of serving.
    engine = offline.llm_engine
    for name in ("sql", "late"):         # forget the earlier tests' adapters (ids 1 and 7)
        engine.lora.remove(name)
    LoRARegistry("base", True, {"sql": paths["sql"]}).check_at_start(engine)
    for bad, says in ((paths["wide"], "exceeds max_lora_rank"), ("/nonexistent/x", "no such")):
        with pytest.raises(ValueError, match=says):
            LoRARegistry("base", True, {"w": bad}).check_at_start(engine)
    assert not os.path.exists("/nonexistent/x")
