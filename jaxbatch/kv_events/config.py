"""`--kv-events-config`: the same JSON object as vLLM's `KVEventsConfig`, checked on
construction (a key we do not know is refused, not ignored). Pure Python, no I/O."""
from __future__ import annotations

import dataclasses

PUBLISHERS = ("null", "zmq")
HASH_FORMATS = ("int", "bytes")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # vLLM's default: "zmq" when events are enabled, "null" otherwise.
    publisher: str | None = None
    # Bound when it holds "*" or "::" or is ipc:// or inproc:// (a pod's own port, dialled by
    # the router); connected otherwise (llm-d's central mode: the pods dial the scheduler).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000           # batches kept for replay
    hwm: int = 100_000                   # the PUB socket's high-water mark
    max_queue_size: int = 100_000        # batches waiting for the publisher thread
    topic: str = ""
    # Ours, not vLLM's (vLLM reads VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): "int" publishes each
    # hash as the low 64 bits of its digest (vLLM's default), "bytes" the whole sha256 digest.
    block_hash_format: str = "int"
    # Ours: the engine's index among data-parallel replicas. Its batches carry it, and it
    # publishes on the endpoints' ports + rank (vLLM's rule for its ranks). Set per replica
    # by data_parallel_size; set it by hand for replicas started as separate servers.
    data_parallel_rank: int = 0

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"kv_events_config.{field}={getattr(self, field)!r}: {why}")
        if not isinstance(self.enable_kv_cache_events, bool):
            fail("enable_kv_cache_events", "must be true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            fail("publisher", f"choose one of {', '.join(PUBLISHERS)}")
        for field in ("endpoint", "topic"):
            if not isinstance(getattr(self, field), str):
                fail(field, "must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            fail("replay_endpoint", "must be a string or null")
        if self.publisher == "zmq" and not self.endpoint.startswith(
                ("tcp://", "ipc://", "inproc://")):
            fail("endpoint", "must be a tcp://, ipc:// or inproc:// address")
        rank = self.data_parallel_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            fail("data_parallel_rank", "must be an integer >= 0")
        for field in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, "must be a positive integer")
        if self.block_hash_format not in HASH_FORMATS:
            fail("block_hash_format", f"choose one of {', '.join(HASH_FORMATS)}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, value: dict | None) -> "KVEventsConfig | None":
        if value is None:
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, not {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; the keys "
                             f"are {', '.join(sorted(known))}")
        return cls(**value)


class _NoKVEvents:
    """The engine's recorder when events are off: nothing to publish, nothing to close."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_KV_EVENTS = _NoKVEvents()
