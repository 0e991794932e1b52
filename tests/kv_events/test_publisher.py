"""The ZMQ publisher against plain ZMQ sockets: frames (topic, 8-byte big-endian sequence
number, msgpack payload) as vLLM's ZmqEventPublisher sends them, the payload decoded with
vLLM's schema (kv_subscriber.py), the replay socket's answer, llm-d's central mode (the
subscriber binds, the engine dials), data-parallel ranks and the config's refusals."""
from __future__ import annotations

import time

import msgspec
import pytest

from jaxbatch.kv_events.config import KVEventsConfig
from jaxbatch.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from jaxbatch.kv_events.publisher import ZmqEventPublisher
from kv_subscriber import Subscriber, free_port, replay
import kv_subscriber as vllm_schema


def stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[None, None], group_idx=0)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=1000.0 + i, events=[stored(10 * i), BlockRemoved(
        block_hashes=[10 * i], medium="GPU", group_idx=0), AllBlocksCleared()])


@pytest.fixture
def ports():
    return free_port(), free_port()


def test_frames_payloads_and_replay(ports):
    pub_port, replay_port = ports
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                            replay_endpoint=f"tcp://*:{replay_port}", topic="kv@pod@m")
    publisher = ZmqEventPublisher(config)
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", b"kv@")
    try:
        for i in range(5):
            publisher.publish(batch(i))
        frames = sub.wait_for(5)
        assert [(t, s) for t, s, _ in frames] == [(b"kv@pod@m", i) for i in range(5)]
        raw = msgspec.msgpack.decode(frames[0][2])
        # The batch is positional, each event a map tagged with its class name.
        assert raw[0] == 1000.0 and raw[2] == 0
        assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert "extra_keys" in raw[1][0] and "locality" not in raw[1][0]   # unset: left out
        decoded = sub.batches()
        assert [b.ts for b in decoded] == [1000.0 + i for i in range(5)]
        first = decoded[2].events
        assert isinstance(first[0], vllm_schema.BlockStored) and first[0].block_hashes == [20, 21]
        assert first[0].medium == "GPU" and first[0].group_idx == 0
        assert isinstance(first[1], vllm_schema.BlockRemoved) and first[1].block_hashes == [20]
        assert isinstance(first[2], vllm_schema.AllBlocksCleared)
        # A subscriber that joined late asks for what it missed, from sequence number 3 on.
        missed = replay(f"tcp://127.0.0.1:{replay_port}", 3)
        assert [(t, s) for t, s, _ in missed] == [(b"kv@pod@m", 3), (b"kv@pod@m", 4)]
        assert [p for _, _, p in missed] == [p for _, _, p in frames[3:]]
        assert replay(f"tcp://127.0.0.1:{replay_port}", 99) == []
    finally:
        sub.close()
        publisher.shutdown()


def test_central_mode_the_engine_dials_the_router(ports):
    """llm-d's default: its scheduler binds, every pod's endpoint names it (no "*")."""
    port = ports[0]
    sub = Subscriber(f"tcp://*:{port}", bind=True)
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                                 endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        deadline = time.monotonic() + 10
        while not sub.frames and time.monotonic() < deadline:   # until the dial is up
            publisher.publish(batch(0))
            time.sleep(0.05)
        assert sub.frames and sub.frames[0][0] == b""
    finally:
        publisher.shutdown()
        sub.close()


def test_data_parallel_rank_offsets_the_ports_and_names_the_batches(ports):
    base = ports[0]
    replica = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                               endpoint=f"tcp://*:{base}", data_parallel_rank=2))
    sub = Subscriber(f"tcp://127.0.0.1:{base + 2}")
    try:
        assert replica.endpoint == f"tcp://*:{base + 2}"
        replica.publish(batch(0))
        assert sub.wait_for(1) and sub.batches()[0].data_parallel_rank == 2
    finally:
        sub.close()
        replica.shutdown()


def test_a_port_in_use_is_a_clear_error(ports):
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                             endpoint=f"tcp://*:{ports[0]}"))
    try:
        with pytest.raises(ValueError, match="cannot open"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                             endpoint=f"tcp://*:{ports[0]}"))
    finally:
        first.shutdown()


@pytest.mark.parametrize("value, message", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": "http://x:1"}, "endpoint"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps"),
    ({"enable_kv_cache_events": True, "block_hash_format": "hex"}, "block_hash_format"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "topics": "kv"}, "unknown key"),
])
def test_config_refuses_what_it_cannot_honour(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_dict(value)


def test_config_defaults_are_vllms():
    on = KVEventsConfig.from_dict({"enable_kv_cache_events": True})
    assert (on.publisher, on.endpoint, on.replay_endpoint, on.topic) == (
        "zmq", "tcp://*:5557", None, "")
    assert (on.buffer_steps, on.hwm, on.max_queue_size) == (10_000, 100_000, 100_000)
    assert on.publishes and not KVEventsConfig.from_dict({}).publishes


@pytest.mark.parametrize("options, message", [
    ({"enable_prefix_caching": False}, "enable_prefix_caching"),
])
def test_engine_options_refuse_events_they_cannot_describe(options, message):
    from jaxbatch.engine.config import EngineConfig
    events = {"enable_kv_cache_events": True}
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_events_config=events, **options)
    EngineConfig.from_kwargs(kv_events_config={**events, "publisher": "null"}, **options)
