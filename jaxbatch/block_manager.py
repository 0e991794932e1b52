"""The KV block pool, host side: free list, reference counts, one block table per sequence.
Pure Python, no JAX.

Block 0 is the null block: it is never handed out, so padded tokens and unused block-table
entries can point at it harmlessly. Usable blocks are 1 .. num_blocks - 1.
Reference counts make prefix sharing a later addition, not a rewrite: `fork` shares a table.
"""
from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks still to allocate so that `seq_id` can hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens) <= len(self._free)

    # ---- changes -------------------------------------------------------------------------
    def ensure_capacity(self, seq_id: int, num_tokens: int) -> None:
        """Grows the sequence's table to hold `num_tokens`; all or nothing."""
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {missing} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(missing):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)

    def free(self, seq_id: int) -> None:
        for block in self._tables.pop(seq_id, []):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (copy-on-write is the caller's job)."""
        if child_seq_id in self._tables:
            raise ValueError(f"sequence {child_seq_id} already owns blocks")
        table = list(self.block_table(parent_seq_id))
        for block in table:
            self._ref_counts[block] += 1
        self._tables[child_seq_id] = table

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """free + in use == total; no block both free and owned; ref counts match owners."""
        owners = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert NULL_BLOCK not in free and owners[NULL_BLOCK] == 0, "the null block was handed out"
        in_use = {b for b in range(self.num_blocks) if owners[b]}
        assert not (free & in_use), "a block is both free and owned"
        assert len(free) + len(in_use) == self.num_total_blocks, "blocks were lost"
        assert owners == self._ref_counts, "reference counts disagree with owners"
