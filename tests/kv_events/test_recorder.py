"""The prefix cache's observer on the host side (no JAX): the KV cache manager stores, hits,
evicts and resets blocks, and the events say exactly that, with vLLM's hashes recomputed here
from the token ids (sha256 over canonical CBOR, chained from NONE_HASH). A router that applies
the events sees what the engine would serve: the test asks the engine and the events the same
question after every operation."""
from __future__ import annotations

import hashlib

import cbor2
import pytest

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.kv_cache_manager import KVCacheManager
from jaxbatch.core.request import Sequence
from jaxbatch.kv_events.config import KVEventsConfig
from jaxbatch.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from jaxbatch.kv_events.recorder import BlockOrigin, KVEventRecorder
from jaxbatch.sampling_params import SamplingParams

BS = 4
ROOT = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def expected_hashes(tokens, lora=None, salt=None) -> list[int]:
    """vLLM's chain for every full block of `tokens` (lora: (name, path))."""
    out, parent = [], ROOT
    for i in range(len(tokens) // BS):
        extra = ([("lora", *lora)] if lora else []) + ([("cache_salt", salt)] if i == 0 and salt else [])
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * BS:(i + 1) * BS]),
                                             tuple(extra) or None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & (2 ** 64 - 1))
    return out


class Collect:
    def __init__(self):
        self.batches = []

    def publish(self, batch):
        self.batches.append(batch)

    def shutdown(self):
        pass


class Router:
    """What an indexer keeps from the events: the hashes each pod holds."""

    def __init__(self):
        self.held: set[int] = set()

    def apply(self, batches) -> None:
        for batch in batches:
            for e in batch.events:
                if isinstance(e, BlockStored):
                    self.held.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= self.held, "a block removed that was never stored"
                    self.held.difference_update(e.block_hashes)
                else:
                    self.held.clear()

    def cached_tokens(self, tokens, **origin) -> int:
        n = 0
        for h in expected_hashes(tokens, **origin):
            if h not in self.held:
                break
            n += BS
        return n


def setup(num_blocks=12, origin=None, memo_size=1 << 16):
    cfg = SchedulerConfig(max_num_seqs=2, block_size=BS, num_blocks=num_blocks, max_model_len=32,
                          max_num_batched_tokens=16, prefill_chunk_size=8,
                          enable_prefix_caching=True, prefix_cache_granularity="block")
    kv = KVCacheManager(cfg, "tiny|float32")
    sink = Collect()
    recorder = KVEventRecorder(KVEventsConfig(enable_kv_cache_events=True), BS, sink,
                               (lambda seq: origin) if origin else None, memo_size=memo_size)
    kv.observe(recorder)
    return kv, recorder, sink


_ids = iter(range(1000))


def prefill(kv, tokens, salt=None, chunk=None) -> Sequence:
    """Admits a sequence (taking its cached prefix) and computes its prompt in chunks."""
    seq = Sequence(next(_ids), "r", 0, list(tokens), SamplingParams(cache_salt=salt), 0, 0.0, 0)
    kv.start_from_cache(seq, kv.computed_blocks(seq))
    kv.blocks.ensure_capacity(seq.seq_id, seq.num_tokens)
    step = chunk or seq.num_tokens
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(step, seq.num_tokens - seq.num_computed_tokens)
        kv.cache_computed_blocks(seq, seq.num_computed_tokens, n)
        seq.num_computed_tokens += n
    return seq


def agree(kv, router, prompts) -> None:
    """The router's view predicts each prompt's hit (one token more: a hit stops short of it)."""
    for tokens in prompts:
        assert router.cached_tokens(tokens) == kv.cached_prefix_tokens(list(tokens) + [1]), tokens


A = list(range(100, 110))            # 2 full blocks + 2 tokens
B = A[:4] + list(range(200, 210))    # shares A's first block, then 2 blocks of its own


