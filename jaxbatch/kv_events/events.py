"""The KV events on the wire: vLLM's schema (vllm/distributed/kv_events.py, vLLM 0.32), so its
own msgspec classes, and the subscribers written against them, decode what we send.

A batch is a positional msgpack array [ts, events, data_parallel_rank]; each event is a
msgpack map tagged with its class name under "type", optional fields left out while unset.
Field names and order follow vLLM's classes, so an event encodes to the same bytes as theirs.
"""
from __future__ import annotations

from typing import Any

import msgspec

# vLLM's name for the engine's own KV pool (its CPU build reports the same): "CPU" would tell
# a router the block sits in an offload tier.
MEDIUM_ENGINE_POOL = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _TaggedEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event encodes as a map whose "type" names its class."""


class BlockStored(_TaggedEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None   # one entry per block
    group_idx: int | None = None


class BlockRemoved(_TaggedEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_TaggedEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KVEventBatch)
