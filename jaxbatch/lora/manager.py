"""Which adapters are resident in the device pool, and when (the scheduler's admission seam).

An adapter is made resident when a sequence using it is admitted: into a free slot, or into
the slot of the least recently used resident adapter that no running sequence uses. A waiting
sequence whose adapter cannot be made resident waits; once one has had to wait, no further
adapter sequence is admitted in that round (base-model sequences still are), so the resident
adapters drain and the oldest waiting adapter gets a slot: nobody starves. Host copies of
adapters (read once from disk) are kept while any unfinished sequence uses them, plus up to
`max_cpu_loras` others, least recently used dropped first.
"""
from __future__ import annotations

import collections
from typing import Callable

from jaxbatch.core.plan import StepPlan
from jaxbatch.core.request import Sequence
from jaxbatch.lora.adapter import LoRAWeights
from jaxbatch.lora.load_queue import AdapterLoadQueue
from jaxbatch.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, pool: AdapterLoadQueue, read: Callable[[str], LoRAWeights],
                 max_cpu_loras: int | None = None):
        """`pool`: where the loads it decides go (`num_slots`, `load(slot, weights)`): a host
        queue the plans drain (`plan_adapters`), never the device. `read(path)`: the adapter at
        `path` (raises ValueError), e.g. `adapter.read_peft_adapter` bound to the model's
        shapes."""
        self.pool = pool
        self._read = read
        self.max_loras = pool.num_slots - 1
        self.max_cpu_loras = max(max_cpu_loras or self.max_loras, self.max_loras)
        self.known: dict[int, LoRARequest] = {}
        self.host: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        self._read_from: dict[int, str] = {}                  # host copy -> the path it came from
        self.slot_of: dict[int, int] = {}                    # resident adapter -> its slot
        self.recent: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.free_slots = list(range(1, pool.num_slots))
        self.users: collections.Counter[int] = collections.Counter()   # running sequences
        self.live: collections.Counter[int] = collections.Counter()    # unfinished sequences
        self.seq_slot: dict[int, int] = {}                    # running seq_id -> slot
        self._blocked = False
        self.num_loads = 0
        self.num_evictions = 0
        self.requests_by_name: collections.Counter[str] = collections.Counter()

    # ---- requests (the engine's) ---------------------------------------------------------
    def check(self, request: LoRARequest) -> LoRAWeights:
        """Raises ValueError for a bad or conflicting request. What it read is kept in the host
        cache (only a cache: a batch validated, then added, reads each adapter once)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, not {type(request).__name__}")
        request.check()
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter "
                             f"{known.lora_name!r} at {known.lora_path!r}")
        for other in self.known.values():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"lora_name {request.lora_name!r} already has lora_int_id "
                                 f"{other.lora_int_id}")
        weights = self.host.get(request.lora_int_id)
        if weights is None or self._read_from.get(request.lora_int_id) != request.lora_path:
            weights = self._read(request.lora_path)
            self.host[request.lora_int_id] = weights
            self._read_from[request.lora_int_id] = request.lora_path
        self.host.move_to_end(request.lora_int_id)
        self._trim_host(keep=request.lora_int_id)
        return weights

    def add(self, seq: Sequence, request: LoRARequest, weights: LoRAWeights) -> None:
        seq.lora_int_id = request.lora_int_id
        self.known[request.lora_int_id] = request
        self.host[request.lora_int_id] = weights
        self.host.move_to_end(request.lora_int_id)
        self.live[request.lora_int_id] += 1
        self.requests_by_name[request.lora_name] += 1
        self._trim_host()

    def remove(self, lora_name: str) -> bool:
        """Forgets an adapter no unfinished request uses (the server's unload); False if unknown."""
        ids = [i for i, r in self.known.items() if r.lora_name == lora_name]
        if not ids:
            return False
        lid = ids[0]
        if self.live[lid]:
            raise ValueError(f"LoRA adapter {lora_name!r} is in use by {self.live[lid]} request(s)")
        del self.known[lid]
        self.host.pop(lid, None)
        self._read_from.pop(lid, None)
        if lid in self.slot_of:
            self._evict(lid)
        return True

    # ---- the scheduler's admission seam --------------------------------------------------
    def begin_admission(self) -> None:
        self._blocked = False

    def can_admit(self, seq: Sequence) -> bool:
        lid = seq.lora_int_id
        if not lid:
            return True
        if self._blocked:
            return False
        if lid in self.slot_of or self.free_slots or self._evictable() is not None:
            return True
        self._blocked = True
        return False

    def admitted(self, seq: Sequence) -> None:
        lid = seq.lora_int_id
        if not lid:
            return
        if lid not in self.slot_of:
            if not self.free_slots:
                self._evict(self._evictable())
            slot = self.free_slots.pop(0)
            weights = self.host.get(lid)
            if weights is None:      # dropped from the host cache: never while live, but safe
                weights = self.host[lid] = self._read(self.known[lid].lora_path)
            self.pool.load(slot, weights)
            self.slot_of[lid] = slot
            self.num_loads += 1
        self.recent[lid] = None
        self.recent.move_to_end(lid)
        self.users[lid] += 1
        self.seq_slot[seq.seq_id] = self.slot_of[lid]

    def released(self, seq: Sequence) -> None:
        """Preempted or finished: it no longer holds its adapter resident."""
        if self.seq_slot.pop(seq.seq_id, None) is not None:
            self.users[seq.lora_int_id] -= 1

    def finished(self, seq: Sequence) -> None:
        lid = seq.lora_int_id
        if lid:
            self.live[lid] -= 1
            if self.live[lid] <= 0:
                del self.live[lid]
            self._trim_host()

    # ---- the plan -------------------------------------------------------------------------
    def plan_adapters(self, plan: StepPlan) -> None:
        """What a dispatched plan carries to the runner: the loads decided since the last plan
        (applied before its model calls), and the slot of each of its sequences that uses an
        adapter. Called for non-empty plans only: loads decided meanwhile wait for the next."""
        plan.adapter_loads = self.pool.take()
        ids = [d.seq_id for d in plan.decodes] + [c.seq_id for c in plan.prefills]
        plan.adapter_slots = {i: self.seq_slot[i] for i in ids if i in self.seq_slot}

    # ---- slots ---------------------------------------------------------------------------
    def _evictable(self) -> int | None:
        return next((lid for lid in self.recent if self.users[lid] <= 0), None)

    def _evict(self, lid: int) -> None:
        # The slot's old contents stay until the next load overwrites them: no row points there.
        self.free_slots.append(self.slot_of.pop(lid))
        self.free_slots.sort()
        self.recent.pop(lid, None)
        self.users.pop(lid, None)
        self.num_evictions += 1

    def _trim_host(self, keep: int | None = None) -> None:
        spare = [lid for lid in self.host
                 if not self.live[lid] and lid not in self.slot_of and lid != keep]
        for lid in spare[:max(0, len(spare) - self.max_cpu_loras)]:
            del self.host[lid]
            self._read_from.pop(lid, None)

    def stats(self) -> dict:
        """`lora_running` / `lora_waiting`: adapter name -> its sequences holding a slot / not
        (yet, or preempted) holding one; what vLLM's `vllm:lora_requests_info` reports."""
        waiting = {self.known[l].lora_name: n - self.users[l] for l, n in self.live.items()
                   if n > self.users[l] and l in self.known}
        return {"lora_num_resident": len(self.slot_of), "lora_num_loads": self.num_loads,
                "lora_num_evictions": self.num_evictions, "lora_max_loras": self.max_loras,
                "lora_running": {self.known[l].lora_name: n for l, n in self.users.items()
                                 if n > 0 and l in self.known},
                "lora_waiting": waiting,
                "lora_requests": dict(self.requests_by_name)}
