"""The prefix cache's observer (core/prefix_cache.py's seam): turns what the cache did into
vLLM's events and hands them to the publisher as one batch per engine step (`flush`), as
vLLM publishes what its scheduler queued during a step.

- BlockStored for every full block that enters the cache, consecutive blocks of one sequence
  coalesced into one event (their parent chain unbroken), with the block's vLLM hash.
- BlockRemoved for every evicted block, AllBlocksCleared for a reset.

A block's vLLM hash chains over its whole prefix like our own key, so it is a function of our
key: memoised by key (bounded), and recomputed from the sequence's tokens when the memo has
lost a parent (an old entry dropped). The hashes of the blocks cached now are kept apart, so
an eviction is always published with the hash its store was.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

from jaxbatch.kv_events import hashing
from jaxbatch.kv_events.config import KVEventsConfig
from jaxbatch.kv_events.events import (MEDIUM_ENGINE_POOL, AllBlocksCleared, BlockRemoved,
                                       BlockStored, KVEventBatch)


@dataclasses.dataclass(frozen=True)
class BlockOrigin:
    """What besides the tokens names a sequence's KV, as vLLM hashes it."""
    lora_id: int | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None


NO_ORIGIN = BlockOrigin()


class KVEventRecorder:
    def __init__(self, config: KVEventsConfig, block_size: int, publisher,
                 origin_of: Callable[[object], BlockOrigin] | None = None,
                 memo_size: int = 1 << 16):
        """`publisher`: has `publish(batch)` and `shutdown()`. `origin_of(sequence)`: the
        sequence's LoRA adapter and (the user's) cache salt; None: the base model, no salt."""
        self.block_size = block_size
        self.publisher = publisher
        self._format = config.block_hash_format
        self._origin_of = origin_of or (lambda seq: NO_ORIGIN)
        self._root = hashing.none_hash()
        self._digest_of: OrderedDict[bytes, bytes] = OrderedDict()   # our key -> vLLM digest
        self._cached: dict[bytes, bytes] = {}        # the same, for the blocks cached now
        self._memo_size = memo_size
        self._pending: list = []
        self._closed = False
        self.num_events = 0
        self.num_batches = 0          # batches handed to the publisher (sequence numbers)

    # ---- the observer (called by the prefix index) ---------------------------------------
    def stored(self, key: bytes, token_ids: tuple[int, ...], origin) -> None:
        seq, index = origin
        who = self._origin_of(seq)
        digest = self._digest(seq, index, who)
        parent = None if index == 0 else self._digest(seq, index - 1, who)
        extra = hashing.event_extra_keys(
            hashing.block_extra_keys(index, who.lora_name, who.lora_path, who.cache_salt))
        self._cached[key] = digest
        out_hash = hashing.external_hash(digest, self._format)
        last = self._pending[-1] if self._pending else None
        if (isinstance(last, BlockStored) and parent is not None
                and last.block_hashes[-1] == hashing.external_hash(parent, self._format)
                and last.lora_name == who.lora_name):
            last.block_hashes.append(out_hash)
            last.token_ids.extend(token_ids)
            last.extra_keys.append(extra)
            return
        self._pending.append(BlockStored(
            block_hashes=[out_hash],
            parent_block_hash=None if parent is None else hashing.external_hash(parent, self._format),
            token_ids=list(token_ids), block_size=self.block_size, lora_id=who.lora_id,
            medium=MEDIUM_ENGINE_POOL, lora_name=who.lora_name, extra_keys=[extra],
            group_idx=0))

    def removed(self, key: bytes) -> None:
        digest = self._cached.pop(key)
        self._pending.append(BlockRemoved(
            block_hashes=[hashing.external_hash(digest, self._format)],
            medium=MEDIUM_ENGINE_POOL, group_idx=0))

    def cleared(self) -> None:
        self._cached.clear()
        self._pending.append(AllBlocksCleared())

    # ---- the engine's calls --------------------------------------------------------------
    def flush(self) -> None:
        """Publishes what the cache did since the last flush, as one batch (if anything)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self.num_events += len(events)
        self.num_batches += 1
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        """Publishes what is pending and stops the publisher (again: nothing happens)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self.publisher.shutdown()

    # ---- hashes --------------------------------------------------------------------------
    def _digest(self, seq, index: int, who: BlockOrigin) -> bytes:
        """vLLM's digest of block `index` of `seq` (its own key is seq.block_keys[index])."""
        keys, bs = seq.block_keys, self.block_size
        first = index
        while first >= 0 and keys[first] not in self._digest_of:
            first -= 1
        parent = self._digest_of[keys[first]] if first >= 0 else None
        for i in range(first + 1, index + 1):
            extra = hashing.block_extra_keys(i, who.lora_name, who.lora_path, who.cache_salt)
            parent = hashing.hash_block_tokens(parent, seq.tokens(i * bs, (i + 1) * bs), extra,
                                               self._root)
            self._remember(keys[i], parent)
        self._digest_of.move_to_end(keys[index])
        return parent

    def _remember(self, key: bytes, digest: bytes) -> None:
        self._digest_of[key] = digest
        if len(self._digest_of) > self._memo_size:
            self._digest_of.popitem(last=False)
