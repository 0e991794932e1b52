"""A plain ZMQ subscriber of KV events, as a router's would be: a SUB socket read by a thread
of its own from the moment it opens (ZMQ delivers nothing to a subscriber that has not yet
processed its connection), a DEALER for the replay socket, and the events decoded with vLLM's
schema, written here from vLLM 0.32's vllm/distributed/kv_events.py and not from jaxbatch's
own records, with unknown fields refused so a misnamed field fails the decode."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True,
                   forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """Collects (topic, sequence number, payload) frames from `endpoint`; `bind=True` is
    llm-d's central mode (the scheduler binds, the engines dial it)."""

    def __init__(self, endpoint: str, topic: bytes = b"", bind: bool = False):
        self.frames: list[tuple[bytes, int, bytes]] = []
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.2)           # the subscription reaches a publisher already up

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(20):
                topic, seq, payload = self._sock.recv_multipart()
                self.frames.append((topic, int.from_bytes(seq, "big"), payload))

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[bytes, int, bytes]]:
        deadline = time.monotonic() + timeout
        while len(self.frames) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.frames)

    def batches(self) -> list[KVEventBatch]:
        return [DECODER.decode(payload) for _, _, payload in self.frames]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


def replay(endpoint: str, start: int, timeout_ms: int = 5000) -> list[tuple[bytes, int, bytes]]:
    """What the replay socket returns from sequence number `start` on, up to its end marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(timeout_ms), "the replay socket did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert topic == b"" and payload == b""
                return out
            out.append((topic, seq, payload))
    finally:
        sock.close(linger=0)
