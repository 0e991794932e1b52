"""`jaxbatch ray-serve`'s own flags (the rest are `jaxbatch serve`'s, given to every replica).
No Ray import here: the parser is built for every `jaxbatch` command."""
from __future__ import annotations

import argparse
import json

# prefix_affinity, round_robin: router.py; power_of_two_choices: Ray Serve's own default router;
# the last two know nothing of prefixes (benchmarks/ray_replicas.py compares the three).
REQUEST_ROUTERS = ("prefix_affinity", "round_robin", "power_of_two_choices")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _at_least(low, kind=int):
    def parse(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def add_ray_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join (default: RAY_ADDRESS, else a new local one)")
    p.add_argument("--host", default="127.0.0.1", help="Ray Serve's HTTP proxy address")
    p.add_argument("--port", type=_at_least(0), default=8000, help="Ray Serve's HTTP port")
    p.add_argument("--app-name", default="jaxbatch")
    p.add_argument("--route-prefix", default="/")
    p.add_argument("--num-replicas", type=_at_least(1), default=None,
                   help="a fixed number of engine replicas (1 if neither this nor "
                        "--autoscaling-config is given)")
    p.add_argument("--autoscaling-config", type=_json_object, default=None,
                   help='Ray Serve\'s autoscaling_config as JSON, e.g. {"min_replicas": 1, '
                        '"max_replicas": 4, "target_ongoing_requests": 8}')
    p.add_argument("--replica-num-cpus", type=_at_least(0.0, float), default=1.0,
                   help="CPUs Ray reserves for each engine replica")
    p.add_argument("--replica-num-gpus", type=_at_least(0.0, float), default=0.0,
                   help="GPUs Ray reserves for each engine replica (its engine's devices)")
    p.add_argument("--max-ongoing-requests", type=_at_least(1), default=64,
                   help="requests Ray sends one replica at a time (past it, the next replica)")
    p.add_argument("--prefix-affinity-max-imbalance", type=_at_least(0), default=4,
                   help="ongoing requests a replica holding the prompt's prefix may have above "
                        "the least-loaded replica and still be preferred")
    p.add_argument("--request-router", choices=REQUEST_ROUTERS,
                   default="prefix_affinity",
                   help="how the ingress picks a replica: prefix_affinity (the one already sent "
                        "the prompt's prefix, within --prefix-affinity-max-imbalance), "
                        "round_robin, or Ray Serve's default power_of_two_choices (least "
                        "loaded of two at random)")
    p.add_argument("--graceful-shutdown-timeout", type=_at_least(0.0, float), default=30.0,
                   help="on scale-down, seconds a replica's ongoing requests may take to finish")
