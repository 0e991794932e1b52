"""Prefix caching on the host side, no JAX: the key chain, the block manager's cached / parked /
free bookkeeping and eviction order, and the scheduler's hits (on chunk boundaries, short of the
last token, salted, never on a collision), driven with fake step results. Output equality with
the cache on and off is in test_prefix_caching_engine.py."""
from __future__ import annotations

import random

import pytest

from jaxbatch.core import prefix_cache
from jaxbatch.core.block_manager import BlockManager
from jaxbatch.core.prefix_cache import block_key, extend_keys, root_key
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.sampling_params import SamplingParams
from scheduler_sim import Sim, assert_drained, check_scheduler

BS = 4
ROOT = b"r"


# ---- keys --------------------------------------------------------------------------------------
def test_keys_chain_the_whole_prefix_and_the_salt():
    root = root_key("model|float32|bs=4", None)
    a = extend_keys([], root, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS, 2)
    assert len(a) == 2 and a[0] == block_key(root, [1, 2, 3, 4])
    assert a[1] == block_key(a[0], [5, 6, 7, 8])
    # Same second block after a different first block: a different key.
    b = extend_keys([], root, [0, 2, 3, 4, 5, 6, 7, 8], BS, 2)
    assert b[1] != a[1]
    # Incremental extension gives the same keys as computing them at once.
    inc = extend_keys([], root, list(range(12)), BS, 1)
    extend_keys(inc, root, list(range(12)), BS, 3)
    assert inc == extend_keys([], root, list(range(12)), BS, 3)
    salted = root_key("model|float32|bs=4", "tenant-a")
    assert len({root, salted, root_key("model|float32|bs=4", "tenant-b"),
                root_key("model|bfloat16|bs=4", None)}) == 4


