"""Every replica's Prometheus metrics on the ingress's one /metrics, each sample labelled with
the replica it came from.

Each engine replica pushes its own exposition (the `vllm:*` names its server renders) to a
small named actor, the board, every `PUSH_INTERVAL_S`; the ingress's /metrics reads the board
and merges the expositions family by family, adding `replica="<id>"`. A replica that stopped
pushing (dead, or scaled down) drops out after `STALE_AFTER_S`. Push rather than pull because
Ray Serve gives no way to address one particular replica through a handle.
"""
from __future__ import annotations

import time

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0
NAMESPACE = "serve"


def board_name(app_name: str) -> str:
    return f"jaxbatch-metrics-board::{app_name}"


@ray.remote(num_cpus=0)
class MetricsBoard:
    def __init__(self):
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def texts(self) -> dict[str, str]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._texts.items() if now - t > STALE_AFTER_S]:
            del self._texts[replica]
        return {r: text for r, (_, text) in sorted(self._texts.items())}


def board(app_name: str):
    """The app's board, created by whoever asks first; detached so that a replica's death
    does not take it along (the ingress kills it when the app is deleted)."""
    return MetricsBoard.options(name=board_name(app_name), namespace=NAMESPACE,
                                get_if_exists=True, lifetime="detached").remote()


class _Merged:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge(texts: dict[str, str]) -> bytes:
    """One exposition of every replica's metrics, `replica` added to each sample's labels."""
    merged = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = family
                samples, family.samples = family.samples, []
            else:
                samples = family.samples
            into.samples.extend(s._replace(labels={**s.labels, "replica": replica})
                                for s in samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
