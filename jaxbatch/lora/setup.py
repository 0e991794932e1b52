"""Wiring a LoRA engine's manager to its runner (engine/setup.py calls this)."""
from __future__ import annotations

import functools

from jaxbatch.lora.adapter import read_peft_adapter
from jaxbatch.lora.manager import LoRAManager
from jaxbatch.lora.runner import LoRARunner


def make_manager(runner: LoRARunner, max_cpu_loras: int | None) -> LoRAManager:
    pool = runner.lora_pool
    read = functools.partial(read_peft_adapter, shapes=pool.shapes, num_layers=pool.num_layers,
                             max_rank=pool.max_rank)
    manager = LoRAManager(pool, read, max_cpu_loras)
    runner.seq_slot = manager.seq_slot          # one dict: the runner reads what admission set
    return manager

