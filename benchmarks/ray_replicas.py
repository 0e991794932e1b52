"""`jaxbatch ray-serve` with one engine replica against two, and the prefix-affinity router
against round robin and Ray Serve's default one, on a local Ray cluster started here.

    python -m benchmarks ray-replicas                        # the embedded model, 2 raylets
    python -m benchmarks ray-replicas --model PATH --server-args "--max-num-seqs 32"

Four deployments, one after the other, on the same cluster (`--nodes` raylets of
`--node-cpus` CPUs each; a replica reserves `--node-cpus`, so two replicas land on two nodes):
one replica, two replicas behind the prefix-affinity router, two behind round robin, two
behind Ray Serve's power-of-two-choices router. Each, once ready, gets:

1. a multi-turn workload: `--conversations` conversations of `--turns` turns; turn t's prompt
   is the conversation's first t+1 messages (the model's replies are left out, so the shared
   prefix is exactly the previous turn's prompt). Turn t of every conversation is sent at
   once, after turn t-1 has finished, so a turn's prefix lies in the cache of whichever
   replica served the turn before. The prefix-cache hit rate is read from the replicas' own
   counters (`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, prompt tokens, on the
   ingress's merged /metrics), not guessed here. One replica holds every prefix: its rate is
   what a router could reach at best. Read it beside the requests each replica served: prefix
   affinity may keep conversations together on one replica, within its load bound
   (`--prefix-affinity-max-imbalance`, as `jaxbatch ray-serve`'s).
2. the mixed chat workload of `jaxbatch bench serve` (`--num-prompts`, all sent at once
   unless `--request-rate`), through Serve's HTTP proxy with the same client: output
   throughput and TTFT (mean, median, p99).

Prints one JSON line, then a markdown table. What one machine can show: the routing's hit rate
is meaningful (it depends on which replica gets which request, not on speed). What it cannot:
two replicas on the cores of one machine share those cores (and its memory bandwidth), so
their throughput is not expected to double; the throughput columns say what the second
replica and the proxy cost or gain here, not what a second machine would add.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import socket
import time

from jaxbatch.benchmarks.report import fmt, table, trio
from jaxbatch.benchmarks.workloads import ServeRequest, load_prompts, make_workload

# --deployments names: (replicas, request router, the table's label)
DEPLOYMENTS = {"one": (1, "prefix_affinity", "1 replica"),
               "affinity": (2, "prefix_affinity", "2 replicas, prefix affinity"),
               "rr": (2, "round_robin", "2 replicas, round robin"),
               "pow2": (2, "power_of_two_choices", "2 replicas, power of two choices")}
APP = "ray-replicas"
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_success_total")


def conversations(num: int, turns: int, max_tokens: int) -> list[list[ServeRequest]]:
    """Round t: turn t of every conversation. Messages come from the bundled prompt set;
    each conversation opens with its own header, so conversations share no prefix."""
    texts = [p["text"] for p in load_prompts()]
    rounds = []
    for t in range(turns):
        round_ = []
        for c in range(num):
            messages = [texts[(c * turns + i) % len(texts)] for i in range(t + 1)]
            prompt = f"Conversation {c}.\n" + "".join(f"User: {m}\n" for m in messages)
            round_.append(ServeRequest(t * num + c, f"conv{c}-turn{t}", "multi-turn", prompt,
                                       max_tokens, 0.0))
        rounds.append(round_)
    return rounds


def replica_counters(base: str) -> dict[str, dict[str, float]]:
    """{replica: {counter: value}} from the ingress's merged /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base + "/metrics", timeout=30, trust_env=False).text
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS and "replica" in s.labels:
                per = found.setdefault(s.labels["replica"], dict.fromkeys(COUNTERS, 0.0))
                per[s.name] += s.value
    return found