# ---- block manager -----------------------------------------------------------------------------
def cache_blocks(bm: BlockManager, seq_id: int, tokens: list[int], root=b"r") -> list[bytes]:
    """Allocates `tokens` for `seq_id` and registers all its full blocks."""
    bm.ensure_capacity(seq_id, len(tokens))
    keys = extend_keys([], root, tokens, bm.block_size, len(tokens) // bm.block_size)
    for i, key in enumerate(keys):
        bm.register_cached(seq_id, i, key, keys[i - 1] if i else root, tokens[i * BS:(i + 1) * BS])
    return keys


def test_freed_cached_blocks_are_parked_counted_free_and_found_again():
    bm = BlockManager(9, BS, enable_prefix_caching=True)
    tokens = list(range(10, 22))                          # 3 full blocks
    keys = cache_blocks(bm, 1, tokens)
    table = list(bm.block_table(1))
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks      # parked blocks count as free
    assert bm.prefix_index.num_evictable == 3
    assert bm.cached_prefix(keys, tokens, ROOT) == table
    assert bm.cached_prefix(keys[:2], tokens, ROOT) == table[:2]
    # Taking parked hits back costs free blocks; shared in-use hits cost nothing.
    assert bm.num_blocks_taken_by(table[:2], 12) == 1 + 2
    bm.share_cached(2, table[:2])
    bm.check_invariants()
    assert bm.num_free_blocks == 8 - 2 and bm.prefix_index.num_evictable == 1
    assert bm.num_blocks_taken_by(table[:2], 12) == 1
    bm.share_cached(3, table[:2])
    assert [bm._ref_counts[b] for b in table[:2]] == [2, 2]
    bm.ensure_capacity(3, 12)
    assert bm.block_table(3)[:2] == table[:2]
    bm.check_invariants()
    for s in (2, 3):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_free_blocks_are_used_before_evicting_and_eviction_is_lru_tail_first():
    bm = BlockManager(8, BS, enable_prefix_caching=True)  # 7 usable
    a = list(range(100, 112))
    b = list(range(200, 212))
    keys_a = cache_blocks(bm, 1, a)
    keys_b = cache_blocks(bm, 2, b)
    table_a, table_b = list(bm.block_table(1)), list(bm.block_table(2))
    bm.free(1)                                            # a is older than b in the queue
    bm.free(2)
    assert len(bm._free) == 1
    bm.ensure_capacity(3, 4)                              # the one never-cached block first
    assert bm.prefix_index.num_evictable == 6
    bm.ensure_capacity(3, 8)                              # then a's tail block
    assert bm.block_table(3)[1] == table_a[2]
    assert bm.cached_prefix(keys_a, a, ROOT) == table_a[:2]
    assert bm.cached_prefix(keys_b, b, ROOT) == table_b
    bm.ensure_capacity(3, 16)                             # a's middle then first block
    assert bm.block_table(3)[2:] == [table_a[1], table_a[0]]
    assert bm.cached_prefix(keys_a, a, ROOT) == []
    assert bm.cached_prefix(keys_b, b, ROOT) == table_b
    bm.check_invariants()


def test_a_hit_refreshes_recency():
    bm = BlockManager(7, BS, enable_prefix_caching=True)  # 6 usable
    a, b = list(range(100, 108)), list(range(200, 208))
    keys_a, keys_b = cache_blocks(bm, 1, a), cache_blocks(bm, 2, b)
    bm.free(1)
    bm.free(2)
    bm.share_cached(3, bm.cached_prefix(keys_a, a, ROOT))       # a used again: now the newest
    bm.free(3)
    bm.ensure_capacity(4, 16)                             # 2 free + 2 evicted: b's
    assert bm.cached_prefix(keys_b, b, ROOT) == []
    assert len(bm.cached_prefix(keys_a, a, ROOT)) == 2


def test_reset_forgets_everything_and_in_use_blocks_free_uncached():
    bm = BlockManager(9, BS, enable_prefix_caching=True)
    keys = cache_blocks(bm, 1, list(range(8)))
    cache_blocks(bm, 2, list(range(50, 58)), root=b"other")
    bm.free(2)
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.prefix_index.num_evictable == 0 and len(bm.prefix_index) == 0
    assert bm.cached_prefix(keys, list(range(8)), ROOT) == []
    bm.free(1)
    bm.check_invariants()
    assert len(bm._free) == bm.num_total_blocks


def test_a_second_block_with_the_same_key_is_not_registered():
    bm = BlockManager(9, BS, enable_prefix_caching=True)
    tokens = list(range(8))
    keys = cache_blocks(bm, 1, tokens)
    cache_blocks(bm, 2, tokens)                           # computed the same prefix at once
    assert bm.cached_prefix(keys, tokens, ROOT) == bm.block_table(1)
    assert not any(bm.prefix_index.is_cached(b) for b in bm.block_table(2))
    bm.free(2)
    assert len(bm._free) == 8 - 2 and bm.prefix_index.num_evictable == 0
    bm.check_invariants()


def test_a_key_collision_never_serves_other_tokens():
    bm = BlockManager(9, BS, enable_prefix_caching=True)
    cache_blocks(bm, 1, [1, 2, 3, 4])
    key = bm.prefix_index._entry_of[bm.block_table(1)[0]][0]
    assert bm.cached_prefix([key], [1, 2, 3, 5], ROOT) == []
    assert bm.cached_prefix([key], [1, 2, 3, 4], ROOT) == bm.block_table(1)


def test_a_colliding_key_after_a_different_prefix_is_refused():
    """Keys that ignore the parent (a collision model): A = X|Y registers Y after X; C = Z|Y
    registers Z (its Y loses to A's). B = Z|Y finds C's Z, but A's Y was computed after X, not
    Z: the stored parent key refuses it."""
    bm = BlockManager(12, BS, enable_prefix_caching=True)
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    key = lambda tokens: bytes(tokens) * 8          # noqa: E731 - depends on the block only
    for seq_id, blocks in ((1, [x, y]), (2, [z, y])):
        bm.ensure_capacity(seq_id, 8)
        for i, tokens in enumerate(blocks):
            bm.register_cached(seq_id, i, key(tokens), key(blocks[i - 1]) if i else ROOT, tokens)
    assert bm.cached_prefix([key(z), key(y)], z + y, ROOT) == bm.block_table(2)[:1]
    assert bm.cached_prefix([key(x), key(y)], x + y, ROOT) == bm.block_table(1)


@pytest.mark.parametrize("corrupt", ["parked_in_use", "parked_and_free", "parked_uncached",
                                     "free_with_key", "cached_null"])
def test_check_invariants_detects_cache_corruption(corrupt):
    bm = BlockManager(9, BS, enable_prefix_caching=True)
    cache_blocks(bm, 1, list(range(8)))
    cache_blocks(bm, 2, list(range(20, 28)), root=b"x")
    bm.free(2)
    bm.check_invariants()
    index = bm.prefix_index
    held, parked = bm.block_table(1)[0], next(iter(index._evictable))
    if corrupt == "parked_in_use":
        index._evictable[held] = None
    elif corrupt == "parked_and_free":
        bm._free.append(parked)
    elif corrupt == "parked_uncached":
        index._forget(parked)
    elif corrupt == "free_with_key":
        index.register(bm._free[0], b"k" * 32, ROOT, [0] * BS)
    elif corrupt == "cached_null":
        index.register(0, b"n" * 32, ROOT, [0] * BS)
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---- scheduler ---------------------------------------------------------------------------------
def cached_sim(**config) -> Sim:
    config.setdefault("block_size", BS)
    config.setdefault("prefill_chunk_size", 8)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 4)
    return Sim(enable_prefix_caching=True, **config)