def test_stores_are_announced_with_vllms_hashes_and_parents():
    kv, recorder, sink = setup()
    a = prefill(kv, A)
    recorder.flush()
    (event,) = sink.batches[-1].events
    assert event.block_hashes == expected_hashes(A) and event.parent_block_hash is None
    assert event.token_ids == A[:8] and event.block_size == BS
    assert (event.lora_id, event.lora_name, event.medium, event.group_idx) == (None, None, "GPU", 0)
    assert event.extra_keys == [None, None]
    b = prefill(kv, B)                 # a hit on A's first block: only B's own blocks are new
    recorder.flush()
    (event,) = sink.batches[-1].events
    assert b.num_computed_tokens == len(B) and event.block_hashes == expected_hashes(B)[1:3]
    assert event.parent_block_hash == expected_hashes(A)[0]
    router = Router()
    router.apply(sink.batches)
    agree(kv, router, [A, B])
    kv.blocks.free(a.seq_id)
    kv.blocks.free(b.seq_id)


def test_evictions_and_reset_are_announced_and_the_router_keeps_up():
    kv, recorder, sink = setup(num_blocks=9)            # 8 usable blocks
    router = Router()
    prompts = [A, B, list(range(300, 313)), list(range(400, 417)), A]
    for tokens in prompts:
        kv.blocks.free(prefill(kv, tokens).seq_id)     # its blocks stay cached, parked
        recorder.flush()
        router.apply(sink.batches[-1:])
        agree(kv, router, prompts)
    live = [prefill(kv, B)]
    removed = [h for b in sink.batches for e in b.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes]
    assert removed, "the small pool evicted nothing: the test lost its point"
    assert set(removed) <= set().union(*(expected_hashes(p) for p in prompts))
    kv.reset_prefix_cache()
    recorder.flush()
    assert isinstance(sink.batches[-1].events[-1], AllBlocksCleared)
    router.apply(sink.batches[-1:])
    assert router.held == set()
    agree(kv, router, prompts)
    # Blocks still held when the cache was reset come back uncached, and are not announced.
    kv.blocks.free(live.pop().seq_id)
    recorder.flush()
    assert isinstance(sink.batches[-1].events[-1], AllBlocksCleared)


def test_lora_and_salt_shape_the_hashes_and_the_event():
    origin = BlockOrigin(lora_id=7, lora_name="sql", lora_path="/adapters/sql", cache_salt="t1")
    kv, recorder, sink = setup(origin=origin)
    prefill(kv, A, salt="any")        # the salt that counts is the origin's (the user's)
    recorder.flush()
    (event,) = sink.batches[-1].events
    assert event.block_hashes == expected_hashes(A, lora=("sql", "/adapters/sql"), salt="t1")
    assert (event.lora_id, event.lora_name) == (7, "sql")
    assert event.extra_keys == [("sql", "t1"), ("sql",)]


@pytest.mark.parametrize("memo_size", [1, 1 << 16])
def test_a_reset_between_two_chunks_keeps_the_chain(memo_size):
    """The second chunk's blocks chain from the first chunk's, which the reset forgot (and a
    memo of one entry has lost): their hashes are recomputed from the tokens."""
    kv, recorder, sink = setup(memo_size=memo_size)
    tokens = list(range(500, 517))
    seq = Sequence(99, "r", 0, tokens, SamplingParams(), 0, 0.0, 0)
    kv.start_from_cache(seq, [])
    kv.blocks.ensure_capacity(seq.seq_id, len(tokens))
    kv.cache_computed_blocks(seq, 0, 8)
    kv.reset_prefix_cache()
    kv.cache_computed_blocks(seq, 8, 8)
    recorder.flush()
    stored = [e for e in sink.batches[-1].events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == expected_hashes(tokens)[:2] + \
        expected_hashes(tokens)[2:4]
    assert stored[-1].parent_block_hash == expected_hashes(tokens)[1]
    assert isinstance(sink.batches[-1].events[1], AllBlocksCleared)


def test_nothing_happened_nothing_is_published():
    kv, recorder, sink = setup()
    recorder.flush()
    assert sink.batches == []
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(SchedulerConfig(num_blocks=200), "x").observe(recorder)
