"""Which replica was last sent which prompt prefixes: the Ray router's picture of the replicas'
prefix caches (the router cannot see inside them; the in-process DataParallelEngine asks its
replicas' caches directly).

A routing key is cut into chunks of `chunk_chars` characters and each chunk's prefix is hashed
in a chain, as the engine hashes its KV blocks: a replica "holds" a prefix up to the last chunk
whose chain hash it was sent. Each replica keeps at most `max_chunks` hashes, least recently used
dropped first, as its cache evicts. Pure Python, no Ray.
"""
from __future__ import annotations

import collections
import hashlib


class PrefixIndex:
    def __init__(self, chunk_chars: int = 64, max_chunks: int = 100_000):
        if chunk_chars < 1 or max_chunks < 1:
            raise ValueError("chunk_chars and max_chunks must be at least 1")
        self.chunk_chars, self.max_chunks = chunk_chars, max_chunks
        self._held: dict[str, collections.OrderedDict] = {}

    def _chain(self, key: str) -> list[bytes]:
        hashes, parent = [], b""
        for start in range(0, len(key) - self.chunk_chars + 1, self.chunk_chars):
            chunk = key[start:start + self.chunk_chars].encode("utf-8", "surrogatepass")
            parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def matched(self, replica: str, key: str) -> int:
        """Characters of `key`'s prefix that `replica` was sent before (whole chunks)."""
        held = self._held.get(replica)
        count = 0
        if held:
            for h in self._chain(key):
                if h not in held:
                    break
                count += 1
        return count * self.chunk_chars

    def record(self, replica: str, key: str) -> None:
        held = self._held.setdefault(replica, collections.OrderedDict())
        for h in self._chain(key):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def forget(self, replica: str) -> None:
        self._held.pop(replica, None)

    def replicas(self) -> list[str]:
        return list(self._held)