BASE = [30 + i % 40 for i in range(64)]


@pytest.mark.parametrize("prompt_len, expected_hit", [
    (3, 0), (4, 0), (8, 0),            # shorter than a block, a block, exactly a chunk
    (9, 8), (16, 8), (17, 16),         # a chunk plus one token; the last token is computed
    (27, 24),                          # several chunks plus a partial block
])
def test_a_warm_prompt_starts_at_its_last_full_chunk_boundary(prompt_len, expected_hit):
    sim = cached_sim()
    cold = sim.add(prompt=BASE[:prompt_len], max_tokens=2)
    sim.run()
    assert cold.num_cached_tokens == 0
    warm = sim.add(prompt=BASE[:prompt_len], max_tokens=2)
    plan = sim.step()
    assert warm.num_cached_tokens == expected_hit
    starts = [c.start for c in plan.prefills if c.seq_id == warm.seq_id]
    decodes = [d.position for d in plan.decodes if d.seq_id == warm.seq_id]
    # It continues exactly where a cold run would be after `expected_hit` tokens.
    assert starts == [expected_hit] or decodes == [expected_hit] == [prompt_len - 1]
    sim.run()
    assert sim.sched.prefix_cache_hits == expected_hit
    assert sim.sched.prefix_cache_queries == 2 * prompt_len


def test_only_full_prefill_chunks_are_registered():
    sim = cached_sim()
    seq = sim.add(prompt=BASE[:13], max_tokens=12)         # chunks [0, 8) full, [8, 13) partial
    sim.run()
    index = sim.sched.blocks.prefix_index
    assert len(index) == 2                                 # the two blocks of the full chunk
    # Decode-computed positions 13..24 were never registered: a longer prompt sharing the
    # whole output still hits only the first chunk.
    longer = sim.add(prompt=seq.tokens(0, 25) + [5], max_tokens=1)
    sim.run()
    assert longer.num_cached_tokens == 8