def counters_after(base: str, served: int, timeout: float = 60.0):
    """The counters once every replica has pushed the `served` requests' results (replicas
    push their metrics every second). A connection the proxy drops is asked again (once, in
    a suite run beside other tests, it reset one), until the same deadline."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        try:
            now = replica_counters(base)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        done = sum(c["vllm:request_success_total"] for c in now.values())
        if done >= served:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replicas' metrics count {done} requests, not {served}")
        time.sleep(0.5)


def run_rounds(base: str, rounds, model: str | None) -> dict:
    from jaxbatch.benchmarks.serve_client import run_load
    failed = 0
    for round_ in rounds:
        out = asyncio.run(run_load(base, round_, api="completions", model=model,
                                   health_interval=None))
        failed += out["summary"]["failed"]
    return {"requests": sum(map(len, rounds)), "failed": failed}


def measure(base: str, name: str, args, server_argv: list[str]) -> dict:
    """One deployment: deployed, the multi-turn workload, the chat workload, deleted."""
    from ray import serve

    from jaxbatch.benchmarks.serve_client import run_load
    from jaxbatch.entrypoints.ray_cluster.deploy import build_application
    replicas, router, label = DEPLOYMENTS[name]
    start = time.perf_counter()
    serve.run(build_application(server_argv, num_replicas=replicas, request_router=router,
                                replica_num_cpus=args.node_cpus, app_name=APP,
                                prefix_affinity_max_imbalance=args.prefix_affinity_max_imbalance),
              name=APP, route_prefix="/")
    ready_s = time.perf_counter() - start
    try:
        rounds = conversations(args.conversations, args.turns, args.turn_max_tokens)
        multi_turn = run_rounds(base, rounds, args.served_model_name)
        counted = counters_after(base, multi_turn["requests"] - multi_turn["failed"])
        hits = sum(c["vllm:prefix_cache_hits_total"] for c in counted.values())
        queries = sum(c["vllm:prefix_cache_queries_total"] for c in counted.values())
        multi_turn.update(
            prefix_cache_hit_tokens=hits, prefix_cache_query_tokens=queries,
            prefix_cache_hit_rate=hits / queries if queries else None,
            requests_per_replica=sorted(int(c["vllm:request_success_total"])
                                        for c in counted.values()))
        workload = make_workload(args.num_prompts, (args.output_median, 1.0, 8,
                                                    args.output_max), args.seed)
        if args.warmup_requests:
            asyncio.run(run_load(base, workload[:args.warmup_requests], api="chat",
                                 model=args.served_model_name, health_interval=None))
        served = asyncio.run(run_load(base, workload, rate=args.request_rate, api="chat",
                                      model=args.served_model_name,
                                      health_interval=None))["summary"]
    finally:
        serve.delete(APP)
    return {"deployment": name, "label": label, "replicas": replicas, "router": router,
            "ready_s": round(ready_s, 1), "multi_turn": multi_turn,
            "served": {k: served[k] for k in ("num_requests", "completed", "failed", "errors",
                                              "duration_s", "output_tokens",
                                              "output_tokens_per_s", "ttft", "tpot")}}


def markdown(rows: list[dict]) -> str:
    head = ["deployment", "prefix-cache hit rate (multi-turn)", "requests per replica",
            "output tok/s", "TTFT mean/median/p99 ms", "failed"]
    return table(head, [[r["label"],
                         fmt(100 * r["multi_turn"]["prefix_cache_hit_rate"], 1) + " %"
                         if r["multi_turn"]["prefix_cache_hit_rate"] is not None else "-",
                         "/".join(map(str, r["multi_turn"]["requests_per_replica"])),
                         fmt(r["served"]["output_tokens_per_s"]), trio(r["served"]["ttft"]),
                         r["multi_turn"]["failed"] + r["served"]["failed"]] for r in rows])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None, serve_base: str | None = None) -> dict:
    """`serve_base`: run on the Ray cluster this process is already connected to, whose Serve
    proxy answers at that URL (a test's cluster), rather than start one here."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks ray-replicas",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--server-args", default="",
                    help="more `jaxbatch serve` flags for every replica, one string")
    ap.add_argument("--nodes", type=int, default=2, help="raylets started on this machine")
    ap.add_argument("--node-cpus", type=float, default=1.0,
                    help="CPUs each raylet offers, and each replica reserves")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS),
                    help="comma-separated, of: " + "; ".join(
                        f"{k} ({label})" for k, (_, _, label) in DEPLOYMENTS.items()))
    ap.add_argument("--prefix-affinity-max-imbalance", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-max-tokens", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48, help="the chat workload's requests")
    ap.add_argument("--output-median", type=float, default=32.0)
    ap.add_argument("--output-max", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEPLOYMENTS]
    if unknown or not names:
        ap.error(f"--deployments: unknown {unknown}; choose from {list(DEPLOYMENTS)}")
    if any(DEPLOYMENTS[n][0] > args.nodes for n in names):
        ap.error("two replicas need --nodes 2 (a replica reserves a node's CPUs)")
    # Every replica gets the same flags; block granularity, so that a shared prefix shorter
    # than a prefill chunk is still a hit (docs/deploy.md, Ray Serve).
    server_argv = ([args.model] if args.model else []) + [
        "--prefix-cache-granularity", "block", *shlex.split(args.server_args)]
    if args.served_model_name:
        server_argv += ["--served-model-name", args.served_model_name]

    if serve_base is not None:
        rows = [measure(serve_base, name, args, server_argv) for name in names]
    else:
        rows = _on_a_local_cluster(args, lambda base: [measure(base, name, args, server_argv)
                                                       for name in names])
    result = {"instrument": "ray-replicas", "nodes": args.nodes, "node_cpus": args.node_cpus,
              "cpu_cores": len(os.sched_getaffinity(0)), "server_argv": server_argv,
              "conversations": args.conversations, "turns": args.turns,
              "num_prompts": args.num_prompts,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
              "deployments": rows}
    print(json.dumps(result, default=str))
    print()
    print(markdown(rows))
    return result


def _on_a_local_cluster(args, run):
    """`run(base)` on `--nodes` raylets started here, with Serve's proxy; all torn down after."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    node = dict(num_cpus=args.node_cpus, include_dashboard=False)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        return run(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
