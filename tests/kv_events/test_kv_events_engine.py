"""KV events from a running engine (a tiny random model), read by a plain ZMQ subscriber:
every batch decodes with vLLM's schema, sequence numbers run without a gap, each stored
block's hash is sha256 over canonical CBOR of (parent, its token ids, None) recomputed from
the event's own token ids, and a router that applies the events predicts the engine's prefix
hits after every request, through evictions (a small pool) and a reset. The replay socket
returns every batch a late subscriber missed.

Where vLLM 0.32 is installed beside the test environment (the checkout's .venv-vllm, which
scripts/setup_vllm_cpu.sh makes, or $JAXBATCH_VLLM_PYTHON: a python whose `import vllm`
works), the same payloads are decoded with vLLM's own classes and the hashes recomputed with
vLLM's own hash_block_tokens, in that interpreter; elsewhere (CI) that test is skipped and
says so."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import subprocess

import cbor2
import numpy as np
import pytest

from benchmarks.serve_launch import DEFAULT_VLLM_PYTHON     # the checkout's .venv-vllm
from jaxbatch import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.engine import setup
from jaxbatch.engine.config import EngineConfig
from jaxbatch.kv_events.config import NO_KV_EVENTS
from engines import tiny_engine
from kv_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, free_port, replay
from tiny_models import make_hf_model, random_token_prompts

BS = 4
SEED = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
ROOT = hashlib.sha256(cbor2.dumps(SEED, canonical=True)).digest()
VLLM_PYTHON = os.environ.get("JAXBATCH_VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON))


def digest(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), None), canonical=True)).digest()


def prompt_hashes(tokens) -> list[bytes]:
    out, parent = [], ROOT
    for i in range(len(tokens) // BS):
        parent = digest(parent, tokens[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


@pytest.fixture(scope="module")
def run():
    """One engine run: prompts sharing prefixes, one at a time and two at once, in a pool that
    must evict; after each request, the engine's hits for every prompt; then a reset."""
    port, replay_port = free_port(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", b"kv@")
    engine = tiny_engine(
        make_hf_model("llama_untied_gqa2", seed=21), max_num_seqs=2, block_size=BS,
        prefill_chunk_size=16, max_num_batched_tokens=32, max_model_len=64, num_blocks=24,
        prefix_cache_granularity="block",
        kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                          "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@pod@tiny",
                          "block_hash_format": "bytes"})
    rng = np.random.default_rng(3)
    base, other, third = random_token_prompts(rng, [40, 40, 40])
    prompts = [base[:37], base[:21] + other[:11], other[:30], third[:39], base[:37],
               third[:14] + base[:20]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    hits_after, marks = [], []      # after each request: the engine's hits, batches so far
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
            if i == 3:                       # two at once: stores interleave in one step
                engine.add_request("3b", other[:33], params)
            while engine.has_unfinished_requests():
                engine.step()
            hits_after.append([engine.cached_prefix_tokens(p + [7], params) for p in prompts])
            marks.append(engine.kv_events.num_batches)
        engine.reset_prefix_cache()
        hits_after.append([engine.cached_prefix_tokens(p + [7], params) for p in prompts])
        marks.append(engine.kv_events.num_batches)
        count = engine.kv_events.num_batches
        missed = replay(f"tcp://127.0.0.1:{replay_port}", 0)
    finally:
        engine.shutdown()
    frames = sub.wait_for(count)
    sub.close()
    return prompts, (hits_after, marks), frames, missed, sub


def test_batches_decode_with_vllms_schema_in_order(run):
    prompts, _, frames, missed, sub = run
    assert [s for _, s, _ in frames] == list(range(len(frames))) and len(frames) == len(missed)
    assert {t for t, _, _ in frames} == {b"kv@pod@tiny"}
    batches = sub.batches()
    assert all(b.data_parallel_rank == 0 for b in batches)
    kinds = {type(e) for b in batches for e in b.events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}, kinds
    # The replay socket kept every batch: a subscriber joining after the run gets them all.
    assert missed == frames


def test_stored_hashes_are_vllms_chain_over_the_event_tokens(run):
    _, _, _, _, sub = run
    stored = [e for b in sub.batches() for e in b.events if isinstance(e, BlockStored)]
    for e in stored:
        assert e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
        assert (e.medium, e.lora_name, e.group_idx) == ("GPU", None, 0)
        parent = e.parent_block_hash or ROOT
        for i, h in enumerate(e.block_hashes):
            parent = digest(parent, e.token_ids[i * BS:(i + 1) * BS])
            assert h == parent


def test_a_router_applying_the_events_predicts_every_hit(run):
    prompts, (hits_after, marks), _, _, sub = run
    held: set[bytes] = set()
    views = [set()]                  # views[k]: what the router holds after k batches
    for batch in sub.batches():
        for e in batch.events:
            if isinstance(e, BlockStored):
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= held
                held.difference_update(e.block_hashes)
            else:
                held.clear()
        views.append(set(held))
    removed = sum(len(e.block_hashes) for b in sub.batches() for e in b.events
                  if isinstance(e, BlockRemoved))
    assert removed > 0, "nothing was evicted: the pool is too large for the test's point"

    def router_hits(view, tokens):
        n = 0
        for h in prompt_hashes(tokens + [7]):
            if h not in view:
                break
            n += BS
        return n

    # After each request (and after the reset), the router's view is the engine's cache.
    assert len(views) == marks[-1] + 1
    for mark, hits in zip(marks, hits_after):
        assert [router_hits(views[mark], p) for p in prompts] == hits
    assert hits_after[-1] == [0] * len(prompts) and any(any(h) for h in hits_after)


@pytest.mark.skipif(not pathlib.Path(VLLM_PYTHON).exists(),
                    reason=f"vLLM is not installed at {VLLM_PYTHON} (set JAXBATCH_VLLM_PYTHON)")
def test_vllms_own_classes_decode_the_events_and_agree_on_the_hashes(run, tmp_path):
    _, _, frames, _, _ = run
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps([p.hex() for _, _, p in frames]))
    script = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