def test_different_salts_never_hit_and_the_same_salt_does():
    sim = cached_sim()
    sim.add(prompt=BASE[:20], max_tokens=1, cache_salt="a")
    sim.run()
    other = sim.add(prompt=BASE[:20], max_tokens=1, cache_salt="b")
    unsalted = sim.add(prompt=BASE[:20], max_tokens=1)
    same = sim.add(prompt=BASE[:20], max_tokens=1, cache_salt="a")
    sim.run()
    assert (other.num_cached_tokens, unsalted.num_cached_tokens, same.num_cached_tokens) == (0, 0, 16)


def test_prompt_logprobs_requests_compute_their_prompt_but_fill_the_cache():
    sim = cached_sim()
    sim.add(prompt=BASE[:20], max_tokens=1)
    sim.run()
    wants = sim.add(prompt=BASE[:20], max_tokens=1, prompt_logprobs=2)
    sim.run()
    assert wants.num_cached_tokens == 0
    assert chunks_of_seq(sim, wants.seq_id)[0] == (0, 8)
    sim2 = cached_sim()
    sim2.add(prompt=BASE[:20], max_tokens=1, prompt_logprobs=0)
    sim2.run()
    later = sim2.add(prompt=BASE[:20], max_tokens=1)
    sim2.run()
    assert later.num_cached_tokens == 16


def chunks_of_seq(sim: Sim, seq_id: int) -> list[tuple[int, int]]:
    return [(c.start, len(c.token_ids)) for p in sim.plans for c in p.prefills if c.seq_id == seq_id]


def add_siblings(sim: Sim, prompt: list[int], n: int, **params) -> list[Sequence]:
    sp = SamplingParams(n=n, **params)
    seqs = []
    for i in range(n):
        seq = Sequence(sim._next_id, "req-n", i, list(prompt), sp, seed=i, arrival_time=0.0,
                       arrival_step=0)
        sim._next_id += 1
        sim.seqs[seq.seq_id] = seq
        sim.sched.add(seq)
        seqs.append(seq)
    return seqs


def test_n_samples_compute_the_shared_prompt_once():
    sim = cached_sim(max_num_seqs=4)
    seqs = add_siblings(sim, BASE[:30], 3, max_tokens=3)
    sim.run()
    assert chunks_of_seq(sim, seqs[0].seq_id) == [(0, 8), (8, 8), (16, 8), (24, 6)]
    for s in seqs[1:]:
        assert s.num_cached_tokens == 24
        assert chunks_of_seq(sim, s.seq_id) == [(24, 6)]
    assert sim.sched.prefix_cache_hits == 48


def test_a_preempted_sequence_finds_its_own_blocks_again():
    # 24 usable blocks of 4: both 30-token prompts fit, both grown to 60 tokens do not; the
    # survivor's growth evicts the victim's parked tail blocks but not its prompt's first ones.
    sim = cached_sim(num_blocks=25, max_num_seqs=2, max_model_len=64)
    a = sim.add(prompt=BASE[:30], max_tokens=30, ignore_eos=True)
    b = sim.add(prompt=[90 + i % 7 for i in range(30)], max_tokens=30, ignore_eos=True)
    sim.run()
    victims = [s for s in (a, b) if s.num_preemptions]
    assert victims, "the pool was meant to force a preemption"
    for v in victims:
        restarts = [start for start, _ in chunks_of_seq(sim, v.seq_id) if start % 8 == 0]
        # After the preemption its prefill resumes past the prompt's cached chunks.
        assert restarts[:4] == [0, 8, 16, 24] and restarts[4] >= 24


