"""`jaxbatch ray-serve` and its Python twins: the OpenAI-compatible server of `jaxbatch serve`
as N engine replicas on a Ray cluster, behind Ray Serve's HTTP proxy.

    HTTP proxy ─► Ingress (1 replica, no engine) ─► handle + PrefixAffinityRouter
                                                        ─► EngineReplica × N (one engine each)

`build_application` gives the Ray Serve application (for `serve.run` or a Serve config);
`deploy` starts Serve on the connected cluster and runs it; `main` is the command.
"""
from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from jaxbatch.engine.config import EngineConfig, engine_kwargs_from_args
from jaxbatch.entrypoints.ray_cluster.flags import REQUEST_ROUTERS

ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT = "JaxbatchEngine", "JaxbatchIngress"


def server_args_of(server_argv: Sequence[str] | argparse.Namespace | None) -> argparse.Namespace:
    """Every replica's `jaxbatch serve` flags, checked here (a ValueError before any replica
    starts, not a replica failing to start)."""
    from jaxbatch.entrypoints.server_app import server_parser
    args = (server_argv if isinstance(server_argv, argparse.Namespace)
            else server_parser().parse_args(list(server_argv or [])))
    EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
    if args.num_processes > 1:
        raise ValueError("a ray-serve replica runs a single-process engine; a multi-host "
                         "engine is started with jaxbatch.entrypoints.ray_cluster.multihost")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args


def scale_options(num_replicas: int | None, autoscaling_config: dict | None) -> dict:
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    return ({"autoscaling_config": autoscaling_config} if autoscaling_config is not None
            else {"num_replicas": num_replicas or 1})


def build_application(server_argv: Sequence[str] | argparse.Namespace | None = None, *,
                      num_replicas: int | None = None, autoscaling_config: dict | None = None,
                      replica_num_cpus: float = 1.0, replica_num_gpus: float = 0.0,
                      max_ongoing_requests: int = 64, prefix_affinity_max_imbalance: int = 4,
                      graceful_shutdown_timeout_s: float = 30.0, health_check_period_s: float = 2.0,
                      request_router: str = "prefix_affinity", app_name: str = "jaxbatch"):
    """The Ray Serve application. `server_argv`: `jaxbatch serve` flags for every replica
    (MODEL first, as on the command line; host and port are the proxy's, not theirs)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from jaxbatch.entrypoints.ray_cluster.ingress import Ingress
    from jaxbatch.entrypoints.ray_cluster.replica import EngineReplica
    from jaxbatch.entrypoints.ray_cluster.router import PrefixAffinityRouter, RoundRobinRouter

    args = server_args_of(server_argv)
    scale = scale_options(num_replicas, autoscaling_config)
    if request_router not in REQUEST_ROUTERS:
        raise ValueError(f"request_router must be one of {', '.join(REQUEST_ROUTERS)}, "
                         f"got {request_router!r}")
    if request_router == "prefix_affinity":
        scale["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"max_imbalance": prefix_affinity_max_imbalance})
    elif request_router == "round_robin":
        scale["request_router_config"] = RequestRouterConfig(
            request_router_class=RoundRobinRouter)
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": replica_num_cpus, "num_gpus": replica_num_gpus},
        max_ongoing_requests=max_ongoing_requests,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        health_check_period_s=health_check_period_s,
        **scale)
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(1000, 4 * max_ongoing_requests))
    return ingress.bind(engine.bind(args, app_name), app_name)


def deploy(server_argv: Sequence[str] | argparse.Namespace | None = None, *,
           host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/",
           app_name: str = "jaxbatch", **options) -> str:
    """Starts Ray Serve's proxy on the connected cluster (`ray.init` first; else a local one)
    and runs the application; returns once every replica is ready, with the base URL."""
    from ray import serve
    application = build_application(server_argv, app_name=app_name, **options)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name=app_name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve
    ray_flags = ("ray_address", "host", "port", "app_name", "route_prefix", "num_replicas",
                 "autoscaling_config", "replica_num_cpus", "replica_num_gpus",
                 "max_ongoing_requests", "prefix_affinity_max_imbalance",
                 "graceful_shutdown_timeout", "request_router")
    ray_opts = {k: getattr(args, k) for k in ray_flags}
    server_args = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                        if k not in ray_flags and k != "command"})
    server_args = server_args_of(server_args)
    scale_options(ray_opts["num_replicas"], ray_opts["autoscaling_config"])   # before Ray starts
    ray.init(address=ray_opts.pop("ray_address"))
    ray_opts["graceful_shutdown_timeout_s"] = ray_opts.pop("graceful_shutdown_timeout")
    url = deploy(server_args, **ray_opts)
    print(f"jaxbatch ray-serve: serving at {url}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(ray_opts["app_name"])      # each replica drains (graceful_shutdown_timeout)
    return 0
