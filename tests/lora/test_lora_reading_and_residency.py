"""Reading PEFT directories (every refusal a ValueError; the scale folded into B) and the
residency rules of the adapter slots, on the host scheduler alone (a fake pool)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file

from adapters import write_adapter
from jaxbatch import LoRARequest, SamplingParams
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.request import Sequence
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.lora.adapter import read_peft_adapter
from jaxbatch.lora.manager import LoRAManager
from jaxbatch.lora.pool import target_shapes
from jaxbatch.model.decoder import stack_layers
from tiny_models import make_hf_model, ours_from_hf


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    model = make_hf_model("llama_untied_gqa2", seed=1)
    write_adapter(model, str(root / "rs"), 4, ["q_proj", "down_proj"], seed=2, alpha=6,
                  use_rslora=True)
    cfg, params = ours_from_hf(model)
    return str(root / "rs"), target_shapes(stack_layers(params)), cfg.num_layers


def _copy_with_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    path = f"{dst}/adapter_config.json"
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)


def test_scale_is_folded_into_b_and_untargeted_matrices_are_absent(adapter):
    path, shapes, layers = adapter
    weights = read_peft_adapter(path, shapes, layers, max_rank=8)
    assert sorted(weights.matrices) == ["w_down", "wq"] and weights.rank == 4
    raw = load_file(f"{path}/adapter_model.safetensors")
    key = next(k for k in raw if "layers.1.self_attn.q_proj.lora_B" in k)
    a, b = weights.matrices["wq"]
    np.testing.assert_allclose(b[1], raw[key].T * 6 / math.sqrt(4), rtol=1e-6)   # rsLoRA
    assert a.shape == (layers, 4, shapes["wq"][0]) and b.shape == (layers, 4, shapes["wq"][1])


def test_each_bad_adapter_is_a_value_error(adapter, tmp_path):
    path, shapes, layers = adapter
    with pytest.raises(ValueError, match="no such directory"):
        read_peft_adapter(str(tmp_path / "nowhere"), shapes, layers, 8)
    with pytest.raises(ValueError, match="exceeds max_lora_rank"):
        read_peft_adapter(path, shapes, layers, 2)
    with pytest.raises(ValueError, match="not one this model supports"):
        read_peft_adapter(_copy_with_config(path, tmp_path / "t", target_modules=["fc9"]),
                          shapes, layers, 8)
    with pytest.raises(ValueError, match="use_dora"):
        read_peft_adapter(_copy_with_config(path, tmp_path / "d", use_dora=True), shapes, layers, 8)
    wrong = {**shapes, "wq": (shapes["wq"][0] * 2, shapes["wq"][1])}
    with pytest.raises(ValueError, match="this model needs"):
        read_peft_adapter(path, wrong, layers, 8)


class FakePool:
    """What the manager needs of the device pool; records the loads."""
    def __init__(self, max_loras):
        self.num_slots = max_loras + 1
        self.loads = []

    def load(self, slot, weights):
        self.loads.append((slot, weights))


def test_a_waiting_adapter_is_not_starved_by_a_resident_one():
    """One slot: adapter 1 runs; adapter 2's request waits; later adapter-1 requests must not
    keep slot 1 busy forever: they wait behind it, and base-model requests still start."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, num_blocks=64, max_model_len=64,
                                      max_num_batched_tokens=64, prefill_chunk_size=32))
    pool = FakePool(max_loras=1)
    manager = LoRAManager(pool, read=lambda path: path)
    sched.admission = manager
    ids = iter(range(100))

    def add(lid):
        seq = Sequence(next(ids), "r", 0, [5, 6, 7], SamplingParams(max_tokens=4), 0, 0.0, 0)
        if lid:
            manager.add(seq, LoRARequest(f"n{lid}", lid, f"w{lid}"), f"w{lid}")
        sched.add(seq)
        return seq

    first = add(1)
    sched.schedule()
    waiting_2, later_1, base = add(2), add(1), add(0)
    sched.schedule()
    assert base in sched.running and first in sched.running
    assert waiting_2 in sched.waiting and later_1 in sched.waiting      # not overtaking
    stats = manager.stats()       # what /metrics' vllm:lora_requests_info reports
    assert stats["lora_running"] == {"n1": 1} and stats["lora_waiting"] == {"n1": 1, "n2": 1}
    assert stats["lora_max_loras"] == 1
    from jaxbatch.core.request import SequenceStatus
    sched.finish(first, SequenceStatus.FINISHED_STOPPED)
    sched.schedule()
    assert waiting_2 in sched.running and later_1 in sched.waiting
    assert [w for _, w in pool.loads] == ["w1", "w2"] and manager.num_evictions == 1
    assert manager.seq_slot == {waiting_2.seq_id: 1}


def test_an_adapter_is_read_once_and_the_host_cache_keeps_max_cpu_loras_spare_copies():
    reads = []
    manager = LoRAManager(FakePool(max_loras=1), read=lambda path: reads.append(path) or path,
                          max_cpu_loras=1)
    requests = [LoRARequest(f"n{i}", i, f"w{i}") for i in (1, 2, 3)]
    seqs = []
    for i in range(3):               # a batch validated, then added: one read
        manager.check(requests[0])
    for i in range(3):
        seq = Sequence(i, "r", 0, [5], SamplingParams(), 0, 0.0, 0)
        manager.add(seq, requests[0], manager.check(requests[0]))
        seqs.append(seq)
    assert reads == ["w1"]
    for lr in requests[1:]:
        manager.check(lr)
    assert reads == ["w1", "w2", "w3"] and len(manager.host) == 3      # w1 is live: kept
    for seq in seqs:
        manager.finished(seq)
    assert list(manager.host) == [3]                  # one spare copy: the most recent
