"""jaxbatch on Ray Serve (issue 58, part 1), on a real two-node Ray cluster on this machine
(two raylets, one CPU each, so the two engine replicas land on different nodes): a tiny random
Llama behind Ray Serve's HTTP proxy, driven by the official openai client."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from kernel_cache import cache_sharing_kernels
from server_utils import free_port
from test_server_lora import _write_adapter

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# One CPU per node; no dashboard; a small object store (nothing big travels through it).
NODE = dict(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20)
FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0", "--dtype", "float32",
         "--no-warmup", "--cpu-kernels", "off", "--prefix-cache-granularity", "block",
         "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
SHARED = {"A": "Alpha team log. " * 24, "B": "Bravo unit notes: " * 24}   # ~400 chars each
READY_S = 300


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import torch
    import transformers
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    root = tmp_path_factory.mktemp("ray_serve")
    tokenizer = load_tokenizer(embedded_gguf_path())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    ckpt = str(root / "tiny")
    model.save_pretrained(ckpt, safe_serialization=True)
    tokenizer.save_pretrained(ckpt)
    adapter = str(root / "sql")
    _write_adapter(model, adapter, 8, ["q_proj", "v_proj"], seed=21)
    return ckpt, adapter, cache_sharing_kernels(str(root / "cache"))


@pytest.fixture(scope="module")
def cluster(files):
    from ray.cluster_utils import Cluster
    _, _, cache = files
    with pytest.MonkeyPatch.context() as mp:      # the raylets' workers inherit these
        # Ray's memory monitor kills workers when the whole machine nears full, whoever
        # fills it: on a shared CI machine that is not this test's doing.
        mp.setenv("RAY_memory_monitor_refresh_ms", "0")
        mp.setenv("JAXBATCH_CACHE", cache)
        mp.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
        mp.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        c = Cluster(initialize_head=True, head_node_args=NODE)
        c.add_node(**NODE)
        ray.init(address=c.address)
    from ray import serve
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield c, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(base, prompt, **kw):
    raw = client(base).completions.with_raw_response.create(
        model=kw.pop("model", "tiny"), prompt=prompt, max_tokens=kw.pop("max_tokens", 4),
        temperature=0, **kw)
    return raw.headers["x-jaxbatch-replica"], raw.parse()


def metric_per_replica(base, name):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base + "/metrics", timeout=30).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                found[s.labels["replica"]] = found.get(s.labels["replica"], 0) + s.value
    return found


def wait_for(what, predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout} s")


def running_replicas(app="jaxbatch"):
    from ray import serve
    from jaxbatch.entrypoints.ray_cluster.deploy import ENGINE_DEPLOYMENT
    status = serve.status().applications[app].deployments[ENGINE_DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def two_replicas(cluster, files):
    from ray import serve
    from jaxbatch.entrypoints.ray_cluster.deploy import build_application
    ckpt, adapter, _ = files
    _, base = cluster
    app = build_application([ckpt, "--served-model-name", "tiny", *FLAGS,
                             "--lora-modules", f"sql={adapter}"],
                            num_replicas=2, prefix_affinity_max_imbalance=4)
    serve.run(app, name="jaxbatch", route_prefix="/")
    yield base
    serve.delete("jaxbatch")


def test_a_shared_prefix_stays_on_the_replica_that_holds_it(two_replicas):
    base = two_replicas
    # A is in flight on one replica while B arrives: B goes to the idle one.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first_a = pool.submit(complete, base, SHARED["A"] + "zero", max_tokens=300,
                              extra_body={"ignore_eos": True})
        wait_for("A admitted", lambda: sum(metric_per_replica(
            base, "vllm:num_requests_running").values()) >= 1, 60)
        home_b = complete(base, SHARED["B"] + "zero")[0]
        home_a = first_a.result()[0]
    assert home_a != home_b
    # Both idle now: plain least-loaded would send all of these to the same replica.
    for i in range(3):
        for family, home in (("B", home_b), ("A", home_a)):
            assert complete(base, SHARED[family] + f"turn {i}")[0] == home
    hits = wait_for("hits pushed", lambda: (lambda h: h if len(h) == 2 and all(h.values())
                                            else None)(
        metric_per_replica(base, "vllm:prefix_cache_hits_total")), 20)
    assert set(hits) == {home_a, home_b}          # every replica's metrics, labelled
    # Four requests each (the replicas push their metrics every second: wait for the last).
    wait_for("every success counted", lambda: metric_per_replica(
        base, "vllm:request_success_total") == {home_a: 4.0, home_b: 4.0}, 20)


def test_fields_work_as_on_one_server(two_replicas):
    base = two_replicas
    c = client(base)
    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens
    choice = c.completions.create(model="tiny", prompt="pick", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    base_text = complete(base, "The colors are", max_tokens=8)[1].choices[0].text
    lora_text = complete(base, "The colors are", max_tokens=8, model="sql")[1]
    assert lora_text.model == "sql" and lora_text.choices[0].text != base_text
    with pytest.raises(openai.BadRequestError, match="one replica of several"):
        c.post("/load_lora_adapter", cast_to=object,
               body={"lora_name": "x", "lora_path": "/nowhere"})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")


def test_a_replica_killed_mid_stream(two_replicas):
    from jaxbatch.entrypoints.ray_cluster.deploy import ENGINE_DEPLOYMENT
    base = two_replicas
    c = client(base)
    streams = {}
    for family in ("A", "B"):
        raw = c.completions.with_streaming_response.create(
            model="tiny", prompt=SHARED[family] + "kill", max_tokens=900, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        response = raw.__enter__()
        streams[family] = (response.headers["x-jaxbatch-replica"], response.parse(), raw)
    assert streams["A"][0] != streams["B"][0]
    for _, stream, _ in streams.values():
        next(iter(stream))                      # both are streaming
    victim = streams["A"][0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::jaxbatch#{ENGINE_DEPLOYMENT}#{victim}",
                           namespace="serve"))
    with pytest.raises(openai.APIError, match="replica serving this stream stopped"):
        for _ in streams["A"][1]:
            pass
    survivor = list(streams["B"][1])
    assert survivor[-1].choices[0].finish_reason == "length"
    for _, _, raw in streams.values():
        raw.__exit__(None, None, None)
    # Serving again within a bounded time (the survivor at once; a request the router still
    # sent to the dead replica is a clear 503), and Ray replaces the replica.
    def serves():
        try:
            return complete(base, "after")[1].choices[0].text is not None
        except openai.InternalServerError as e:
            assert e.status_code == 503 and "replica" in str(e)
            return False
    wait_for("serving again", serves, 30)
    wait_for("replacement replica", lambda: running_replicas() == 2, READY_S)


def replica_states(app="jaxbatch"):
    from ray import serve
    from jaxbatch.entrypoints.ray_cluster.deploy import ENGINE_DEPLOYMENT
    return dict(serve.status().applications[app].deployments[ENGINE_DEPLOYMENT].replica_states)


def read_stream(base, prompt, max_tokens):
    """Opens a long stream and returns (answering replica, a function that reads it to the
    end and returns (its chunks, time.monotonic() at its last one))."""
    raw = client(base).completions.with_streaming_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    response = raw.__enter__()

    def to_the_end():
        try:
            return list(response.parse()), time.monotonic()
        finally:
            raw.__exit__(None, None, None)
    return response.headers["x-jaxbatch-replica"], to_the_end


def test_autoscaling_up_under_load_and_back_draining_the_stopped_replica(
        cluster, files, two_replicas):
    from ray import serve
    from jaxbatch.entrypoints.ray_cluster.deploy import build_application
    ckpt, _, _ = files
    _, base = cluster
    serve.delete("jaxbatch")
    app = build_application(
        [ckpt, "--served-model-name", "tiny", *FLAGS[:-5]], graceful_shutdown_timeout_s=120,
        autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                            "upscale_delay_s": 0.5, "downscale_delay_s": 3,
                            "metrics_interval_s": 0.5, "look_back_period_s": 1})
    serve.run(app, name="jaxbatch", route_prefix="/")
    assert running_replicas() == 1
    stop = time.monotonic() + READY_S

    def load(i):
        while time.monotonic() < stop and running_replicas() < 2:
            complete(base, f"load {i} " * 20, max_tokens=48, extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(load, range(6)))
    assert running_replicas() == 2
    # One long stream on each replica: two ongoing requests are one replica's target, so Ray
    # scales down while both stream, and whichever replica it stops holds one of them.
    max_tokens = 1000
    first_home, first = read_stream(base, "drain first", max_tokens)
    second_home, second = read_stream(base, "drain second", max_tokens)
    assert first_home != second_home
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        readers = [pool.submit(first), pool.submit(second)]
        stopping_at = wait_for("a replica stopping", lambda: (
            replica_states().get("STOPPING", 0) or running_replicas() < 2) and time.monotonic(),
            READY_S)
        streams = [r.result() for r in readers]
    # The scale-down began while both streams were still coming in ...
    assert stopping_at < min(done_at for _, done_at in streams)
    # ... and both came in whole: the stopped replica finished its stream before it went.
    for chunks, _ in streams:
        assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == max_tokens
    wait_for("scale back to one", lambda: running_replicas() == 1, 120)
    assert complete(base, "still here")[0] in (first_home, second_home)


def test_the_ray_replicas_benchmark_reads_the_replicas_own_hit_counters(cluster, files, capsys):
    """`python -m benchmarks ray-replicas` at its smallest, on this file's cluster (a cluster
    of its own would double the start-up): it runs, and its hit rate is the replicas'."""
    from ray import serve
    from benchmarks import ray_replicas
    ckpt, _, _ = files
    _, base = cluster
    serve.delete("jaxbatch")        # its replicas would hold the nodes' CPUs
    result = ray_replicas.main(
        ["--model", ckpt, "--served-model-name", "tiny", "--deployments", "one,pow2",
         "--conversations", "2", "--turns", "2", "--turn-max-tokens", "2", "--num-prompts", "2",
         "--output-max", "8", "--warmup-requests", "0", "--server-args", " ".join(FLAGS[:-5])],
        serve_base=base)
    rows = {r["deployment"]: r for r in result["deployments"]}
    assert set(rows) == {"one", "pow2"}
    for row in rows.values():
        turns = row["multi_turn"]
        assert turns["failed"] == 0 and row["served"]["failed"] == 0
        assert sum(turns["requests_per_replica"]) == 4
        assert len(turns["requests_per_replica"]) <= row["replicas"]
        assert turns["prefix_cache_query_tokens"] > 0 and 0 <= turns["prefix_cache_hit_rate"] <= 1
        assert row["served"]["output_tokens_per_s"] > 0 and row["served"]["ttft"]["p99_ms"] > 0
    # One replica holds every conversation: each second turn hits what its first stored.
    assert rows["one"]["multi_turn"]["prefix_cache_hit_rate"] > 0
    assert "| 2 replicas, power of two choices |" in capsys.readouterr().out


def test_an_unknown_request_router_is_refused_before_anything_deploys():
    from jaxbatch.entrypoints.ray_cluster.deploy import build_application
    with pytest.raises(ValueError, match="power_of_two_choices"):
        build_application([], request_router="least_loaded")


def test_the_counters_poll_asks_again_when_the_proxy_drops_a_connection(monkeypatch):
    """A reset /metrics connection (seen once under the suite's load) is asked again until the
    poll's deadline; past it, the error is raised, not swallowed."""
    from benchmarks import ray_replicas
    answers = [httpx.ReadError("reset"), {"r1": {"vllm:request_success_total": 4.0}}]

    def counters(base):
        answer = answers.pop(0) if answers else httpx.ReadError("reset")
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray_replicas, "replica_counters", counters)
    monkeypatch.setattr(ray_replicas.time, "sleep", lambda s: None)
    assert ray_replicas.counters_after("http://x", 4)["r1"]["vllm:request_success_total"] == 4
    with pytest.raises(httpx.ReadError):
        ray_replicas.counters_after("http://x", 4, timeout=0.01)
