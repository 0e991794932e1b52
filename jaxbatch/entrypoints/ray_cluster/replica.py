"""One engine replica of the Ray Serve deployment: the FastAPI app `jaxbatch serve` runs (built
from the same flags by server_app.py), with its engine thread, run inside the replica's actor.

- Ready only once the engine is loaded and warm (the async constructor waits), so Ray routes
  nothing to a replica that would answer 503.
- `forward` runs one forwarded HTTP request through the app (asgi_bridge.py) and streams the
  response back to the ingress.
- `check_health` fails once the engine thread has died: Ray replaces the replica.
- On scale-down Ray stops routing to the replica and waits for its ongoing requests (the
  deployment's graceful_shutdown_timeout_s); then `__del__` drains what is left and stops the
  engine.
"""
from __future__ import annotations

import asyncio
import contextlib

import ray
from ray import serve

from jaxbatch.entrypoints.async_llm import DEAD
from jaxbatch.entrypoints.ray_cluster import metrics
from jaxbatch.entrypoints.ray_cluster.asgi_bridge import ForwardedRequest, ResponseStart, run_asgi

REPLICA_HEADER = b"x-jaxbatch-replica"


class EngineReplica:
    async def __init__(self, server_args, app_name: str, drain_timeout_s: float = 5.0):
        from jaxbatch.entrypoints.server_app import server_app
        app = server_app(server_args)
        if app is None:
            raise ValueError("contradictory server flags (see the replica's log)")
        self.app, self.llm, self.drain_timeout_s = app, app.state.llm, drain_timeout_s
        self._lifespan = app.router.lifespan_context(app)
        await self._lifespan.__aenter__()         # starts the engine thread
        await self.llm.wait_ready()                # loaded and warm, or EngineDeadError
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app_name = app_name
        self._board = metrics.board(app_name)
        self._pusher = asyncio.ensure_future(self._push_metrics())

    async def _push_metrics(self):
        while True:
            try:
                text = self.app.state.metrics.render().decode()
                await self._board.push.remote(self.replica_id, text)
            except ray.exceptions.RayActorError:   # the board was restarted: find the new one
                self._board = metrics.board(self.app_name)
            await asyncio.sleep(metrics.PUSH_INTERVAL_S)

    async def forward(self, request: ForwardedRequest):
        async for item in run_asgi(self.app, request):
            if isinstance(item, ResponseStart):   # which replica answered: logs, tests, ops
                item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER,
                                                                   self.replica_id.encode())])
            yield item

    def check_health(self):
        if self.llm.state == DEAD:
            raise RuntimeError(f"the engine thread died: {self.llm.error!r}")

    async def __del__(self):
        pusher = getattr(self, "_pusher", None)      # absent if the constructor failed
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(Exception):
                await self._board.drop.remote(self.replica_id)
            await self.llm.drain(self.drain_timeout_s)
        if getattr(self, "_lifespan", None) is not None:
            await self._lifespan.__aexit__(None, None, None)
