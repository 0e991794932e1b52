"""jaxbatch on a Ray cluster (docs/deploy.md, "Ray").

- deploy.py      `jaxbatch ray-serve`, `build_application`, `deploy`: the server of `jaxbatch
                 serve` as engine replicas behind Ray Serve's HTTP proxy
- ingress.py     the HTTP ingress: relays each request to a replica, merges /metrics
- router.py      the request router: prefix affinity within a load bound (core/replica_choice.py)
- replica.py     one engine replica running the server's own FastAPI app
- multihost.py   one engine over several hosts: its jax.distributed processes as Ray actors

Ray is imported only by these modules (the `ray` extra).
"""