def test_random_soak_with_aborts_and_eviction_keeps_every_invariant():
    """Shared and private prefixes, random lengths, a pool small enough that cached blocks are
    evicted and sequences preempted, random aborts; Sim.step checks the scheduler and block
    invariants after every step, and nothing is left held at the end."""
    rng = random.Random(5)
    sim = cached_sim(num_blocks=24, max_num_seqs=4, max_model_len=80)
    prefixes = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(3)]
    steps = 0
    for i in range(120):
        if rng.random() < 0.7:
            base = rng.choice(prefixes)
            prompt = base[:rng.randint(1, 40)] + [rng.randrange(3, 200) for _ in range(rng.randint(0, 6))]
        else:
            prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        sim.add(prompt=prompt, max_tokens=rng.randint(1, 20), ignore_eos=True,
                cache_salt=rng.choice([None, None, "t"]))
        for _ in range(rng.randint(0, 3)):
            sim.step()
            steps += 1
        live = [s for s in sim.sched.running + sim.sched.waiting]
        if live and rng.random() < 0.15:
            sim.sched.finish(rng.choice(live), SequenceStatus.FINISHED_ABORTED)
            check_scheduler(sim.sched)
    sim.run(max_steps=3000)
    assert_drained(sim.sched)
    assert sim.sched.prefix_cache_hits > 0 and sim.sched.num_preemptions > 0
    assert sim.sched.blocks.prefix_index.num_evictable > 0


def test_without_prefix_caching_nothing_is_cached():
    sim = Sim(block_size=BS, prefill_chunk_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    sim.add(prompt=BASE[:20], max_tokens=1)
    sim.run()
    again = sim.add(prompt=BASE[:20], max_tokens=1)
    sim.run()
    assert again.num_cached_tokens == 0 and sim.sched.prefix_cache_queries == 0
    assert sim.sched.blocks.prefix_index is None


def test_forced_collision_in_the_scheduler_serves_no_wrong_blocks(monkeypatch):
    """Every key the same: at most one block is registered, and token comparison refuses it
    to any prefix it does not hold."""
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: b"same" * 8)
    sim = cached_sim()
    sim.add(prompt=BASE[:20], max_tokens=1)
    sim.run()
    other = sim.add(prompt=[7] * 20, max_tokens=1)
    sim.run()
    assert other.num_cached_tokens == 0
    assert chunks_of_seq(sim, other.seq_id)[0] == (0, 8)


def test_serve_flag_turns_prefix_caching_off():
    from jaxbatch.engine.config import engine_kwargs_from_args as engine_kwargs
    from jaxbatch.entrypoints.cli import _parser
    on = engine_kwargs(_parser().parse_args(["serve"]))
    off = engine_kwargs(_parser().parse_args(["serve", "--no-enable-prefix-caching"]))
    assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False


def test_parked_hits_are_not_charged_twice_at_admission():
    """9 usable blocks: a 17-token prompt leaves 4 parked blocks; two more requests with the
    same prompt each need one new block beside the shared hits, so both are admitted at once."""
    sim = cached_sim(num_blocks=10, max_model_len=36, max_num_seqs=4)
    sim.add(prompt=BASE[:17], max_tokens=1)
    sim.run()
    a = sim.add(prompt=BASE[:17], max_tokens=2)
    b = sim.add(prompt=BASE[:17], max_tokens=2)
    sim.step()
    assert a.num_cached_tokens == 16 and b.num_cached_tokens == 16
    assert not sim.sched.waiting
    sim.run()


def test_a_run_cut_by_eviction_is_used_only_in_whole_chunks():
    """Chunk 8, blocks of 4: a 17-token prompt caches 4 blocks (2 chunks). Evicting its tail
    block leaves 3 cached blocks, of which only the first chunk (2 blocks) may be used: a hit
    ending mid-chunk would compute the rest of that chunk differently from a cold run."""
    sim = cached_sim(num_blocks=10, max_model_len=36)
    sim.add(prompt=BASE[:17], max_tokens=1)
    sim.run()
    blocks = sim.sched.blocks
    assert blocks.prefix_index.num_evictable == 4
    blocks.ensure_capacity(999, 4 * (len(blocks._free) + 1))   # every free block + 1 parked
    assert blocks.prefix_index.num_evictable == 3
    blocks.free(999)
    assert sim.sched.cached_prefix_tokens(BASE[:17]) == 8
    again = sim.add(prompt=BASE[:17], max_tokens=1)
    sim.step()
    assert again.num_cached_tokens == 8
    sim.run()
