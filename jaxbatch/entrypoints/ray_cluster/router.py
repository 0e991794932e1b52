"""The Ray Serve request routers of the engine deployment: the prefix-affinity rule of
core/replica_choice.py (the one DataParallelEngine follows) over Ray's view of the replicas,
and round robin, the baseline the benchmarks compare it with.

Load is each replica's ongoing requests as Ray Serve counts them (its queue-length cache, probed
when missing). The prefix a replica holds is what this router sent it before (prefix_index.py),
matched on the request's `routing_key` (model or adapter name, cache salt and prompt text, so
requests that cannot share KV never look alike). The ranking Ray gets back is the rule's choice
first, then the rest by load: Ray falls back down the list when a replica is at its
max_ongoing_requests.

Each handle (each ingress replica) routes with its own index; with one ingress, as `deploy`
builds it, that is every request.
"""
from __future__ import annotations


from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from jaxbatch.core.replica_choice import rank_replicas
from jaxbatch.entrypoints.ray_cluster.prefix_index import PrefixIndex


def routing_key_of(request: PendingRequest | None) -> str:
    if request is None:
        return ""
    for arg in request.args:
        key = getattr(arg, "routing_key", None)
        if isinstance(key, str):
            return key
    return ""


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, max_imbalance: int = 4, chunk_chars: int = 64,
                         max_chunks_per_replica: int = 100_000):
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex(chunk_chars, max_chunks_per_replica)

    async def _loads(self, replicas: list[RunningReplica]) -> list[float]:
        cache = self.replica_queue_len_cache
        known = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if known[r.replica_id] is None]
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                known[r.replica_id] = queue_len
        # A replica that did not answer the probe goes last: treat it as fully loaded.
        return [float(known[r.replica_id] if known[r.replica_id] is not None
                      else r.max_ongoing_requests) for r in replicas]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = routing_key_of(pending_request)
        loads = await self._loads(candidate_replicas)
        matched = [self.index.matched(r.replica_id.unique_id, key) for r in candidate_replicas]
        order = rank_replicas(loads, matched, self.max_imbalance)
        return [[candidate_replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        key = routing_key_of(pending_request)
        if key:
            self.index.record(replica_id.unique_id, key)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in set(self.index.replicas()) - live:
            self.index.forget(gone)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (replicas in the order of their ids), whatever
    it holds or carries; Ray falls back down the list at a replica that is full."""

    def initialize_state(self):
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        first = self.turn % len(ordered)
        self.turn += 1
        return [[r] for r in ordered[first:] + ordered[:first]]