kv_cache_utils.init_none_hash(sha256_cbor)
decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for text in json.load(open(sys.argv[1])):
    for e in decoder.decode(bytes.fromhex(text)).events:
        if isinstance(e, BlockStored):
            parent, ok = e.parent_block_hash, True
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens, None)
                ok = ok and parent == h
            out.append(["BlockStored", ok])
        else:
            out.append([type(e).__name__, True])
print("RESULT=" + json.dumps(out))
"""
    done = subprocess.run([VLLM_PYTHON, "-c", script, str(payloads)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT=")[-1])
    ours = [[type(e).__name__, True] for _, _, p in frames
            for e in __import__("kv_subscriber").DECODER.decode(p).events]
    assert result == ours


def test_chunk_granularity_with_events_warns_and_events_off_cost_nothing(caplog):
    config = EngineConfig.from_kwargs(kv_events_config={
        "enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"})
    sched_config = setup.SchedulerConfig(num_blocks=64, max_num_seqs=2, max_model_len=64,
                                         max_num_batched_tokens=32, prefill_chunk_size=16,
                                         enable_prefix_caching=True)
    with caplog.at_level(logging.WARNING):
        recorder = setup.kv_events(config, sched_config, Scheduler(sched_config, (2,)), None)
    recorder.close()
    assert "prefix_cache_granularity='block'" in caplog.text
    off = setup.kv_events(EngineConfig.from_kwargs(), sched_config, Scheduler(sched_config, (2,)),
                          None)
    assert off is NO_KV_EVENTS


def test_a_lora_sequence_is_hashed_with_its_adapter_and_its_users_salt():
    from types import SimpleNamespace

    from jaxbatch.core.request import Sequence
    from jaxbatch.kv_events.recorder import BlockOrigin
    from jaxbatch.lora.request import LoRARequest, lora_cache_salt
    adapter = LoRARequest("sql", 7, "/adapters/sql")
    lora = SimpleNamespace(known={7: adapter})
    for user_salt in ("t1", None):
        seq = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(
            cache_salt=lora_cache_salt(user_salt, adapter)), 0, 0.0, 0)
        seq.lora_int_id = 7
        assert setup.block_origin(seq, lora) == BlockOrigin(7, "sql", "/adapters/sql", user_salt)
    plain = Sequence(1, "r", 0, [1, 2, 3], SamplingParams(cache_salt="t2"), 0, 0.0, 0)
    assert setup.block_origin(plain, None) == BlockOrigin(cache_salt="t2")
