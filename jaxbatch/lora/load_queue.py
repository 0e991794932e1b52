"""The LoRA manager's side of the device pool: how many slots there are, and the loads it
decided at admission, waiting for the next plan to carry them to the runner (which makes the
device write, `LoRARunner.apply_adapter_loads`). Host only, no JAX: the scheduler admitting a
request never touches the device."""
from __future__ import annotations

from jaxbatch.core.plan import AdapterLoad


class AdapterLoadQueue:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._loads: list[AdapterLoad] = []

    def load(self, slot: int, weights) -> None:
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.num_slots - 1}")
        self._loads.append(AdapterLoad(slot, weights))

    def take(self) -> list[AdapterLoad]:
        """The loads decided since the last take, in order (a slot loaded twice: the last wins)."""
        loads, self._loads = self._loads, []
        return loads
