"""A LoRA engine's manager, sized by its runner's pool (engine/setup.py calls this)."""
from __future__ import annotations

import functools

from jaxbatch.lora.adapter import read_peft_adapter
from jaxbatch.lora.load_queue import AdapterLoadQueue
from jaxbatch.lora.manager import LoRAManager
from jaxbatch.lora.runner import LoRARunner


def make_manager(runner: LoRARunner, max_cpu_loras: int | None) -> LoRAManager:
    pool = runner.lora_pool
    read = functools.partial(read_peft_adapter, shapes=pool.shapes, num_layers=pool.num_layers,
                             max_rank=pool.max_rank)
    # The manager decides on the host; its loads and slots reach the runner in each plan.
    return LoRAManager(AdapterLoadQueue(pool.num_slots), read, max_cpu_loras)

