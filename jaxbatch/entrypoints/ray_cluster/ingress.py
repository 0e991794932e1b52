"""The deployment's HTTP ingress: Ray Serve's proxy hands it every request; it forwards each
one to an engine replica through a streaming handle (the request router picks the replica by
the request's routing key) and relays the replica's response, byte for byte.

What only the ingress can answer:
- /metrics: every replica's metrics, labelled by replica (metrics.py).
- Routes that change one server's state (/v1/load_lora_adapter, /v1/unload_lora_adapter,
  /reset_prefix_cache) would reach one replica of several: refused with 400 (serve adapters
  with --lora-modules, which every replica loads).
- A replica that dies under a request: a 503 with OpenAI's error body if nothing was sent yet,
  else an error event closing the stream (`data: {"error": ...}`, then `data: [DONE]`). Only
  that replica's requests see it; Ray starts a replacement.
"""
# No `from __future__ import annotations`: FastAPI reads this class's route signatures through
# Ray Serve's class-based view, which needs the annotations as objects.
import json
import logging

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError

from jaxbatch.entrypoints.openai.errors import ERROR_TYPES, error_response
from jaxbatch.entrypoints.ray_cluster import metrics
from jaxbatch.entrypoints.ray_cluster.asgi_bridge import ForwardedRequest, ResponseStart

logger = logging.getLogger(__name__)

ONE_REPLICA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache")
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions")
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

app = FastAPI(title="jaxbatch on Ray Serve")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text", "") if isinstance(part, dict) else part)
                       for part in content)
    return ""


def routing_key(path: str, body: bytes) -> str:
    """What decides prefix reuse on a replica: the model (an adapter's KV is its own), the
    cache salt, then the prompt as text. Empty for anything else (plain least-loaded)."""
    if path not in PROMPT_ROUTES:
        return ""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    head = f"{req.get('model', '')}\x00{req.get('cache_salt') or ''}\x00"
    if isinstance(req.get("messages"), list):
        return head + "".join(f"{m.get('role', '')}\x01{_text(m.get('content'))}\x02"
                              for m in req["messages"] if isinstance(m, dict))
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]        # a batch of prompts: routed by its first
    if isinstance(prompt, list):
        return head + " ".join(str(t) for t in prompt)
    return head + prompt if isinstance(prompt, str) else ""


def _error_event(status: int, message: str) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None,
             "code": status}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


@serve.ingress(app)
class Ingress:
    def __init__(self, engine, app_name: str):
        self.engine, self.app_name = engine, app_name
        self.board = metrics.board(app_name)

    @app.get("/metrics")
    async def prometheus_metrics(self):
        return Response(metrics.merge(await self.board.texts.remote()),
                        media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(self, path: str, raw: Request):
        if raw.url.path in ONE_REPLICA_ROUTES:
            return error_response(400, f"{raw.url.path} is not supported behind the Ray "
                                       "deployment: it would reach one replica of several "
                                       "(serve adapters with --lora-modules)")
        body = await raw.body()
        request = ForwardedRequest(raw.method, raw.url.path, raw.url.query.encode(),
                                   list(raw.headers.raw), body, routing_key(raw.url.path, body))
        stream = self.engine.options(stream=True).forward.remote(request)
        try:
            start = await stream.__anext__()
        except BackPressureError as e:
            return error_response(503, f"every replica is at capacity: {e}", None,
                                  {"Retry-After": "1"})
        except REPLICA_LOST as e:
            logger.warning("replica lost before answering %s: %s", raw.url.path, e)
            return error_response(503, "the replica serving this request stopped before "
                                       "answering; Ray is replacing it: retry", None,
                                  {"Retry-After": "1"})
        assert isinstance(start, ResponseStart), start
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                   if k.lower() not in (b"content-length", b"transfer-encoding")}
        is_sse = headers.get("content-type", "").startswith("text/event-stream")

        async def relay_body():
            finished = False
            try:
                async for chunk in stream:
                    yield chunk
                finished = True
            except REPLICA_LOST as e:
                finished = True
                logger.warning("replica lost mid-response on %s: %s", raw.url.path, e)
                if is_sse:
                    yield _error_event(503, "the replica serving this stream stopped; Ray is "
                                            "replacing it: retry the request")
                else:
                    raise
            finally:
                if not finished:        # our client left: the replica aborts the request
                    stream.cancel()
        return StreamingResponse(relay_body(), status_code=start.status, headers=headers)

    async def __del__(self):
        ray.kill(self.board)
