"""Adapter loads travel in the plan (issue 54): admitting a LoRA request decides a slot on the
host and touches no device (the scheduler and manager import no JAX); the plan carries "load
adapter into slot s" and each sequence's slot; the runner writes the adapter before the
step's model calls, never while the scheduler plans."""
from __future__ import annotations

import subprocess
import sys

from adapters import write_adapter
from jaxbatch import LoRARequest, SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from tiny_models import make_hf_model, ours_from_hf

PROBE = """
import sys
from jaxbatch import SamplingParams, LoRARequest
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.plan import AdapterLoad
from jaxbatch.core.request import Sequence
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.lora.load_queue import AdapterLoadQueue
from jaxbatch.lora.manager import LoRAManager
sched = Scheduler(SchedulerConfig(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16,
                                  max_model_len=64, prefill_chunk_size=8))
manager = LoRAManager(AdapterLoadQueue(2), read=lambda path: "weights of " + path)
sched.admission = manager
seq = Sequence(0, "r", 0, [5, 6, 7], SamplingParams(max_tokens=2), 0, 0.0, 0)
manager.add(seq, LoRARequest("a", 1, "w1"), "weights of w1")
base = Sequence(1, "r", 0, [5, 6, 7], SamplingParams(max_tokens=2), 0, 0.0, 0)
sched.add(seq)
sched.add(base)
plan = sched.schedule()
manager.plan_adapters(plan)
assert [(l.slot, l.weights) for l in plan.adapter_loads] == [(1, "weights of w1")], plan.adapter_loads
assert plan.adapter_slots == {0: 1}, plan.adapter_slots
later = sched.schedule()
manager.plan_adapters(later)
assert later.adapter_loads == [] and later.adapter_slots == {0: 1}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
print("HEAVY=" + ",".join(heavy))
"""


def test_admitting_an_adapter_request_plans_a_load_and_imports_no_jax():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    heavy = out.stdout.strip().split("HEAVY=")[-1]
    assert heavy == "", heavy[:300]


def test_the_runner_writes_the_adapter_before_the_model_calls_not_while_planning(tmp_path):
    model = make_hf_model("llama_untied_gqa2", seed=1)
    write_adapter(model, str(tmp_path / "a"), 4, ["q_proj", "v_proj"], seed=3)
    cfg, params = ours_from_hf(model)
    loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny", load_seconds=0.0,
                         from_cache=False)
    engine = LLMEngine(loaded=loaded, max_model_len=64, max_num_seqs=2, compilation_cache=False,
                       prefill_chunk_size=16, enable_lora=True, max_loras=1, max_lora_rank=4,
                       warmup=False)
    runner, pool = engine.runner, engine.runner.lora_pool
    stack, writes = [], []

    def traced(obj, name):
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            stack.append(name)
            try:
                return real(*args, **kwargs)
            finally:
                stack.pop()
        setattr(obj, name, wrapper)
    traced(runner, "dispatch_model_calls")
    traced(engine.scheduler, "schedule")
    real_load = pool.load
    pool.load = lambda slot, weights: writes.append((slot, list(stack))) or real_load(slot, weights)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3),
                       lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    while engine.has_unfinished_requests():
        engine.step()
    assert writes == [(1, ["dispatch_model_calls"])], writes
    assert not hasattr(runner, "seq_slot")      # no dict shared with the manager
