"""The Ray deployment's pure parts, without a cluster: the router's prefix index, the routing
key the ingress derives from a request body, and the merge of the replicas' metrics."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from jaxbatch.entrypoints.ray_cluster.prefix_index import PrefixIndex  # noqa: E402


def test_prefix_index_matches_whole_chunks_of_what_a_replica_was_sent():
    index = PrefixIndex(chunk_chars=4, max_chunks=100)
    index.record("r1", "abcdefghij")
    assert index.matched("r1", "abcdefgh-zz") == 8
    assert index.matched("r1", "abcdXfgh") == 4           # a chain: no match past a change
    assert index.matched("r1", "xbcdefgh") == 0
    index.record("r1", "wxyz1234")
    assert index.matched("r1", "wxyzefgh") == 4      # "efgh" was sent, but after "abcd"
    assert index.matched("r2", "abcdefgh") == 0
    index.forget("r1")
    assert index.matched("r1", "abcdefgh") == 0


def test_prefix_index_forgets_least_recently_used_chunks_first():
    index = PrefixIndex(chunk_chars=2, max_chunks=3)
    index.record("r", "aabbcc")
    index.record("r", "xx")                  # evicts the oldest: "aa"'s chain entry
    assert index.matched("r", "aabbcc") == 0
    assert index.matched("r", "xx") == 2


def test_routing_key_names_model_salt_and_prompt():
    from jaxbatch.entrypoints.ray_cluster.ingress import routing_key
    chat = lambda **kw: json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hello there"}], **kw}).encode()
    key = routing_key("/v1/chat/completions", chat())
    assert key.startswith("m\x00\x00") and "hello there" in key
    assert routing_key("/v1/chat/completions", chat(cache_salt="s")) != key
    assert routing_key("/v1/completions", b'{"model": "a", "prompt": [1, 2, 3]}').endswith("1 2 3")
    assert routing_key("/v1/completions", b'{"model": "a", "prompt": ["x", "y"]}').endswith("x")
    assert routing_key("/v1/completions", b"not json") == ""
    assert routing_key("/v1/models", b"") == ""


def test_metrics_merge_labels_every_sample_with_its_replica():
    from prometheus_client.parser import text_string_to_metric_families
    from jaxbatch.entrypoints.ray_cluster.metrics import merge
    one = ('# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n'
           'vllm:num_requests_running{model_name="m"} %d\n')
    merged = merge({"a": one % 2, "b": one % 5}).decode()
    samples = [s for f in text_string_to_metric_families(merged) for s in f.samples]
    assert {(s.labels["replica"], s.value) for s in samples} == {("a", 2.0), ("b", 5.0)}
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1


def test_ray_serve_refuses_contradictory_flags_before_starting_ray():
    from jaxbatch.entrypoints.cli import main
    assert main(["ray-serve", "--num-replicas", "2", "--autoscaling-config",
                 '{"max_replicas": 2}']) == 2
    assert main(["ray-serve", "--num-processes", "2", "--coordinator-address", "h:1",
                 "--process-id", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["ray-serve", "--autoscaling-config", "[1]"])


def test_round_robin_hands_each_request_to_the_next_replica_in_turn():
    import asyncio
    from types import SimpleNamespace
    from jaxbatch.entrypoints.ray_cluster.router import RoundRobinRouter
    router = object.__new__(RoundRobinRouter)        # its state alone: no cluster behind it
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in "cab"]
    firsts = [asyncio.run(router.choose_replicas(replicas))[0][0].replica_id.unique_id
              for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    ranking = asyncio.run(router.choose_replicas(replicas))
    assert [r[0].replica_id.unique_id for r in ranking] == ["b", "c", "a"]   # the rest after
    assert asyncio.run(router.choose_replicas([])) == []
