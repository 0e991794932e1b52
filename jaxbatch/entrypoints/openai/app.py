"""The FastAPI application: routes, authentication, error bodies, lifecycle.

Every error leaves as OpenAI's body, {"error": {"message", "type", "param", "code"}}, with the
HTTP status in `code`: schema problems (FastAPI would say 422) and bad values are 400, a wrong
or missing --api-key 401, an unknown model or route 404, and "not now" (starting, draining,
queue cap) 503 with Retry-After.

Lifecycle: the lifespan starts the AsyncLLM, whose engine thread loads the weights while
uvicorn already listens (/health answers 503 until the engine is ready and warm). SIGTERM or
SIGINT is turned into `drain` by cli.py: /health and new requests get 503, admitted requests
finish for up to --shutdown-timeout seconds, the rest are aborted, and the process exits 0.
/health is also 503 while a tokenizer worker is stuck (tokenizer_pool.py).

Guards, outermost first: ConcurrencyGuard (probes exempt), the API key, BodyLimit (guards.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import secrets

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.async_llm import READY, AsyncLLM, EngineDeadError, EngineUnavailableError
from jaxbatch.entrypoints.openai.embeddings import embeddings_router
from jaxbatch.entrypoints.openai.errors import APIError, error_response
from jaxbatch.entrypoints.openai.guards import BodyLimit, ConcurrencyGuard
from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry, lora_router, models_response
from jaxbatch.entrypoints.openai.metrics import ServerMetrics
from jaxbatch.entrypoints.openai.preprocess import DEFAULT_MAX_PROMPTS_PER_REQUEST, Preprocessor
from jaxbatch.entrypoints.openai.responses import ResponsesRequest, ResponsesServing
from jaxbatch.entrypoints.openai.serving import OpenAIServing, with_cancellation

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
# /reset_prefix_cache changes server state: it needs the key like every /v1 route.
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")


class _APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would wrap streaming responses and disconnects)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                response = error_response(
                    401, "Incorrect or missing API key (send 'Authorization: Bearer KEY')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _version() -> str:
    try:
        return importlib.metadata.version("jaxbatch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_app(engine_factory, *, served_model_name: str, model_root: str | None = None,
              api_key: str | None = None, max_queued_requests: int | None = None,
              on_engine_dead=None, trust_request_chat_template: bool = False,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_concurrent_requests: int | None = None,
              tool_parser: str | None = None, lora: LoRARegistry | None = None) -> FastAPI:
    """`engine_factory()` builds the LLMEngine on the engine thread (after the port is bound).
    `on_engine_dead(exc)` is called on the event loop if the engine thread dies. `lora`: the
    served LoRA adapters (lora_routes.py; None: none, and the load route says so)."""
    lora = lora or LoRARegistry(served_model_name)
    metrics = ServerMetrics(served_model_name)
    llm = AsyncLLM(engine_factory, max_queued_requests=max_queued_requests, metrics=metrics,
                   on_dead=on_engine_dead)
    pre = Preprocessor(llm, trust_request_chat_template=trust_request_chat_template,
                       max_prompts_per_request=max_prompts_per_request)
    serving = OpenAIServing(llm, served_model_name, pre, tool_parser, lora)   # tool_parser: "auto"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()        # returns at once: loading happens on the engine thread

        async def start_pool():   # tokenizer copies made before the first request needs them
            with contextlib.suppress(Exception):
                await llm.wait_ready()
                await pre.start()
        warm = asyncio.ensure_future(start_pool())
        yield
        warm.cancel()
        await llm.shutdown()
        pre.close()

    app = FastAPI(title="jaxbatch", version=_version(), lifespan=lifespan)
    app.state.llm, app.state.metrics, app.state.serving = llm, metrics, serving
    app.state.pre = pre

    # ---- errors ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "extra_forbidden" and loc:
            return error_response(400, f"'{loc[-1]}' is not supported by this server", loc[0])
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{e.get('msg')}" for e in errors[:5]) or "invalid request"
        return error_response(400, message, loc[0] if loc else None)

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request, exc: EngineUnavailableError):
        return error_response(503, str(exc), None, {"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc: EngineDeadError):
        return error_response(503, str(exc), None, {"Retry-After": "30"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return error_response(500, f"{type(exc).__name__}: {exc}")

    # ---- authentication: every /v1 route and tokenize/detokenize, as vLLM does ---------------
    # Checked in ASGI middleware, before routing reads the body: a request without the key
    # gets 401 whatever its body holds (a dependency would answer malformed JSON with 400).
    # Starlette wraps the last added outermost: concurrency guard, then the key, then the body.
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    if max_concurrent_requests is not None:
        app.add_middleware(ConcurrencyGuard, limit=max_concurrent_requests)
    v1 = APIRouter()

    @v1.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        return _respond(await with_cancellation(raw, serving.create_chat(req)))

    responses = ResponsesServing(serving)      # /v1/responses: the chat path, stateless

    @v1.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return _respond(await with_cancellation(raw, responses.create(req)))

    @v1.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        return _respond(await with_cancellation(raw, serving.create_completion(req)))

    def _respond(result):
        if result is None:     # the client disconnected; the request was aborted
            return Response(status_code=499)
        if isinstance(result, P._Model):
            return JSONResponse(result.model_dump())
        return result

    @v1.get("/v1/models")
    async def models():
        max_len = llm.engine.config.max_model_len if llm.engine is not None else None
        card = P.ModelCard(id=served_model_name, root=model_root, max_model_len=max_len)
        return models_response(card, lora)     # LoRA: each adapter, with the base as parent

    def _require_ready():
        if llm.state == READY:
            return
        if llm.engine is None and llm.state != "dead":
            raise EngineUnavailableError("the server is starting: the model is loading", 5)
        if llm.state == "dead":
            raise EngineDeadError(f"the engine has stopped: {llm.error!r}")

    @v1.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request):
        """vLLM's: forget every cached prefix (e.g. after a benchmark's warm-up). Body-less, as
        vLLM's, so a web page could fire it cross-site without a CORS preflight: browsers
        always name the page's Origin on such a POST, other clients send none, so a foreign
        Origin is refused (a POST from a page served by this host itself is allowed)."""
        origin = raw.headers.get("origin")
        if origin is not None and origin.split("://", 1)[-1] != raw.headers.get("host"):
            raise APIError(403, f"cross-origin POST /reset_prefix_cache refused (Origin {origin})")
        _require_ready()
        llm.reset_prefix_cache()
        return Response(status_code=200)

    def _check_fields(req):
        bad = P.check_fields(req)
        if bad:
            raise APIError(400, bad[1], bad[0])

    @v1.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest):
        _require_ready()
        serving.check_model(req.model)
        _check_fields(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            chat = P.ChatCompletionRequest(messages=req.messages,
                                           add_generation_prompt=req.add_generation_prompt)
            bad = chat.unsupported()
            if bad:
                raise APIError(400, bad[1], bad[0])
            ids = await pre.chat_ids(chat)
        else:
            ids = await pre.tokenize_text(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}

    @v1.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest):
        _require_ready()
        serving.check_model(req.model)
        _check_fields(req)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        vocab = llm.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await pre.detokenize(req.tokens)}

    app.include_router(v1)
    app.include_router(lora_router(lora, llm, _require_ready))   # /v1/(un)load_lora_adapter
    app.include_router(embeddings_router(serving))               # /v1/embeddings (--runner pooling)

    # ---- unauthenticated: probes and scrapes --------------------------------------------------
    @app.get("/health")
    async def health():
        stuck = pre.pool.stuck()
        if llm.state == READY and stuck:
            return error_response(503, f"{stuck} tokenizer worker(s) stuck on abandoned work",
                                  None, {"Retry-After": "5"})
        if llm.state == READY:
            return Response(status_code=200)
        why = {"starting": "the engine is starting", "draining": "the server is draining",
               "dead": f"the engine thread died: {llm.error!r}"}.get(llm.state, llm.state)
        return error_response(503, why, None, {"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    return app
