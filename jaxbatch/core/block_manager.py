"""The KV block pool, host side: free list, reference counts, one block table per sequence,
and (with prefix caching) the index of blocks whose contents are known. Pure Python, no JAX.

Block 0 is the null block: it is never handed out, so padded tokens and unused block-table
entries can point at it harmlessly. Usable blocks are 1 .. num_blocks - 1.

Every usable block is in exactly one place:
  free      never cached, or forgotten: handed out first, lowest number first
  parked    cached and held by nobody (reference count 0): still findable by a prefix hit,
            evicted least recently used first when the free list is empty
  in use    in one or more block tables (reference count = number of tables)
Parked blocks count as free (`num_free_blocks`): they are evicted on demand.

Why lowest first: a sequence's blocks then lie in ascending, mostly adjacent pages of the pool.
On CPU the decode attention reads a row's pages in table order, and adjacent pages are one
stream for the hardware prefetcher and the TLB; a free list in release order scatters every
table over the pool once requests have come and gone, and scattered pages read slower
(`python -m benchmarks attention-read` times both layouts).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from jaxbatch.core.prefix_cache import PrefixIndex

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(1, num_blocks))      # a min-heap
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self.prefix_index = PrefixIndex() if enable_prefix_caching else None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        parked = self.prefix_index.num_evictable if self.prefix_index else 0
        return len(self._free) + parked

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks still to allocate so that `seq_id` can hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens) <= self.num_free_blocks

    # ---- changes -------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        """Never-cached blocks first; only then the least recently used parked one."""
        if self._free:
            return heapq.heappop(self._free)
        return self.prefix_index.evict_oldest()

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> None:
        """Grows the sequence's table to hold `num_tokens`; all or nothing."""
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise MemoryError(f"sequence {seq_id} needs {missing} blocks, "
                              f"{self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(missing):
            block = self._take_free_block()
            self._ref_counts[block] = 1
            table.append(block)

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        """Gives back the blocks past what `num_tokens` tokens need (rejected proposals')."""
        table = self._tables.get(seq_id, [])
        keep = max(1, self.blocks_for(num_tokens))
        for block in reversed(table[keep:]):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._release_block(block)
        del table[keep:]

    def _release_block(self, block: int) -> None:
        if self.prefix_index is not None and self.prefix_index.is_cached(block):
            self.prefix_index.park(block)
        else:
            heapq.heappush(self._free, block)

    def free(self, seq_id: int) -> None:
        # Tail first: in the parked queue a sequence's last blocks are evicted before its
        # first ones, which other prompts are likelier to share.
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._release_block(block)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (copy-on-write is the caller's job)."""
        if child_seq_id in self._tables:
            raise ValueError(f"sequence {child_seq_id} already owns blocks")
        table = list(self.block_table(parent_seq_id))
        for block in table:
            self._ref_counts[block] += 1
        self._tables[child_seq_id] = table

    # ---- prefix caching ------------------------------------------------------------------
    def cached_prefix(self, keys: Sequence[bytes], token_ids: Sequence[int],
                      root: bytes) -> list[int]:
        """The cached blocks holding the longest prefix of these full-block `keys` (chained
        from `root`; each block's parent key and tokens are compared too)."""
        if self.prefix_index is None:
            return []
        bs, hits = self.block_size, []
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else root
            block = self.prefix_index.lookup(key, parent, token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_taken_by(self, hit_blocks: Sequence[int], num_tokens: int) -> int:
        """Free blocks (parked included) an admission with these hits consumes to hold
        `num_tokens`: new blocks for the rest, plus the parked hits it takes back into use."""
        parked = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        return max(0, self.blocks_for(num_tokens) - len(hit_blocks)) + parked

    def share_cached(self, seq_id: int, hit_blocks: Sequence[int]) -> None:
        """Starts a new sequence's table with cached blocks (a prefix hit)."""
        if self.block_table(seq_id):
            raise ValueError(f"sequence {seq_id} already owns blocks")
        for block in hit_blocks:
            if self._ref_counts[block] == 0:
                self.prefix_index.unpark(block)
            self._ref_counts[block] += 1
        self._tables[seq_id] = list(hit_blocks)

    def register_cached(self, seq_id: int, index: int, key: bytes, parent: bytes,
                        token_ids: Sequence[int], origin=None) -> None:
        """Block `index` of the sequence now holds exactly the KV a cold run computes for this
        prefix (`parent`: the previous block's key, or the root): later prompts may share it.
        `origin` goes to the prefix index's observer."""
        self.prefix_index.register(self._tables[seq_id][index], key, parent, token_ids, origin)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix; parked blocks become plain free blocks."""
        if self.prefix_index is not None:
            self._free.extend(self.prefix_index.clear())
            heapq.heapify(self._free)

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """free + parked + in use == total; no block in two places; ref counts match owners."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        free = set(self._free)
        parked = set(self.prefix_index._evictable) if self.prefix_index else set()
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert NULL_BLOCK not in free | parked and owners[NULL_BLOCK] == 0, \
            "the null block was handed out"
        in_use = {b for b in range(self.num_blocks) if owners[b]}
        assert not (free & in_use), "a block is both free and owned"
        assert not (parked & in_use), "a parked block is owned"
        assert not (free & parked), "a block is both free and parked"
        assert len(free) + len(parked) + len(in_use) == self.num_total_blocks, "blocks were lost"
        assert owners == self._ref_counts, "reference counts disagree with owners"
        if self.prefix_index is not None:
            self.prefix_index.check_invariants(self._ref_counts)
            assert not any(self.prefix_index.is_cached(b) for b in free), "a free block has a key"
