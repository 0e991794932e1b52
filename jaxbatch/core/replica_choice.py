"""Which replica takes a request: the prefix-affinity rule, shared by the in-process
`DataParallelEngine` (engine/data_parallel.py) and the Ray Serve request router
(entrypoints/ray_cluster/router.py).

A replica that already holds the prompt's prefix in its cache skips that much prefill, so it is
preferred, but only while its load stays within `max_imbalance` of the least-loaded replica:
affinity must never pile a hot prefix's traffic onto one replica while others idle. Among the
replicas within the bound, the longest match wins, then the lower load, then the lower index
(deterministic). With no match anywhere this is plain least-loaded.

Units are the caller's: the in-process engine counts load and matches in tokens (outstanding
work, cached prompt tokens); the Ray router counts load in ongoing requests and matches in
prompt characters. Only their order matters here.
"""
from __future__ import annotations

from collections.abc import Sequence


def choose_replica(loads: Sequence[float], matched: Sequence[float],
                   max_imbalance: float) -> int:
    """Index of the replica to route to. `loads[i]`: replica i's current load; `matched[i]`:
    how much of the prompt's prefix replica i holds; both non-negative."""
    if not loads or len(loads) != len(matched):
        raise ValueError(f"need one load and one match per replica, got {len(loads)} loads "
                         f"and {len(matched)} matches")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    least = min(loads)
    within = [i for i, load in enumerate(loads) if load - least <= max_imbalance]
    return min(within, key=lambda i: (-matched[i], loads[i], i))


def rank_replicas(loads: Sequence[float], matched: Sequence[float],
                  max_imbalance: float) -> list[int]:
    """Every replica, best first: the rule's choice, then the rest by load (then index), the
    order to fall back in when the chosen one turns out to be full."""
    first = choose_replica(loads, matched, max_imbalance)
    rest = sorted((i for i in range(len(loads)) if i != first), key=lambda i: (loads[i], i))
    return [first, *rest]
