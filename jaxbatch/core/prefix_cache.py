"""Automatic prefix caching, host side: which KV blocks hold which token prefixes. Pure Python.

A block's key is sha256 over its parent block's key and its own token ids, and the chain starts
from a root key that names the model, dtype, block size and the request's `cache_salt`. So a key
names the whole prefix up to the block's end, and requests with different salts (tenants) can
never meet. A hit also compares the stored token ids, so even a hash collision cannot serve
another prefix's KV: the stored parent key and token ids must match too, so a hit needs the
same tokens after the same (already matched) prefix.

`PrefixIndex` is the bookkeeping only: key -> block, and the cached blocks no sequence holds
(reference count 0) in least-recently-used order, evicted on demand. Which blocks may be
registered (only KV computed exactly as a cold run computes it) is the scheduler's rule.

`PrefixCacheObserver` is the one seam through which anything outside the core learns what the
cache holds: the index tells its observer (if any) of every block registered, every block
evicted and every reset, as they happen (jaxbatch/kv_events/ publishes them as vLLM's KV
events).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol


def root_key(namespace: str, cache_salt: str | None) -> bytes:
    """The chain's start: the engine's namespace (model, dtype, block size) and the salt."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(namespace.encode() + b"\x00" + salt).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_keys(keys: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int,
                num_blocks: int) -> list[bytes]:
    """Appends the keys of full blocks len(keys) .. num_blocks - 1 to `keys` (in place)."""
    for b in range(len(keys), num_blocks):
        parent = keys[b - 1] if b else root
        keys.append(block_key(parent, token_ids[b * block_size:(b + 1) * block_size]))
    return keys


class PrefixCacheObserver(Protocol):
    def stored(self, key: bytes, token_ids: tuple[int, ...], origin: Any) -> None:
        """A block entered the cache under `key` (`origin`: what its registrar passed: the
        KV cache manager passes (sequence, index of the block in it))."""

    def removed(self, key: bytes) -> None:
        """The block cached under `key` was evicted."""

    def cleared(self) -> None:
        """Every key was forgotten (a reset)."""


class PrefixIndex:
    def __init__(self, observer: PrefixCacheObserver | None = None):
        self.observer = observer
        self._block_of: dict[bytes, int] = {}
        # block -> (key, parent key, tokens)
        self._entry_of: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}
        # Cached blocks nobody holds, least recently used first: eviction pops from the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entry_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, key: bytes, parent: bytes, token_ids: Sequence[int]) -> int | None:
        block = self._block_of.get(key)
        if block is None or self._entry_of[block][1:] != (parent, tuple(token_ids)):
            return None
        return block

    def register(self, block: int, key: bytes, parent: bytes, token_ids: Sequence[int],
                 origin: Any = None) -> bool:
        """False (nothing changes) if the block is already cached or another block already
        holds this key (two sequences computed the same prefix at once: the first one wins).
        `origin` is handed to the observer as is."""
        if block in self._entry_of or key in self._block_of:
            return False
        tokens = tuple(token_ids)
        self._block_of[key] = block
        self._entry_of[block] = (key, parent, tokens)
        if self.observer is not None:
            self.observer.stored(key, tokens, origin)
        return True

    # ---- the evictable queue -------------------------------------------------------------
    def park(self, block: int) -> None:
        """The last holder let go of a cached block: it stays findable until evicted."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A hit takes a parked block back into use."""
        del self._evictable[block]

    def evict_oldest(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        self._forget(block)
        return block

    def _forget(self, block: int) -> None:
        key = self._entry_of.pop(block)[0]
        del self._block_of[key]
        if self.observer is not None:
            self.observer.removed(key)

    def clear(self) -> list[int]:
        """Forgets every key; returns the parked blocks, which become plain free blocks.
        Blocks in use stay with their holders and are freed uncached."""
        parked = list(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._entry_of.clear()
        if self.observer is not None:
            self.observer.cleared()
        return parked

    def check_invariants(self, ref_counts: list[int]) -> None:
        assert len(self._block_of) == len(self._entry_of), "key index and block index disagree"
        for key, block in self._block_of.items():
            assert self._entry_of[block][0] == key, f"block {block} is indexed under another key"
        assert 0 not in self._entry_of, "the null block is cached"
        for block in self._evictable:
            assert block in self._entry_of, f"parked block {block} has no key"
            assert ref_counts[block] == 0, f"parked block {block} is in use"
