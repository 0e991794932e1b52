"""Data-parallel replicas: N independent engines (own scheduler, KV pool, compiled steps, each on
its own devices when there are enough) behind LLMEngine's interface, for models that fit one
device and traffic that does not.

Routing: the prefix-affinity rule of core/replica_choice.py, the one the Ray Serve router
follows too. Load is outstanding work counted in tokens still to compute (prompt tokens not yet
prefilled + tokens still to generate, at most max_tokens per completion), not in requests: one
long prompt weighs as much as many short ones. A replica whose prefix cache holds part of the
prompt is preferred while its extra load is at most the tokens that cache saves (the prefill it
will not do there); otherwise the least loaded wins. Ties go to the lowest index, so routing is
deterministic.

Stepping: one `step()` steps every replica that has work, each in its own thread: the Python
of a step holds the GIL, but the device work and the wait for its results release it, so the
replicas' device work overlaps (on a GPU per replica, fully).

A request's tokens depend only on itself (fixed step shapes, per-request seeds), so a replica
gives the same tokens as a single engine would, as long as the request has a seed or is
greedy: an unseeded request draws its seed from its replica's generator.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses

from jaxbatch.core.replica_choice import choose_replica
from jaxbatch.engine.interface import EngineBase


@dataclasses.dataclass
class _Routed:
    replica: int
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0
    started: bool = False

    @property
    def remaining(self) -> int:
        return (0 if self.started else self.prompt_tokens) + self.max_new_tokens - self.generated


class DataParallelEngine(EngineBase):
    def __init__(self, replicas: list):
        if not replicas:
            raise ValueError("data_parallel_size must be at least 1")
        self.replicas = replicas
        self._routed: dict[str, _Routed] = {}
        self._threads = concurrent.futures.ThreadPoolExecutor(len(replicas),
                                                              thread_name_prefix="dp-replica")
        # Every replica's agree.
        first = replicas[0]
        self.tokenizer, self.model_config, self.config = (first.tokenizer, first.model_config,
                                                          first.config)
        self.eos_token_ids = first.eos_token_ids

    # ---- requests --------------------------------------------------------------------------
    def outstanding_work(self) -> list[int]:
        """Tokens each replica still has to compute for the requests routed to it."""
        work = [0] * len(self.replicas)
        for routed in self._routed.values():
            work[routed.replica] += routed.remaining
        return work

    def validate_request(self, request_id, prompt, params=None, priority: int = 0,
                         lora_request=None):
        if str(request_id) in self._routed:
            raise ValueError(f"request_id {str(request_id)!r} is already in use")
        return self.replicas[0].validate_request(request_id, prompt, params, priority,
                                                 lora_request)

    def add_request(self, request_id, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None, lora_request=None) -> None:
        # (Replicas refuse a LoRARequest: EngineConfig refuses enable_lora with replicas.)
        _, ids, params = self.validate_request(request_id, prompt, params, priority,
                                               lora_request)
        cached = [r.cached_prefix_tokens(ids, params) for r in self.replicas]
        target = choose_replica(self.outstanding_work(), cached, max_imbalance=max(cached))
        self.replicas[target].add_request(request_id, prompt, params, priority, arrival_time)
        self._routed[str(request_id)] = _Routed(target, len(ids) - cached[target],
                                                params.n * params.max_tokens)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            routed = self._routed.get(str(rid))
            if routed is not None:
                self.replicas[routed.replica].abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def has_pending_outputs(self) -> bool:
        return any(r.has_pending_outputs() for r in self.replicas)

    def cached_prefix_tokens(self, prompt_token_ids, params) -> int:
        return max(r.cached_prefix_tokens(prompt_token_ids, params) for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    # ---- the step --------------------------------------------------------------------------
    def step(self):
        # Aborted requests' final outputs wait in a replica's step() too, so step every replica
        # with anything pending, not only those with unfinished requests.
        busy = [r for r in self.replicas
                if r.has_unfinished_requests() or r.has_pending_outputs()]
        if len(busy) == 1:
            per_replica = [busy[0].step()]
        else:
            per_replica = list(self._threads.map(lambda r: r.step(), busy))
        outputs = [out for outs in per_replica for out in outs]
        for out in outputs:
            routed = self._routed.get(out.request_id)
            if routed is None:
                continue
            if out.finished:
                del self._routed[out.request_id]
            else:
                routed.started = True
                routed.generated = sum(len(c.token_ids) for c in out.outputs)
        return outputs

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def prepare_for_serving(self) -> None:
        for r in self.replicas:
            r.prepare_for_serving()

    def warmup(self) -> float:
        return sum(r.warmup() for r in self.replicas)

    def stats(self) -> dict:
        """Counts summed over the replicas; settings as replica 0's."""
        per = [r.stats() for r in self.replicas]
        total = dict(per[0])
        for key in ("num_running", "num_waiting", "num_running_requests",   # requests: server
                    "num_waiting_requests", "num_free_blocks", "num_total_blocks",
                    "num_preemptions", "num_compilations", "num_compilations_after_warmup",
                    "num_steps", "compile_seconds", "max_num_seqs", "prefix_cache_queries",
                    "prefix_cache_hits", "spec_num_drafts", "spec_num_draft_tokens",
                    "spec_num_accepted_tokens"):
            total[key] = sum(s[key] for s in per)
        total["data_parallel_size"] = len(self.replicas)
        total["outstanding_work"] = self.outstanding_work()
        return total
