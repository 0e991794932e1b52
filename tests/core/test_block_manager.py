"""BlockManager: unit tests, and a hypothesis state machine that drives random sequences of
allocate / grow / free / fork / preempt-and-reallocate against a plain model of who owns what.

Every check here is computed from the public API (block_table, num_free_blocks), independently
of BlockManager.check_invariants, which is run too and is itself tested on corrupted states.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant, precondition,
                                 rule)

from jaxbatch.core.block_manager import NULL_BLOCK, BlockManager


def snapshot(bm: BlockManager, seq_ids) -> tuple:
    return (bm.num_free_blocks, {s: list(bm.block_table(s)) for s in seq_ids},
            list(bm._free), list(bm._ref_counts))


def owned_blocks(bm: BlockManager, seq_ids) -> set[int]:
    return {b for s in seq_ids for b in bm.block_table(s)}


# ---- unit tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(1, 16), (0, 16), (4, 0)])
def test_constructor_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_counts_and_blocks_for():
    bm = BlockManager(9, 4)
    assert bm.num_total_blocks == 8 and bm.num_free_blocks == 8
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.block_table(42) == [] and bm.num_missing_blocks(42, 9) == 3
    assert bm.can_hold(42, 32) and not bm.can_hold(42, 33)


def test_exhausting_the_pool_never_hands_out_the_null_block():
    bm = BlockManager(6, 2)
    for seq_id in range(5):
        bm.ensure_capacity(seq_id, 2)
        bm.check_invariants()
    handed = [bm.block_table(s)[0] for s in range(5)]
    assert sorted(handed) == [1, 2, 3, 4, 5]
    assert bm.num_free_blocks == 0
    with pytest.raises(MemoryError):
        bm.ensure_capacity(99, 1)


def test_growth_keeps_the_prefix_and_is_idempotent():
    bm = BlockManager(10, 4)
    bm.ensure_capacity(1, 3)
    first = list(bm.block_table(1))
    assert len(first) == 1
    bm.ensure_capacity(1, 4)                      # still fits in one block
    assert bm.block_table(1) == first
    bm.ensure_capacity(1, 13)
    table = list(bm.block_table(1))
    assert len(table) == 4 and table[:1] == first and len(set(table)) == 4
    bm.ensure_capacity(1, 5)                      # shrinking requests allocate nothing
    assert bm.block_table(1) == table and bm.num_free_blocks == 9 - 4
    bm.check_invariants()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(6, 4)                       # 5 usable
    bm.ensure_capacity(1, 8)                      # 2 blocks
    bm.ensure_capacity(2, 4)                      # 1 block
    before = snapshot(bm, [1, 2, 3])
    with pytest.raises(MemoryError):
        bm.ensure_capacity(1, 8 + 4 * 3)          # needs 3 more, 2 free
    with pytest.raises(MemoryError):
        bm.ensure_capacity(3, 12)                 # a new sequence needing 3
    assert snapshot(bm, [1, 2, 3]) == before
    bm.check_invariants()
    bm.ensure_capacity(1, 16)                     # exactly the 2 free ones: succeeds
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_returns_blocks_and_unknown_free_is_a_no_op():
    bm = BlockManager(8, 2)
    bm.ensure_capacity(1, 5)
    bm.ensure_capacity(2, 2)
    bm.free(1)
    assert bm.block_table(1) == [] and bm.num_free_blocks == 7 - 1
    bm.free(1)
    bm.free(12345)
    assert bm.num_free_blocks == 6
    bm.check_invariants()
    bm.free(2)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_free_blocks_are_handed_out_lowest_first_whatever_the_release_order():
    # Requests that came and went leave the free blocks in release order; a new sequence still
    # gets the lowest ones, ascending (adjacent pages read as one stream on CPU).
    bm = BlockManager(13, 1)
    for seq in range(4):
        bm.ensure_capacity(seq, 3)                # seq s holds blocks 3s+1 .. 3s+3
    for seq in (3, 0, 2):
        bm.free(seq)
    bm.ensure_capacity(9, 7)
    assert bm.block_table(9) == [1, 2, 3, 7, 8, 9, 10]
    bm.check_invariants()


def test_fork_shares_blocks_until_the_last_owner_frees():
    bm = BlockManager(8, 4)
    bm.ensure_capacity(1, 8)
    parent = list(bm.block_table(1))
    bm.fork(1, 2)
    assert bm.block_table(2) == parent
    assert bm.num_free_blocks == 7 - 2            # sharing allocates nothing
    assert all(bm._ref_counts[b] == 2 for b in parent)
    bm.check_invariants()
    bm.ensure_capacity(2, 12)                     # the child grows on its own
    child = bm.block_table(2)
    assert child[:2] == parent and child[2] not in parent
    assert bm.block_table(1) == parent
    bm.free(1)                                    # the child still holds the shared blocks
    assert bm.num_free_blocks == 7 - 3
    bm.check_invariants()
    bm.free(2)
    assert bm.num_free_blocks == 7
    bm.check_invariants()


def test_fork_into_an_existing_sequence_is_rejected():
    bm = BlockManager(8, 4)
    bm.ensure_capacity(1, 4)
    bm.ensure_capacity(2, 4)
    before = snapshot(bm, [1, 2])
    with pytest.raises(ValueError):
        bm.fork(1, 2)
    assert snapshot(bm, [1, 2]) == before


@pytest.mark.parametrize("corrupt", ["double_free_entry", "null_in_free", "null_owned",
                                     "lost_block", "free_and_owned", "bad_refcount"])
def test_check_invariants_detects_corruption(corrupt):
    bm = BlockManager(8, 4)
    bm.ensure_capacity(1, 8)
    bm.ensure_capacity(2, 4)
    bm.check_invariants()
    owned = bm.block_table(1)[0]
    if corrupt == "double_free_entry":
        bm._free.append(bm._free[0])
    elif corrupt == "null_in_free":
        bm._free.append(NULL_BLOCK)
    elif corrupt == "null_owned":
        bm._tables[2].append(NULL_BLOCK)
        bm._ref_counts[NULL_BLOCK] += 1
    elif corrupt == "lost_block":
        bm._free.pop()
    elif corrupt == "free_and_owned":
        bm._free.append(owned)
    elif corrupt == "bad_refcount":
        bm._ref_counts[owned] += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---- property-based: random operation sequences -----------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """The model: which sequence ids exist and which have been forked from which (only forks
    may share blocks)."""

    live = Bundle("live")

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.ids: set[int] = set()
        self.next_id = 0
        self.shared_ok: set[frozenset] = set()    # pairs allowed to share blocks (fork lineage)

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def create(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _grow(self, seq_id, num_tokens):
        bm = self.bm
        tracked = sorted(self.ids | {seq_id})
        before = snapshot(bm, tracked)
        old_table = list(bm.block_table(seq_id))
        others = owned_blocks(bm, self.ids - {seq_id})
        missing = max(0, bm.blocks_for(num_tokens) - len(old_table))
        assert bm.num_missing_blocks(seq_id, num_tokens) == missing
        if missing > bm.num_free_blocks:
            assert not bm.can_hold(seq_id, num_tokens)
            with pytest.raises(MemoryError):
                bm.ensure_capacity(seq_id, num_tokens)
            assert snapshot(bm, tracked) == before, "a failed allocation changed state"
            return False
        assert bm.can_hold(seq_id, num_tokens)
        bm.ensure_capacity(seq_id, num_tokens)
        table = bm.block_table(seq_id)
        assert table[:len(old_table)] == old_table, "growth rewrote existing entries"
        new = table[len(old_table):]
        assert len(new) == missing
        assert len(table) >= bm.blocks_for(num_tokens)
        assert not set(new) & (others | set(old_table)), "a block handed out twice"
        assert NULL_BLOCK not in new
        assert bm.num_free_blocks == before[0] - missing
        return True

    @precondition(lambda self: self.bm is not None)
    @rule(target=live, num_tokens=st.integers(0, 80))
    def allocate(self, num_tokens):
        seq_id = self._new_id()
        self._grow(seq_id, num_tokens)
        self.ids.add(seq_id)
        return seq_id

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=live, extra=st.integers(0, 40))
    def append(self, seq_id, extra):
        if seq_id in self.ids:
            current = len(self.bm.block_table(seq_id)) * self.bm.block_size
            self._grow(seq_id, current + extra)

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=consumes(live))
    def free(self, seq_id):
        if seq_id not in self.ids:
            return
        bm = self.bm
        mine = set(bm.block_table(seq_id))
        self.ids.discard(seq_id)
        still_owned = owned_blocks(bm, self.ids)
        free_before = bm.num_free_blocks
        bm.free(seq_id)
        assert bm.block_table(seq_id) == []
        assert bm.num_free_blocks == free_before + len(mine - still_owned)

    @precondition(lambda self: self.bm is not None)
    @rule(target=live, parent=live)
    def fork(self, parent):
        if parent not in self.ids:
            return parent
        bm = self.bm
        child = self._new_id()
        free_before = bm.num_free_blocks
        bm.fork(parent, child)
        assert bm.block_table(child) == bm.block_table(parent)
        assert bm.num_free_blocks == free_before
        for other in list(self.ids):
            if frozenset((other, parent)) in self.shared_ok or other == parent:
                self.shared_ok.add(frozenset((other, child)))
        self.ids.add(child)
        return child

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=live, num_tokens=st.integers(1, 80))
    def preempt_and_reallocate(self, seq_id, num_tokens):
        """Recompute-style preemption: drop every block, later ask again from scratch."""
        if seq_id not in self.ids:
            return
        self.ids.discard(seq_id)
        self.bm.free(seq_id)
        self.shared_ok = {p for p in self.shared_ok if seq_id not in p}
        if self._grow(seq_id, num_tokens):
            self.ids.add(seq_id)
        else:
            assert self.bm.block_table(seq_id) == []

    @invariant()
    def invariants_hold(self):
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants()
        owned = owned_blocks(bm, self.ids)
        assert NULL_BLOCK not in owned
        assert all(1 <= b < bm.num_blocks for b in owned)
        assert bm.num_free_blocks + len(owned) == bm.num_total_blocks, "free + in use != total"
        ids = sorted(self.ids)
        for s in ids:
            table = bm.block_table(s)
            assert len(set(table)) == len(table), f"sequence {s} holds a block twice"
        for i, a in enumerate(ids):
            for b in ids[i + 1:]:
                if frozenset((a, b)) not in self.shared_ok:
                    common = set(bm.block_table(a)) & set(bm.block_table(b))
                    assert not common, f"blocks {common} owned by {a} and {b} without a fork"

    def teardown(self):
        if self.bm is None:
            return
        for s in list(self.ids):
            self.bm.free(s)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks, "blocks leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
